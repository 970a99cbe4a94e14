"""The wire format for IPC wrappers: typed, versioned, allow-listed, never pickled.

An engine sends its per-layer wrappers to a KV-cache server in another process.
Upstream LMCache's discovery-era platform layer pickled them (a msgpack ext holding
``pickle.dumps(wrapper)``), so anyone who could reach the server's socket could run
code in it. Its 0.5.6 release sends wrappers as data-only structs and refuses pickle
on that path, but can carry only its built-in wrapper classes, and its engine-driven
data transport still unpickles what the other process sends. Here a message is data
only, and a backend's own wrapper classes travel too::

    b"LMCW" | version (1 byte) | msgpack [record, ...]
    record (version 2) = [device_type, wire_tag, {export field: primitive}, [view, ...]]
    view               = [dtype, shape, stride, storage_offset]

A record is one *export* (the memory: device, handle, size; every field of
:meth:`~lmcache_platform.DeviceIPCWrapper.export_fields`) and the views of it that follow each other in
the list, so current vLLM's 32 layer views of one allocation travel as one record
with the handle once. Version 1 records (``[device_type, wire_tag, {field:
primitive}]``, one wrapper each) are still accepted. The decoder checks the
device-type string, looks the tag up in an allow-list (by default the wire classes of
the backend this process resolved for that device type) and rebuilds the wrappers
with :meth:`~lmcache_platform.DeviceIPCWrapper.from_views`, which validates the export's fields once
and every view's fields. Nothing is mapped while decoding;
:meth:`~lmcache_platform.DeviceIPCWrapper.to_tensor` does that later.

Every malformed, unknown, truncated or oversized input raises
:class:`~lmcache_platform.WireFormatError` and nothing else; the original error,
if any, is its ``__cause__``. See ``docs/wire-format.md``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from . import _checks, _codec
from ._env import BACKEND_ENV
from ._errors import LMCachePlatformError, WireFormatError
from ._ipc_wrapper import VIEW_FIELDS, DeviceIPCWrapper, Primitive

#: First bytes of every encoded wrapper list.
MAGIC = b"LMCW"
#: Format version; bumped on any incompatible change of the record layout.
VERSION = 2
#: Earlier versions the decoder still accepts (one wrapper per record).
OLDER_VERSIONS = (1,)
#: Most wrappers in one message (one per layer; plane tuples count separately).
MAX_WRAPPERS = 4096
#: Largest encoded message, header included.
MAX_MESSAGE_BYTES = 4 << 20
#: Most fields in one record.
MAX_FIELDS = 64

#: Device types are torch device-type names: ``cpu``, ``cuda``, ``xpu``, ``npu``...
DEVICE_TYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
#: Wire tags are short ASCII names such as ``cpu.shm/1``.
WIRE_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:+-]{0,63}")

_LIMITS = _codec.Limits(
    max_bytes=MAX_MESSAGE_BYTES,
    max_array_len=MAX_WRAPPERS,
    max_map_len=MAX_FIELDS,
    max_str_len=4096,
    max_bin_len=64 << 10,
)
_WHAT = "wrapper message"


def encode(wrappers: Sequence[DeviceIPCWrapper]) -> bytes:
    """Encode ``wrappers`` (in order) to bytes that :func:`decode` accepts.

    Consecutive wrappers of one class with equal
    :meth:`~lmcache_platform.DeviceIPCWrapper.export_fields` share one record. Raises
    :class:`~lmcache_platform.WireFormatError` if an item is not a wrapper, its
    class has no valid ``device_type``/``wire_tag``, or the message would exceed the limits.
    Wrappers with file-descriptor fields need :func:`encode_with_fds`.
    """
    return _encode(wrappers, None)


def encode_with_fds(wrappers: Sequence[DeviceIPCWrapper]) -> tuple[bytes, list[int]]:
    """Like :func:`encode`, for wrappers whose fields include file descriptors.

    Returns the message and the fds to send beside it (``SCM_RIGHTS``), in the order
    the message's indices name them; the fds stay owned by the wrappers.
    """
    fds: list[int] = []
    return _encode(wrappers, fds), fds


def _encode(wrappers: Sequence[DeviceIPCWrapper], fds: list[int] | None) -> bytes:
    if len(wrappers) > MAX_WRAPPERS:
        raise WireFormatError(f"{len(wrappers)} wrappers exceed the limit of {MAX_WRAPPERS}")
    records: list[list[object]] = []
    named: set[type[DeviceIPCWrapper]] = set()  # classes whose device type and tag passed
    last: tuple[type[DeviceIPCWrapper], dict[str, Primitive]] | None = None
    views: list[list[Primitive]] = []
    index: dict[int, int] = {}  # fd -> its place in ``fds``
    for i, wrapper in enumerate(wrappers):
        if not isinstance(wrapper, DeviceIPCWrapper):
            raise WireFormatError(f"item {i}: expected a DeviceIPCWrapper, got {type(wrapper).__name__}")
        cls = type(wrapper)
        if cls not in named:
            if not (DEVICE_TYPE_RE.fullmatch(cls.device_type) and WIRE_TAG_RE.fullmatch(cls.wire_tag)):
                raise WireFormatError(
                    f"item {i}: {cls.__qualname__} needs a valid device_type and wire_tag "
                    f"(got {cls.device_type!r}, {cls.wire_tag!r})"
                )
            if fds is None and _fd_fields(cls):
                raise WireFormatError(
                    f"item {i}: {cls.__qualname__} carries file descriptors ({', '.join(_fd_fields(cls))}); "
                    "send it with wire.encode_with_fds over a transport that passes them"
                )
            named.add(cls)
        try:
            export, view = wrapper.export_fields(), wrapper.view_fields()
        except LMCachePlatformError as exc:
            raise WireFormatError(f"item {i} ({cls.wire_tag}): {exc}") from exc
        if last is None or last[0] is not cls or last[1] != export:
            last, views = (cls, export), []
            on_wire = dict(export)
            if fds is not None:
                for name in _fd_fields(cls):
                    on_wire[name] = _to_indices(export[name], fds, index)
            records.append([cls.device_type, cls.wire_tag, on_wire, views])
        views.append([view[name] for name in VIEW_FIELDS])
    return _codec.pack(MAGIC, VERSION, records, max_bytes=MAX_MESSAGE_BYTES, what=_WHAT)


def _fd_fields(cls: type[DeviceIPCWrapper]) -> list[str]:
    return [name for name, spec in cls.wire_fields.items() if spec.fds]


def _to_indices(value: Primitive, fds: list[int], index: dict[int, int]) -> Primitive:
    def one(fd: int) -> int:
        if fd not in index:
            index[fd] = len(fds)
            fds.append(fd)
        return index[fd]

    if isinstance(value, list):
        return [one(fd) for fd in value]
    assert isinstance(value, int)
    return one(value)


class _Fds:
    """The fds received with a message: each decoded field gets its own (later uses ``dup``)."""

    def __init__(self, fds: Sequence[int]) -> None:
        self.received = list(fds)
        self.used: set[int] = set()
        self.dups: list[int] = []
        self.claimed: set[int] = set()

    def resolve(self, where: str, cls: type[DeviceIPCWrapper], fields: dict[object, object]) -> list[int]:
        """Replace ``fields``' fd indices by fds in place; returns the fds placed."""
        placed: list[int] = []

        def one(i: object) -> int:
            if type(i) is not int or not 0 <= i < len(self.received):
                sent = len(self.received)
                raise WireFormatError(f"{where}: fd index {i!r} names none of the {sent} fds sent")
            if i in self.used:
                fd = os.dup(self.received[i])
                self.dups.append(fd)
            else:
                self.used.add(i)
                fd = self.received[i]
            placed.append(fd)
            return fd

        for name in _fd_fields(cls):
            value = fields.get(name)
            if isinstance(value, list):
                if len(value) > (cls.wire_fields[name].max_len or MAX_WRAPPERS):
                    raise WireFormatError(f"{where}: {name} lists too many fds")
                fields[name] = [one(i) for i in value]
            elif value is not None:
                fields[name] = one(value)
        return placed

    def close_unclaimed(self) -> None:
        for fd in (*self.received, *self.dups):
            if fd not in self.claimed:
                os.close(fd)


def decode(
    data: bytes,
    *,
    allowed: Mapping[str, type[DeviceIPCWrapper]] | None = None,
    fds: Sequence[int] = (),
    peer_uid: int | None = None,
) -> list[DeviceIPCWrapper]:
    """Decode bytes from :func:`encode`, instantiating only allow-listed classes.

    ``allowed`` maps wire tags to classes. By default each record's device type is
    resolved in this process and only the wire classes of the backend selected for it
    are accepted. Raises :class:`~lmcache_platform.WireFormatError` on any bad input.

    ``fds`` are the file descriptors received with the message (from
    :func:`encode_with_fds`); decode takes ownership of all of them: the decoded
    wrappers own the ones their fields name, the rest are closed, and on failure all
    are. ``peer_uid`` is the sender's user id where the transport knows it: fds from
    another user are refused.
    """
    received = _Fds(fds)
    try:
        if received.received and peer_uid is not None and peer_uid != os.getuid():
            raise WireFormatError(
                f"refused {len(received.received)} file descriptor(s) from a process of uid {peer_uid}: "
                f"this process runs as uid {os.getuid()}; run the engine and the server as the same user"
            )
        body = _codec.unpack(MAGIC, VERSION, data, _LIMITS, what=_WHAT, older=OLDER_VERSIONS)
        version = bytes(data[4:5])[0]  # unpack checked the header
        records = _checks.expect_list(body, _WHAT, max_len=MAX_WRAPPERS)
        classes_by_type: dict[str, Mapping[str, type[DeviceIPCWrapper]]] = {}
        out: list[DeviceIPCWrapper] = []
        try:
            for i, record in enumerate(records):
                room = MAX_WRAPPERS - len(out)
                out += _decode_record(i, record, version, allowed, classes_by_type, room=room, fds=received)
        except BaseException:
            for wrapper in out:  # nothing is mapped yet, but leave nothing half-built
                wrapper.close()
            raise
    finally:
        received.close_unclaimed()
    return out


def _decode_record(
    index: int,
    record: object,
    version: int,
    allowed: Mapping[str, type[DeviceIPCWrapper]] | None,
    cache: dict[str, Mapping[str, type[DeviceIPCWrapper]]],
    *,
    room: int,
    fds: _Fds,
) -> list[DeviceIPCWrapper]:
    where = f"record {index}"
    size = 3 if version == 1 else 4
    items = _checks.expect_list(record, where, max_len=size)
    if len(items) != size:
        shape = "fields" if version == 1 else "export fields, views"
        raise WireFormatError(f"{where}: expected [device_type, wire_tag, {shape}]")
    device_type = _checks.expect_str(items[0], f"{where} device type", max_len=32, pattern=DEVICE_TYPE_RE)
    tag = _checks.expect_str(items[1], f"{where} wire tag", max_len=64, pattern=WIRE_TAG_RE)
    fields = items[2]
    if not isinstance(fields, dict):
        raise WireFormatError(f"{where} ({tag}): fields must be a map, got {type(fields).__name__}")
    views: list[dict[str, object]] | None = None
    if version != 1:
        rows = _checks.expect_list(items[3], f"{where} ({tag}) views", max_len=room)
        if not rows:
            raise WireFormatError(f"{where} ({tag}): an export record needs at least one view")
        views = []
        for j, row in enumerate(rows):
            cells = _checks.expect_list(row, f"{where} ({tag}) view {j}", max_len=len(VIEW_FIELDS))
            if len(cells) != len(VIEW_FIELDS):
                raise WireFormatError(f"{where} ({tag}) view {j}: expected [{', '.join(VIEW_FIELDS)}]")
            views.append(dict(zip(VIEW_FIELDS, cells, strict=True)))
    elif room < 1:
        raise WireFormatError(f"more than {MAX_WRAPPERS} wrappers in one message")

    if allowed is None:
        classes = cache.get(device_type)
        if classes is None:
            classes = cache[device_type] = _classes_for(where, device_type)
    else:
        classes = allowed
    cls = classes.get(tag)
    if cls is None:
        accepted = ", ".join(sorted(classes)) or "none"
        raise WireFormatError(
            f"{where}: wire tag {tag!r} is not accepted for device type {device_type!r} "
            f"(accepted: {accepted})" + (_remedy(device_type, tag) if allowed is None else "")
        )
    if cls.device_type != device_type:
        raise WireFormatError(
            f"{where}: wire tag {tag!r} belongs to device type {cls.device_type!r}, not {device_type!r}"
        )
    placed = fds.resolve(f"{where} ({tag})", cls, fields) if _fd_fields(cls) else []
    try:
        made = [cls.from_fields(fields)] if views is None else list(cls.from_views(fields, views))
    except Exception as exc:  # a constructor refusing hostile fields is the input's fault
        raise WireFormatError(f"{where} ({tag}): {exc}") from exc
    if made:
        fds.claimed.update(placed)  # the wrappers own them now
    return made


def _remedy(device_type: str, tag: str) -> str:
    """What to do about a tag this process refuses: both sides must select one backend."""
    from ._plugins import registry

    try:
        info = registry.selected_backend(device_type)
        mine = f"this process selected backend {info.name!r}"
        mine += f" ({info.distribution} {info.version})" if info.distribution else ""
    except LMCachePlatformError:
        mine = "this process's allow-list was registered in-process"
    return (
        f"; {mine} for {device_type!r}. The sending and the receiving process must select the "
        f"same backend: set the same {BACKEND_ENV} for both, or install here the "
        f"backend whose wire tag is {tag!r}"
    )


def _classes_for(where: str, device_type: str) -> Mapping[str, type[DeviceIPCWrapper]]:
    from ._plugins import registry

    try:
        return registry.wire_classes_for(device_type)
    except LMCachePlatformError as exc:
        raise WireFormatError(
            f"{where}: device type {device_type!r} is not served in this process: {exc}"
        ) from exc


__all__ = [
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MAX_WRAPPERS",
    "OLDER_VERSIONS",
    "VERSION",
    "decode",
    "encode",
    "encode_with_fds",
]

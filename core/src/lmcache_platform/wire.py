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

Memory named by file descriptors (``WireField(fds=True)``: a CUDA VMM allocation
exported as a POSIX fd) cannot travel as numbers: :func:`encode_with_fds` puts each
distinct fd once in a list to send beside the message (``SCM_RIGHTS``) and writes its
index into the field; :func:`decode` takes the fds that arrived (``fds=``) and writes
them back, each index checked, every received fd owned by the wrappers of its export or
closed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from . import _checks, _codec
from ._env import BACKEND_ENV
from ._errors import LMCachePlatformError, WireFormatError
from ._ipc_wrapper import VIEW_FIELDS, DeviceIPCWrapper, Primitive, SharedFds, fd_fields

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
#: Most file-descriptor values one message may name (repeats count: each becomes an fd).
MAX_FDS_HANDED = 4096

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
    class has no valid ``device_type``/``wire_tag``, the message would exceed the
    limits, or a wrapper names its memory by file descriptors (those need a transport
    that passes fds: :func:`encode_with_fds`).
    """
    data, fds = encode_with_fds(wrappers)
    if fds:
        raise WireFormatError(
            f"these wrappers name their memory by {len(fds)} file descriptor(s), which bytes alone cannot "
            "carry: send them with wire.encode_with_fds over a UNIX socket (ServerClient.register does)"
        )
    return data


def encode_with_fds(wrappers: Sequence[DeviceIPCWrapper]) -> tuple[bytes, list[int]]:
    """Like :func:`encode`, for wrappers that may name memory by file descriptors.

    Returns the message and the fds to send beside it, in the order its indices name
    them (each distinct fd once; the caller keeps its own copies open).
    """
    if len(wrappers) > MAX_WRAPPERS:
        raise WireFormatError(f"{len(wrappers)} wrappers exceed the limit of {MAX_WRAPPERS}")
    records: list[list[object]] = []
    named: set[type[DeviceIPCWrapper]] = set()  # classes whose device type and tag passed
    fds: list[int] = []
    last: tuple[type[DeviceIPCWrapper], dict[str, Primitive]] | None = None
    views: list[list[Primitive]] = []
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
            named.add(cls)
        try:
            export, view = wrapper.export_fields(), wrapper.view_fields()
        except LMCachePlatformError as exc:
            raise WireFormatError(f"item {i} ({cls.wire_tag}): {exc}") from exc
        if last is None or last[0] is not cls or last[1] != export:
            last, views = (cls, export), []
            records.append([cls.device_type, cls.wire_tag, _fds_to_indices(cls, export, fds), views])
        views.append([view[name] for name in VIEW_FIELDS])
    return _codec.pack(MAGIC, VERSION, records, max_bytes=MAX_MESSAGE_BYTES, what=_WHAT), fds


def _fds_to_indices(
    cls: type[DeviceIPCWrapper], export: dict[str, Primitive], fds: list[int]
) -> dict[str, Primitive]:
    """``export`` with the values of its fd fields replaced by their indices in ``fds`` (grown)."""
    names = fd_fields(cls)
    if not names:
        return export

    def index(fd: int) -> int:
        if fd not in fds:
            fds.append(fd)
        return fds.index(fd)

    out = dict(export)
    for name in names:
        value = export[name]
        if isinstance(value, list):
            out[name] = [index(fd) for fd in value]
        elif isinstance(value, int):
            out[name] = index(value)
        else:
            raise WireFormatError(f"{cls.__qualname__}.{name}: a file descriptor field holds {value!r}")
    return out


class _Received:
    """The fds that came with a message: handed to exports by index, the rest closed."""

    def __init__(self, fds: Sequence[int]) -> None:
        self.fds = list(fds)
        self._taken: set[int] = set()
        self._loose: list[int] = []  # handed out, not yet owned by a wrapper
        self._handed = 0

    def take(self, where: str, index: object) -> int:
        """The fd at ``index`` for one field (a duplicate when another field took it already)."""
        if type(index) is not int or not 0 <= index < len(self.fds):
            raise WireFormatError(
                f"{where}: file descriptor index {index!r} names none of the {len(self.fds)} that came "
                "with the message"
            )
        if self._handed >= MAX_FDS_HANDED:
            raise WireFormatError(
                f"{where}: more than {MAX_FDS_HANDED} file descriptor fields in one message"
            )
        self._handed += 1
        fd = self.fds[index]
        if index in self._taken:
            fd = os.dup(fd)  # one export's owner closes its fds: never share one between owners
        self._taken.add(index)
        self._loose.append(fd)
        return fd

    def own(self, wrappers: Sequence[DeviceIPCWrapper]) -> None:
        """Hand every fd taken since the last call to ``wrappers`` (one export)."""
        if self._loose:
            owner = SharedFds(self._loose, len(wrappers))
            for wrapper in wrappers:
                wrapper._fd_owner = owner
            self._loose = []

    def close_rest(self) -> None:
        """Close the fds no wrapper owns: never taken, or taken by a record that failed."""
        rest = self._loose + [fd for i, fd in enumerate(self.fds) if i not in self._taken]
        self._loose, self._taken = [], set(range(len(self.fds)))
        for fd in rest:
            try:
                os.close(fd)
            except OSError:
                continue


def decode(
    data: bytes,
    *,
    allowed: Mapping[str, type[DeviceIPCWrapper]] | None = None,
    fds: Sequence[int] = (),
) -> list[DeviceIPCWrapper]:
    """Decode bytes from :func:`encode`, instantiating only allow-listed classes.

    ``allowed`` maps wire tags to classes. By default each record's device type is
    resolved in this process and only the wire classes of the backend selected for it
    are accepted. ``fds`` are the file descriptors that came with the message
    (:func:`encode_with_fds`): the decoder owns them from the call on, hands each to the
    wrappers whose fields name it and closes the rest, also when it raises. Raises
    :class:`~lmcache_platform.WireFormatError` on any bad input.
    """
    received = _Received(fds)
    out: list[DeviceIPCWrapper] = []
    try:
        body = _codec.unpack(MAGIC, VERSION, data, _LIMITS, what=_WHAT, older=OLDER_VERSIONS)
        version = bytes(data[4:5])[0]  # unpack checked the header
        records = _checks.expect_list(body, _WHAT, max_len=MAX_WRAPPERS)
        classes_by_type: dict[str, Mapping[str, type[DeviceIPCWrapper]]] = {}
        for i, record in enumerate(records):
            made = _decode_record(
                i, record, version, allowed, classes_by_type, received, room=MAX_WRAPPERS - len(out)
            )
            received.own(made)
            out += made
    except BaseException:
        for wrapper in out:  # nothing is mapped yet, but leave nothing half-built
            wrapper.close()
        raise
    finally:
        received.close_rest()
    return out


def _decode_record(
    index: int,
    record: object,
    version: int,
    allowed: Mapping[str, type[DeviceIPCWrapper]] | None,
    cache: dict[str, Mapping[str, type[DeviceIPCWrapper]]],
    received: _Received,
    *,
    room: int,
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
    for name in fd_fields(cls):  # indices into the message's fds, before any other check
        if name in fields:
            value = fields[name]
            spot = f"{where} ({tag}) field {name!r}"
            if isinstance(value, list):
                limit = cls.wire_fields[name].max_len
                if limit is not None and len(value) > limit:
                    raise WireFormatError(f"{spot}: {len(value)} file descriptors, at most {limit}")
                fields = {**fields, name: [received.take(spot, v) for v in value]}
            else:
                fields = {**fields, name: received.take(spot, value)}
    try:
        return [cls.from_fields(fields)] if views is None else list(cls.from_views(fields, views))
    except Exception as exc:  # a constructor refusing hostile fields is the input's fault
        raise WireFormatError(f"{where} ({tag}): {exc}") from exc


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

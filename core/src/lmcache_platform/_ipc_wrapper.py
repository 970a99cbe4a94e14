"""``DeviceIPCWrapper``: the engine-side descriptor of one device tensor.

A wrapper is a small value: the tensor's layout (dtype, shape, stride, storage
offset), the identity of its device, and whatever handle the backend needs to
reopen the memory in another process. Subclasses declare their extra fields as
primitives in ``wire_fields`` and a stable ``wire_tag``; the base validates every
field when a wrapper is rebuilt from untrusted data (:meth:`from_fields`), so a
backend never parses wire input by hand.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ._checks import expect_bytes, expect_int, expect_int_list, expect_str
from ._errors import DescriptorError

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

#: dtypes a descriptor may name. Anything else is refused before memory is mapped.
ALLOWED_DTYPES: tuple[str, ...] = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
)

MAX_NDIM = 8
#: Largest file descriptor number a descriptor field may hold (``WireField(fds=True)``).
MAX_FD = (1 << 31) - 1
#: Upper bound for any dimension, stride or offset (in elements): 2**48.
MAX_EXTENT = 1 << 48

Primitive = int | str | bytes | list[int]


@dataclass(frozen=True)
class WireField:
    """Declares one primitive descriptor field and its bounds.

    ``kind`` is ``int``, ``str``, ``bytes`` or ``list`` (a list of ints). ``lo``/``hi``
    bound an int or every element of a list; ``max_len`` bounds a str, bytes or list.

    ``fds=True`` (an ``int`` or a ``list``) makes the values file descriptors: the
    memory is named by fds that travel beside the message (``SCM_RIGHTS`` over the
    server's socket; :func:`lmcache_platform.wire.encode_with_fds`), never by numbers
    another process could not use. In the engine the values are fds of the engine's
    (the wrapper keeps them open until it is closed); in the receiver they are fds the
    decoder received, owned by the wrappers of that export and closed with the last of
    them. Bounds are implied (non-negative ints).
    """

    kind: type
    lo: int | None = None
    hi: int | None = None
    max_len: int | None = None
    fds: bool = False

    def __post_init__(self) -> None:
        if self.fds:
            if self.kind not in (int, list):
                raise TypeError(f"WireField(fds=True) is an int or a list of ints, not {self.kind!r}")
            object.__setattr__(self, "lo", 0)
            object.__setattr__(self, "hi", MAX_FD)

    def check(self, cls_name: str, name: str, value: object) -> Primitive:
        """Return ``value`` if it matches this declaration, else raise ``DescriptorError``.

        The checks are the ones the wire messages' schemas make, raising the descriptor error.
        """
        if self._fits(value):  # the common case, without building an error context
            return list(value) if isinstance(value, tuple) else value  # type: ignore[return-value]
        where, bad = f"{cls_name}.{name}", DescriptorError
        if self.kind is list:
            items = list(value) if isinstance(value, tuple) else value
            return expect_int_list(items, where, lo=self.lo, hi=self.hi, max_len=self.max_len, error=bad)
        if self.kind is int:
            return expect_int(value, where, lo=self.lo, hi=self.hi, error=bad)
        if self.kind is bytes:
            return expect_bytes(value, where, max_len=self.max_len, error=bad)
        if self.kind is str:
            return expect_str(value, where, max_len=self.max_len, error=bad)
        raise TypeError(f"{where}: a WireField kind is int, str, bytes or list, not {self.kind!r}")

    def _fits(self, value: object) -> bool:
        """Whether ``value`` passes :meth:`check` (which then says why not, if not)."""
        lo, hi, kind = self.lo, self.hi, self.kind
        if kind is int:
            return type(value) is int and (lo is None or value >= lo) and (hi is None or value <= hi)
        if kind is str or kind is bytes:
            return type(value) is kind and (self.max_len is None or len(value) <= self.max_len)
        if kind is list and type(value) in (list, tuple):
            assert isinstance(value, (list, tuple))
            return (self.max_len is None or len(value) <= self.max_len) and all(
                type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi) for v in value
            )
        return False


_DIM = WireField(list, lo=0, hi=MAX_EXTENT, max_len=MAX_NDIM)
BASE_FIELDS: Mapping[str, WireField] = {
    "dtype": WireField(str, max_len=32),
    "shape": _DIM,
    "stride": _DIM,
    "storage_offset": WireField(int, lo=0, hi=MAX_EXTENT),
    "device_uuid": WireField(str, max_len=128),
}
#: The base fields that describe one view of the memory; every other field (the device,
#: a backend's ``wire_fields``) describes the memory itself, its *export*, which the
#: per-layer views of one allocation share (see :meth:`DeviceIPCWrapper.from_views`).
VIEW_FIELDS: tuple[str, ...] = ("dtype", "shape", "stride", "storage_offset")
_VIEW_SET = frozenset(VIEW_FIELDS)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``; refuses dtypes outside :data:`ALLOWED_DTYPES`."""
    name = str(dtype).removeprefix("torch.")
    if name not in ALLOWED_DTYPES:
        raise DescriptorError(f"dtype {dtype} is not supported for IPC")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"float16"`` -> ``torch.float16``, only for allowed names."""
    known = _DTYPES.get(name)
    if known is not None:
        return known
    if name not in ALLOWED_DTYPES:
        raise DescriptorError(f"dtype {name!r} is not allowed (allowed: {', '.join(ALLOWED_DTYPES)})")
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DescriptorError(f"dtype {name!r} is not available in this torch build")
    _DTYPES[name] = dtype
    return dtype


_DTYPES: dict[str, torch.dtype] = {}  # allowed names already resolved


def required_elements(shape: tuple[int, ...], stride: tuple[int, ...], storage_offset: int) -> int:
    """Number of elements a strided view needs from its storage's start (0 if empty)."""
    if 0 in shape:
        return 0
    end = storage_offset + 1
    for n, st in zip(shape, stride, strict=True):
        end += (n - 1) * st
    return end


def _hashable(fields: Mapping[str, Primitive]) -> tuple[Any, ...]:
    """``fields`` as a hashable value: its items, lists as tuples."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in fields.items())


class SharedFds:
    """File descriptors a decoder received for one export, closed with its last wrapper."""

    def __init__(self, fds: Sequence[int], users: int) -> None:
        self.fds = tuple(fds)
        self._users = users
        self._lock = threading.Lock()

    def drop(self) -> None:
        """One wrapper is done with them; the last one closes them."""
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            for fd in self.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def fd_fields(cls: type[DeviceIPCWrapper]) -> list[str]:
    """Names of the ``WireField(fds=True)`` fields of ``cls``, in declaration order."""
    return [name for name, spec in cls.wire_fields.items() if spec.fds]


class DeviceIPCWrapper(abc.ABC):
    """Base of every IPC wrapper: a hashable value describing a shareable tensor.

    Subclasses set ``device_type`` and ``wire_tag``, declare extra fields in
    ``wire_fields`` (their ``__init__`` takes them as keyword arguments next to
    the base fields) and implement :meth:`wrap` and :meth:`to_tensor`. Override
    :meth:`release` to free per-process resources; :meth:`close` calls it once.
    """

    #: torch device type this wrapper exports (``"cpu"``, ``"cuda"``, ...).
    device_type: ClassVar[str] = ""
    #: Stable name on the wire, e.g. ``"cpu.shm/1"``. Never reuse one for another layout.
    wire_tag: ClassVar[str] = ""
    #: Extra primitive fields of this class, beyond the base fields every wrapper has
    #: (``dtype``, ``shape``, ``stride``, ``storage_offset``, ``device_uuid``).
    wire_fields: ClassVar[Mapping[str, WireField]] = {}
    #: The received fds this wrapper shares with the other wrappers of its export.
    _fd_owner: SharedFds | None = None

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...] | list[int],
        stride: tuple[int, ...] | list[int],
        storage_offset: int,
        device_uuid: str,
    ) -> None:
        shape, stride = tuple(shape), tuple(stride)
        if len(shape) != len(stride):
            raise DescriptorError(f"{type(self).__name__}: shape {shape} and stride {stride} differ in rank")
        dtype_name(dtype)
        extent = required_elements(shape, stride, storage_offset)
        if extent > MAX_EXTENT:
            raise DescriptorError(f"{type(self).__name__}: view extent overflows")
        self._nbytes = extent * dtype.itemsize
        self.dtype = dtype
        self.shape = shape
        self.stride = stride
        self.storage_offset = storage_offset
        self.device_uuid = device_uuid
        self._closed = False
        self._close_lock = threading.Lock()

    # -- what a backend implements ----------------------------------------------------

    @classmethod
    def describe(cls, tensor: torch.Tensor, *, device_uuid: str, **fields: Any) -> Self:
        """Build a wrapper recording ``tensor``'s layout, plus this class's own ``fields``.

        The one place that reads dtype, shape, stride and offset off a tensor, for
        :meth:`wrap` implementations.
        """
        return cls(
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=int(tensor.storage_offset()),
            device_uuid=device_uuid,
            **fields,
        )

    @classmethod
    @abc.abstractmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        """Export ``tensor`` (engine side) and return its descriptor."""

    @abc.abstractmethod
    def to_tensor(self) -> torch.Tensor:
        """Reopen the memory in this process as a tensor aliasing the producer's."""

    @classmethod
    def to_tensors(cls, wrappers: Sequence[DeviceIPCWrapper]) -> list[torch.Tensor]:
        """Reopen several wrappers of this class at once: :meth:`to_tensor` of each, in order.

        A cache context reopens all of its wrappers of one class with one call, in
        layer order. Override it to place separate exports where the layers stack
        (equal steps in one storage), so that one op moves every layer of a kernel
        group; each returned tensor must alias what its wrapper's ``to_tensor()``
        would.
        """
        return [w.to_tensor() for w in wrappers]

    @classmethod
    def wrapper_class_for(cls, tensor: torch.Tensor) -> type[DeviceIPCWrapper]:
        """The class that exports ``tensor``: ``cls`` itself, unless a backend picks per tensor.

        A backend whose device type has several kinds of memory, each shared its own
        way, returns from ``lmcache_platform_ipc_wrapper_class`` a class overriding
        this to name, for each tensor, the wire class that can share it (CUDA: the VMM
        kind for virtual-memory allocations, the torch kind for the caching
        allocator's). :func:`lmcache_platform.wrap_kv_caches` asks it for every tensor,
        checks each class's batch with its :meth:`preflight` and wraps each tensor
        with the chosen class's :meth:`wrap`. It must be cheap and must not export
        anything; list every class it can name in ``lmcache_platform_wire_classes``.
        """
        return cls

    @classmethod  # noqa: B027 - optional hook, no-op by default
    def preflight(cls, tensors: Sequence[torch.Tensor]) -> None:
        """Check a whole batch before any of it is wrapped (capacity, device, layout).

        :func:`lmcache_platform.wrap_kv_caches` calls it once per wrapper class with
        all the tensors that class will wrap (see :meth:`wrapper_class_for`), so a
        batch that cannot succeed fails before anything is exported. The default
        accepts everything.
        """

    def release(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Free per-process resources held by this wrapper (mappings, handles)."""

    # -- provided ----------------------------------------------------------------------

    def close(self) -> None:
        """Release what this wrapper holds in this process. Idempotent.

        Received file descriptors (``WireField(fds=True)``) are closed with the last
        wrapper of their export, after :meth:`release`.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.release()
        finally:
            owner, self._fd_owner = self._fd_owner, None
            if owner is not None:
                owner.drop()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the view, from the storage start (0 for an empty tensor)."""
        return self._nbytes

    def export_fields(self) -> dict[str, Primitive]:
        """The fields that name the memory: :meth:`fields` less :data:`VIEW_FIELDS`.

        Wrappers of views of one export have equal ``export_fields``; the wire format
        sends them once for all of those views.
        """
        out: dict[str, Primitive] = {"device_uuid": self.device_uuid}
        for name in self.wire_fields:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def view_fields(self) -> dict[str, Primitive]:
        """The fields of :data:`VIEW_FIELDS`: where in the memory this view lies."""
        return {
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "stride": list(self.stride),
            "storage_offset": self.storage_offset,
        }

    def fields(self) -> dict[str, Primitive]:
        """The descriptor as primitives: base fields, then ``wire_fields``."""
        return {**self.view_fields(), **self.export_fields()}

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Self:
        """Rebuild a wrapper from untrusted primitives, validating every field.

        Raises :class:`DescriptorError` on a missing, extra, mistyped or out-of-range
        field. Nothing is mapped here; :meth:`to_tensor` does that later.
        """
        schema = {**BASE_FIELDS, **cls.wire_fields}
        if set(fields) != set(schema):
            missing = sorted(set(schema) - set(fields))
            extra = sorted(set(fields) - set(schema), key=repr)
            raise DescriptorError(f"{cls.__name__}: missing fields {missing}, unknown fields {extra}")
        view = {name: fields[name] for name in VIEW_FIELDS}
        (wrapper,) = cls.from_views({k: v for k, v in fields.items() if k not in view}, [view])
        return wrapper

    @classmethod
    def from_views(cls, export: Mapping[str, Any], views: Sequence[Mapping[str, Any]]) -> list[Self]:
        """Rebuild the wrappers of several views of one export from untrusted primitives.

        ``export`` holds every field but :data:`VIEW_FIELDS` and is validated once;
        each of ``views`` holds exactly the view fields and is validated on its own.
        The wire decoder calls this once per export it receives (current vLLM's 32
        layers are 32 views of one export), so the common fields cost once. A
        backend may override it to let the wrappers share per-export state (one
        mapping, one opened handle), calling ``super().from_views`` to validate.
        Raises :class:`DescriptorError` like :meth:`from_fields`; nothing is left
        open then.
        """
        where = cls.__name__
        export_schema = {k: v for k, v in {**BASE_FIELDS, **cls.wire_fields}.items() if k not in VIEW_FIELDS}
        if set(export) != set(export_schema):
            missing = sorted(set(export_schema) - set(export))
            extra = sorted(set(export) - set(export_schema), key=repr)
            raise DescriptorError(f"{where}: missing fields {missing}, unknown fields {extra}")
        shared: dict[str, Any] = {n: spec.check(where, n, export[n]) for n, spec in export_schema.items()}
        out: list[Self] = []
        try:
            for view in views:
                if not isinstance(view, Mapping) or view.keys() != _VIEW_SET:
                    got = sorted(view, key=repr) if isinstance(view, Mapping) else type(view).__name__
                    raise DescriptorError(f"{where}: a view holds exactly {list(VIEW_FIELDS)}, got {got}")
                values: dict[str, Any] = {n: BASE_FIELDS[n].check(where, n, view[n]) for n in VIEW_FIELDS}
                values["dtype"] = dtype_from_name(values["dtype"])
                values["shape"] = tuple(values["shape"])
                values["stride"] = tuple(values["stride"])
                out.append(cls(**values, **shared))
        except BaseException:
            for made in out:
                made.close()
            raise
        return out

    def _key(self) -> tuple[Any, ...]:
        return _hashable(self.fields())

    def _export_key(self) -> tuple[Any, ...]:
        """Equal for the wrappers of one export (one memory), whatever their views."""
        return _hashable(self.export_fields())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceIPCWrapper):
            return NotImplemented
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self), self._key()))

    def __repr__(self) -> str:
        extras = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.wire_fields)
        return (
            f"{type(self).__name__}(dtype={self.dtype}, shape={self.shape}, stride={self.stride}, "
            f"storage_offset={self.storage_offset}, device_uuid={self.device_uuid!r}"
            + (f", {extras})" if extras else ")")
        )

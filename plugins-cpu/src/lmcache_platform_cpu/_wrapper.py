"""``CpuShmIPCWrapper``: CPU tensors shared through POSIX shared memory.

Producer side, :meth:`CpuShmIPCWrapper.wrap` moves the tensor's whole storage into a
fresh segment (copying its bytes) and re-points the *same* tensor object at it, so
the engine keeps its tensor and its contents; stride and offset stay valid because
the segment mirrors the storage byte for byte. Afterwards, reopening a view is a
name and a layout: no copy.

Lifetimes follow torch's own reference counting. The segment's ``mmap`` is owned by
the torch storage built over it, so it lives exactly as long as some tensor uses
that storage. A finalizer on the ``mmap`` unlinks the name when the last tensor
dies; a consumer's mapping is likewise released when its last view dies. Wrappers
hold names, never memory: dropping a tensor always frees its segment.

Migration is per *storage*, re-pointing per *tensor*: an engine whose layer
tensors are views of one allocation (vLLM's hybrid-model KV tensors) gets one
segment, and wrapping each view re-points it there, so the views keep aliasing.
Likewise, wrapping a tensor that already lives in a segment (one this process made,
or one it reopened with ``to_tensor``) names that segment instead of copying it.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lmcache_platform import DescriptorError, DeviceIPCWrapper, WireField
from lmcache_platform._ipc_wrapper import MAX_EXTENT, dtype_name

from . import _shm

if TYPE_CHECKING:
    from typing_extensions import Self

_DEVICE_UUID = "cpu"


@dataclass(eq=False)
class _Segment:
    """A segment mapped in this process: created here (``owned``) or reopened.

    For an owned segment, ``wrappers`` counts the open wrappers exporting its name;
    the last one to close unlinks it.
    """

    name: str
    nbytes: int
    mm: weakref.ref[mmap.mmap]
    owned: bool
    wrappers: int = 0
    linked: bool = True  # False once we unlinked the name; the memory may live on


# Guarded by _lock (reentrant: dropping a storage inside a locked section can run
# the finalizer of its segment on this very thread).
_lock = threading.RLock()
#: mapping address -> the segment mapped there, while the mapping lives
_segments: dict[int, _Segment] = {}
#: address of a storage whose bytes were moved into a segment -> (that storage, where)
_moved: dict[int, tuple[StorageWeakRef, _Segment]] = {}


class CpuShmIPCWrapper(DeviceIPCWrapper):
    """Descriptor of a CPU tensor living in a POSIX shared-memory segment.

    ``shm_name`` is the segment (empty for an empty tensor, which needs none) and
    ``shm_nbytes`` its exact size, checked against the real segment before mapping.
    """

    device_type: ClassVar[str] = "cpu"
    wire_tag: ClassVar[str] = "cpu.shm/1"
    wire_fields: ClassVar[Mapping[str, WireField]] = {
        "shm_name": WireField(str, max_len=_shm.MAX_NAME_LEN),
        "shm_nbytes": WireField(int, lo=0, hi=MAX_EXTENT),
    }

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...] | list[int],
        stride: tuple[int, ...] | list[int],
        storage_offset: int,
        device_uuid: str,
        shm_name: str,
        shm_nbytes: int,
    ) -> None:
        super().__init__(
            dtype=dtype,
            shape=shape,
            stride=stride,
            storage_offset=storage_offset,
            device_uuid=device_uuid,
        )
        where = type(self).__name__
        if device_uuid != _DEVICE_UUID:
            raise DescriptorError(f"{where}: device_uuid must be {_DEVICE_UUID!r}, got {device_uuid!r}")
        if shm_name:
            _shm.parse_name(shm_name)
        elif shm_nbytes:
            raise DescriptorError(f"{where}: shm_nbytes is {shm_nbytes} but no segment is named")
        if self.nbytes > shm_nbytes:
            raise DescriptorError(
                f"{where}: the view spans {self.nbytes} bytes but segment {shm_name!r} holds "
                f"only {shm_nbytes}"
            )
        self.shm_name = shm_name
        self.shm_nbytes = shm_nbytes
        self._export: _Segment | None = None  # set on wrappers exporting an owned segment
        self._mm: mmap.mmap | None = None  # this wrapper's mapping, once opened

    # -- producer ----------------------------------------------------------------------

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        """Move ``tensor`` into shared memory (once) and describe it.

        Idempotent: a tensor already in a segment (made here, or reopened here with
        :meth:`to_tensor`), or a view of one, is described without copying. Raises
        ``DescriptorError`` for a tensor that is not a strided CPU tensor of an
        allowed dtype, and ``ShmCapacityError`` when /dev/shm is too small (nothing
        is created then).
        """
        _check_exportable(tensor)
        if tensor.numel() == 0:
            return cls._describe(tensor, "", 0)
        with _lock:
            segment = _into_segment(tensor)
            wrapper = cls._describe(tensor, segment.name, segment.nbytes)
            if segment.owned:
                segment.wrappers += 1
                wrapper._export = segment
        return wrapper

    @classmethod
    def _describe(cls, tensor: torch.Tensor, shm_name: str, shm_nbytes: int) -> Self:
        return cls(
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=int(tensor.storage_offset()),
            device_uuid=_DEVICE_UUID,
            shm_name=shm_name,
            shm_nbytes=shm_nbytes,
        )

    @classmethod
    def preflight(cls, tensors: Iterable[torch.Tensor]) -> None:
        """Check up front that /dev/shm can hold every storage ``tensors`` would migrate.

        Raises ``ShmCapacityError`` for the whole batch before any segment exists,
        so a batch that cannot fit creates nothing. Storages shared by several
        tensors, and storages already in our segments, count once or not at all.
        """
        needed: dict[int, int] = {}
        with _lock:
            for tensor in tensors:
                _check_exportable(tensor)
                if tensor.numel() == 0:
                    continue
                storage = tensor.untyped_storage()
                if _segment_at(storage) is None and _moved_target(storage) is None:
                    needed[storage.data_ptr()] = storage.nbytes()
        _shm.check_capacity(sum(needed.values()))

    # -- consumer ----------------------------------------------------------------------

    def to_tensor(self) -> torch.Tensor:
        """Map the segment (once per wrapper) and return a view replaying the layout.

        The mapping stays until the last view of it dies, even after :meth:`close`.
        """
        if self.closed:
            raise DescriptorError(f"{self!r} is closed")
        if not self.shm_name:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        mm, fresh = self._mm, self._mm is None
        if mm is None:
            mm = self._mm = _shm.open_existing(self.shm_name, self.shm_nbytes)
        storage = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
        if fresh:  # so that wrapping a view of it names this segment instead of copying
            segment = _Segment(self.shm_name, self.shm_nbytes, weakref.ref(mm), owned=False)
            with _lock:
                _track(mm, storage.data_ptr(), segment)
        view = torch.empty(0, dtype=self.dtype)
        return view.set_(storage, self.storage_offset, self.shape, self.stride)

    def _release(self) -> None:
        """Drop this wrapper's mapping; a producer's last wrapper also unlinks the name."""
        self._mm = None
        export, self._export = self._export, None
        if export is None:
            return
        with _lock:
            export.wrappers -= 1
            last = export.wrappers == 0 and export.linked
            if last:
                export.linked = False
        if last:
            _shm.unlink(export.name)  # a no-op in a forked child: the name is the parent's


def _check_exportable(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise DescriptorError(f"CpuShmIPCWrapper.wrap expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise DescriptorError(
            f"CpuShmIPCWrapper.wrap needs a CPU tensor, got one on {tensor.device}; "
            "use the backend for that device type"
        )
    if tensor.layout != torch.strided:
        raise DescriptorError(f"CpuShmIPCWrapper.wrap needs a strided tensor, got {tensor.layout}")
    dtype_name(tensor.dtype)


def _segment_at(storage: torch.UntypedStorage) -> _Segment | None:
    """The live segment ``storage`` is a mapping of, if any (and still named, if ours)."""
    segment = _segments.get(storage.data_ptr())
    if segment is None or not segment.linked or segment.nbytes != storage.nbytes():
        return None
    return segment if segment.mm() is not None else None


def _moved_target(storage: torch.UntypedStorage) -> tuple[_Segment, mmap.mmap] | None:
    """Where ``storage``'s bytes went if another view of it was wrapped earlier."""
    entry = _moved.get(storage.data_ptr())
    if entry is None:
        return None
    source, segment = entry
    mm = segment.mm()
    dead = source.expired()  # type: ignore[no-untyped-call]
    if dead or mm is None or not segment.linked or segment.nbytes != storage.nbytes():
        del _moved[storage.data_ptr()]  # a dead storage whose address was reused, or a gone segment
        return None
    return segment, mm


def _into_segment(tensor: torch.Tensor) -> _Segment:
    storage = tensor.untyped_storage()
    segment = _segment_at(storage)
    if segment is not None:
        return segment
    target = _moved_target(storage)
    if target is not None:
        segment, mm = target
        _repoint(tensor, torch.frombuffer(mm, dtype=torch.uint8).untyped_storage())
        return segment
    return _migrate(tensor, storage)


def _migrate(tensor: torch.Tensor, storage: torch.UntypedStorage) -> _Segment:
    """Copy ``storage`` into a new segment and re-point ``tensor`` at it."""
    name, mm = _shm.create(storage.nbytes())
    try:
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        flat.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        _repoint(tensor, flat.untyped_storage())
    except BaseException:
        _shm.unlink(name)
        raise
    segment = _Segment(name, storage.nbytes(), weakref.ref(mm), owned=True)
    _track(mm, flat.data_ptr(), segment)
    _moved[storage.data_ptr()] = (StorageWeakRef(storage), segment)  # type: ignore[no-untyped-call]
    return segment


def _track(mm: mmap.mmap, address: int, segment: _Segment) -> None:
    """Record a new mapping until it dies (its last storage, hence its last tensor)."""
    _segments[address] = segment
    finalizer = weakref.finalize(mm, _mapping_died, segment, address, os.getpid())
    finalizer.atexit = False  # at exit, _shm unlinks every owned name


def _repoint(tensor: torch.Tensor, storage: torch.UntypedStorage) -> None:
    # no_grad: KV caches are leaves; inference tensors may only change in inference mode.
    with torch.inference_mode(tensor.is_inference()), torch.no_grad():
        tensor.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def _mapping_died(segment: _Segment, address: int, pid: int) -> None:
    """The last storage over a mapping is gone: forget it; unlink the name if ours."""
    if os.getpid() != pid:
        return  # a forked child's copy of the parent's mapping
    with _lock:
        if _segments.get(address) is segment:
            del _segments[address]
        for key in [k for k, (_, s) in _moved.items() if s is segment]:
            del _moved[key]
    if segment.owned:
        segment.linked = False
        _shm.unlink(segment.name)


def _after_fork_in_child() -> None:
    global _lock, _segments, _moved
    _lock = threading.RLock()
    _segments = {}  # the child wraps into segments of its own
    _moved = {}


os.register_at_fork(after_in_child=_after_fork_in_child)

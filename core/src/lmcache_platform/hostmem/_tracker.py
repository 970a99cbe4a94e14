"""Which storages of this process live in a store's memory: the bookkeeping behind the wrapper.

One :class:`Tracker` per store (per wrapper class that names one) records the mappings
made or reopened here, the storages whose bytes were moved, the allocations shared in
place and the ranges mapped side by side, and releases each handle when the last
storage over its memory dies. Keyed by address and checked against the live mapping,
so a new storage at a dead one's address is never mistaken for it.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._ipc_wrapper import required_elements
from . import _remap
from ._store import Handle, HostMemoryStore, InPlaceStore, SideBySideStore

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class Segment:
    """Memory in this process: made here (``owned``) or reopened, mapped by us or in place.

    For owned memory, ``wrappers`` counts the open wrappers exporting its handle; the
    last one to close releases it. Memory mapped over an engine's own allocation
    (:mod:`._remap`) has no mapping object of ours (``mm`` is None): ``source`` is a
    weak reference to the storage living in it, and the storage starts ``offset``
    bytes into the memory.
    """

    handle: Handle
    nbytes: int
    mm: weakref.ref[mmap.mmap] | None
    owned: bool
    wrappers: int = 0
    linked: bool = True  # False once we released the handle; the memory may live on
    offset: int = 0
    source: Any = None
    storage_nbytes: int = 0


class Tracker:
    """Which storages of this process live in (or were moved into) one store's mappings.

    Keyed by address and checked against the live mapping, so a new storage that
    reuses a dead one's address is never mistaken for it. The lock is reentrant:
    dropping a storage inside a locked section can run a mapping's finalizer on
    this very thread.
    """

    def __init__(self, store: HostMemoryStore) -> None:
        self.store = store
        #: The store again where it has the optional abilities (decided once, here).
        self.in_place: InPlaceStore | None = store if isinstance(store, InPlaceStore) else None
        self.side_by_side: SideBySideStore | None = store if isinstance(store, SideBySideStore) else None
        self.reset()

    def reset(self) -> None:
        self.lock = threading.RLock()
        #: mapping address -> the segment mapped there, while the mapping lives
        self.segments: dict[int, Segment] = {}
        #: address of a storage whose bytes were moved -> (weak ref to it, where they went)
        self.moved: dict[int, tuple[Any, Segment]] = {}
        #: address of a side-by-side range -> its length and, per export, (offset, segment)
        self.ranges: dict[int, tuple[int, list[tuple[int, Segment]]]] = {}

    def segment_at(self, storage: torch.UntypedStorage) -> Segment | None:
        """The live segment ``storage`` lives in, if any (and still exported, if ours)."""
        segment = self.segments.get(storage.data_ptr())
        if segment is None or not segment.linked:
            return None
        if segment.source is not None:  # in place: alive while the engine's storage is
            if segment.source.expired():
                self._in_place_died(storage.data_ptr(), segment)
                return None
            return segment if segment.storage_nbytes == storage.nbytes() else None
        if segment.nbytes != storage.nbytes() or segment.mm is None:
            return None
        return segment if segment.mm() is not None else None

    def moved_target(self, storage: torch.UntypedStorage) -> tuple[Segment, mmap.mmap] | None:
        """Where ``storage``'s bytes went if another view of it was wrapped earlier."""
        entry = self.moved.get(storage.data_ptr())
        if entry is None:
            return None
        source, segment = entry
        mm = segment.mm() if segment.mm is not None else None
        if source.expired() or mm is None or not segment.linked or segment.nbytes != storage.nbytes():
            del self.moved[storage.data_ptr()]  # a dead storage whose address was reused, or a gone segment
            return None
        return segment, mm

    def into_segment(self, tensor: torch.Tensor) -> Segment:
        """The segment ``tensor`` lives in, after moving its storage there if needed."""
        storage = tensor.untyped_storage()
        segment = self.segment_at(storage) or self.in_range(tensor)
        if segment is not None:
            return segment
        target = self.moved_target(storage)
        if target is not None:
            segment, mm = target
            repoint(tensor, storage_over(mm, segment.nbytes))
            return segment
        self.sweep()
        store = self.in_place
        pages = _remap.exclusive_pages(storage) if store is not None else None
        shared = None
        if store is not None and pages is not None:
            shared = self._share_in_place(store, storage, *pages)
        return shared if shared is not None else self._migrate(tensor, storage)

    def _migrate(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> Segment:
        """Copy ``storage`` into new memory and re-point ``tensor`` at it."""
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef

        nbytes = storage.nbytes()
        handle, mm = self.store.create(nbytes)
        try:
            shared = storage_over(mm, nbytes)
            source = torch.empty(0, dtype=torch.uint8).set_(storage)
            torch.empty(0, dtype=torch.uint8).set_(shared).copy_(source)
            repoint(tensor, shared)
        except BaseException:
            self.store.release(handle)
            raise
        segment = Segment(dict(handle), nbytes, weakref.ref(mm), owned=True)
        self.track(mm, shared.data_ptr(), segment)
        self.moved[storage.data_ptr()] = (StorageWeakRef(storage), segment)  # type: ignore[no-untyped-call]
        return segment

    def _share_in_place(
        self, store: InPlaceStore, storage: torch.UntypedStorage, address: int, length: int
    ) -> Segment | None:
        """Put new memory under ``storage``'s own pages (:mod:`._remap`); nothing moves.

        None, with nothing left behind, when the export's pages are larger than the
        allocation's and its bounds are not whole pages of them (huge pages): the
        caller copies instead.
        """
        from torch.multiprocessing.reductions import StorageWeakRef

        handle, fd = store.create_in_place(length)
        try:
            try:
                page = _remap.page_size(fd)
                fits = _remap.fits_pages(address, length, page)
                if fits:
                    _remap.remap_in_place(
                        address, length, fd, lambda at, n: store.reserve(fd, at, n), page=page
                    )
            finally:
                os.close(fd)
        except BaseException:
            self.store.release(handle)  # the remapped slices keep the bytes; nothing is exported
            raise
        if not fits:
            self.store.release(handle)
            return None
        segment = Segment(
            dict(handle),
            length,
            None,
            owned=True,
            offset=storage.data_ptr() - address,
            source=StorageWeakRef(storage),  # type: ignore[no-untyped-call]
            storage_nbytes=storage.nbytes(),
        )
        self.segments[storage.data_ptr()] = segment
        return segment

    def open_side_by_side(
        self, store: SideBySideStore, exports: Sequence[tuple[Handle, int]]
    ) -> list[Region]:
        """Map ``(handle, nbytes)`` exports side by side in one range (``_remap.map_side_by_side``).

        Each export starts on a boundary of its own pages (read from its fd). One
        storage spans the range; when it dies, the range is unmapped and the fds
        closed. The range is recorded, so that wrapping a tensor in it names its export
        instead of copying. If an export fails its checks, nothing stays open or mapped.
        """
        import ctypes

        import torch

        fds: list[int] = []
        try:
            for handle, nbytes in exports:
                fds.append(store.open_fd(handle, nbytes))
            address, length, offsets = _remap.map_side_by_side(fds, [n for _, n in exports])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        try:  # from here the finalizer owns the range and the fds, even if frombuffer fails
            # ctypes keeps one array type per length; contexts are few, and so are lengths
            buffer = (ctypes.c_char * length).from_address(address)
            finalizer = weakref.finalize(buffer, self._range_died, address, length, tuple(fds))
        except BaseException:
            try:
                _remap.unmap(address, length)
            finally:
                for fd in fds:
                    os.close(fd)
            raise
        finalizer.atexit = False  # at exit the process's mappings and fds go anyway
        storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()  # keeps buffer alive
        segments = [
            Segment(dict(handle), nbytes, None, owned=False, offset=-offset)
            for (handle, nbytes), offset in zip(exports, offsets, strict=True)
        ]
        with self.lock:
            self.ranges[address] = (length, list(zip(offsets, segments, strict=True)))
        return [Region(storage, offset, fd) for offset, fd in zip(offsets, fds, strict=True)]

    def in_range(self, tensor: torch.Tensor) -> Segment | None:
        """The export a tensor of a side-by-side range lies in, if it lies within one."""
        storage = tensor.untyped_storage()
        entry = self.ranges.get(storage.data_ptr())
        if entry is None or entry[0] != storage.nbytes():
            return None
        item, first = tensor.element_size(), int(tensor.storage_offset())
        start = first * item
        end = required_elements(tuple(tensor.shape), tuple(tensor.stride()), first) * item
        for offset, segment in entry[1]:
            if offset <= start and end <= offset + segment.nbytes:
                return segment
        return None

    def _range_died(self, address: int, length: int, fds: tuple[int, ...]) -> None:
        with self.lock:
            self.ranges.pop(address, None)
        try:
            _remap.unmap(address, length)
        finally:
            for fd in fds:
                os.close(fd)

    def _in_place_died(self, address: int, segment: Segment) -> None:
        """The storage living in memory mapped in place is gone: forget it, release the handle."""
        if self._unlink(address, segment):
            self.store.release(segment.handle)

    def _unlink(self, address: int, segment: Segment) -> bool:
        """Forget ``segment`` (at ``address``); whether its handle is ours to release now."""
        if self.segments.get(address) is segment:
            del self.segments[address]
        last = segment.owned and segment.linked
        segment.linked = False
        return last

    def sweep(self) -> None:
        """Release the memory of in-place storages that died since (torch tells no one)."""
        # copy() allocates no items, so no collection runs mid-copy: a finalizer that a
        # collection runs on this thread (_mapping_died, the lock is reentrant) edits the dict
        for address, segment in self.segments.copy().items():
            if segment.source is not None and segment.source.expired():
                self._in_place_died(address, segment)

    def track(self, mm: mmap.mmap, address: int, segment: Segment) -> None:
        """Record a new mapping until it dies (its last storage, hence its last tensor)."""
        self.segments[address] = segment
        finalizer = weakref.finalize(mm, self._mapping_died, segment, address, os.getpid())
        finalizer.atexit = False  # at exit, the store releases what it owns

    def _mapping_died(self, segment: Segment, address: int, pid: int) -> None:
        """The last storage over a mapping is gone: forget it; release the handle if ours."""
        if os.getpid() != pid:
            return  # a forked child's copy of the parent's mapping
        with self.lock:
            for key in [k for k, (_, s) in self.moved.items() if s is segment]:
                del self.moved[key]
            last = self._unlink(address, segment)
        if last:
            self.store.release(segment.handle)

    def release_export(self, segment: Segment) -> None:
        """One exporting wrapper closed; the last one releases the handle (memory lives on)."""
        with self.lock:
            self.sweep()
            segment.wrappers -= 1
            last = segment.wrappers == 0 and segment.linked
            if last:
                segment.linked = False
        if last:
            self.store.release(segment.handle)  # a no-op in a forked child: the handle is the parent's


class Region:
    """Where one export lies in a range mapped by :meth:`HostMemoryIPCWrapper.to_tensors`.

    ``storage`` spans the whole range (it unmaps the range and closes the fds when it
    dies); the export starts ``offset`` bytes in, and ``fd`` is open while it lives.
    """

    __slots__ = ("fd", "offset", "storage")

    def __init__(self, storage: torch.UntypedStorage, offset: int, fd: int) -> None:
        self.storage, self.offset, self.fd = storage, offset, fd

    def size(self) -> int:
        """The memory's current size (what ``mmap.size()`` says of a mapping)."""
        return os.fstat(self.fd).st_size


class SharedMapping:
    """The one mapping (and storage over it) of the wrappers decoded from one record,
    once one of them opened it; it goes with the last of those wrappers."""

    __slots__ = ("mm", "storage")

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None
        self.storage: torch.UntypedStorage | None = None


def storage_over(mm: mmap.mmap, nbytes: int) -> torch.UntypedStorage:
    """A storage of exactly ``nbytes`` over ``mm`` that keeps ``mm`` alive."""
    import torch

    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).untyped_storage()


def repoint(tensor: torch.Tensor, storage: torch.UntypedStorage) -> None:
    import torch

    # no_grad: KV caches are leaves; inference tensors may only change in inference mode.
    with torch.inference_mode(tensor.is_inference()), torch.no_grad():
        tensor.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


#: Every tracker of this process, so that a forked child can forget them all.
TRACKERS: list[Tracker] = []


def _after_fork_in_child() -> None:
    for tracker in TRACKERS:
        tracker.reset()  # the child wraps into memory of its own


os.register_at_fork(after_in_child=_after_fork_in_child)

"""Host memory for chunk payloads that fills at copy speed.

A server keeps every chunk it stores in host memory of its own. A chunk-sized
``torch.empty`` is a fresh anonymous mapping, and its first write faults it in 4 KiB at a
time: on the development machine, a store into fresh 32 MiB buffers ran at a seventh of
the speed of the same store into used ones, so allocation, not the copy, bounded it.
Two measures:

* Buffers from 2 MiB on are anonymous mappings with transparent huge pages requested
  (``MADV_HUGEPAGE``): they fault in 2 MiB at a time. Fresh pages still cost the kernel's
  zeroing (a store into them ran about a third slower than into used memory), and on a
  VM memory the host never backed costs far more on first touch.
* :class:`HostBufferPool` hands out the mappings of buffers nobody uses any more (a chunk
  evicted, a context's chunks dropped) before it maps fresh ones: the used-memory speed.
* **Prepared ahead.** A server tells the pool its chunk size and its memory bound
  (:meth:`HostBufferPool.prepare`): a background thread maps and faults in mappings
  (``MADV_POPULATE_WRITE``) off the request path, staying ``ahead`` bytes ahead of use
  (``serve --host-memory ahead``, the default) or filling the whole bound
  (``--host-memory eager``). A store that finds no ready mapping maps a fresh one on its
  own path, correct but slower, and is counted (``slow_takes``).
* **Registered once with a device.** A device context registers each mapping with its
  device the first time it uses it (CUDA: ``cuMemHostRegister``, see
  ``BaseCacheContext.register_host_memory``) and the pool undoes that before unmapping:
  no per-chunk pinned allocation.
"""

from __future__ import annotations

import collections
import functools
import logging
import mmap
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)
#: Below this a buffer is plain ``torch.empty`` (the allocator's heap reuses such sizes).
HUGE_PAGE_BYTES = 2 << 20
#: What :meth:`HostBufferPool.stats` counts besides its mappings.
_COUNTERS = ("takes", "slow_takes", "prepared_bytes", "registered_bytes", "register_failures", "kept_mapped")
#: How far ahead of use :meth:`HostBufferPool.prepare` keeps ready memory by default.
DEFAULT_AHEAD_BYTES = 256 << 20


@functools.cache
def huge_pages_available() -> bool:
    """Whether this kernel takes ``MADV_HUGEPAGE`` (asked once per process)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    probe = mmap.mmap(-1, HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        probe.madvise(advice)
    except OSError as exc:  # a kernel built without transparent huge pages
        _log.debug("no transparent huge pages for chunk buffers: %s", exc)
        return False
    finally:
        probe.close()
    return True


class HostBufferPool:
    """Anonymous mappings for host buffers, reused once nothing uses them any more.

    A buffer is ``torch.frombuffer`` over a private mapping (an ``mmap`` object). Its
    storage holds the mapping through the buffer protocol, one reference for as long as
    any tensor or view of it lives, so a mapping only the pool references is free: no
    tensor can reach its bytes. :meth:`take` hands out a free mapping of the size asked,
    looking from where its last search ended, before it maps a fresh one; mapping a fresh
    one first unmaps the free mappings of every other size, so what the pool keeps idle
    stays below one size's peak use.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._regions: dict[int, list[mmap.mmap]] = {}
        self._hand: dict[int, int] = {}
        #: id(mapping) -> what undoes its registration with a device, called before unmapping.
        self._undo: dict[int, list[Callable[[], None]]] = {}
        #: Mappings whose registration could not be ended: never unmapped (see :meth:`_unmap`).
        self._kept: list[mmap.mmap] = []
        self._counts: collections.Counter[str] = collections.Counter()
        #: What :meth:`prepare` asked: chunk sizes to keep ready, the bound, ahead or eager.
        self._sizes: list[int] = []
        self._limit = 0
        self._ahead = 0
        self._eager = False
        self._thread: threading.Thread | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """An uninitialised 1-D uint8 tensor of ``nbytes`` over a free or fresh mapping."""
        import torch

        with self._lock:
            regions = self._regions.setdefault(nbytes, [])
            start = self._hand.get(nbytes, 0)
            self._counts["takes"] += 1
            for k in range(len(regions)):
                i = (start + k) % len(regions)
                if _idle(regions, i):
                    self._hand[nbytes] = i + 1
                    self._wake.notify()  # the preparer tops the ready memory up again
                    return torch.frombuffer(regions[i], dtype=torch.uint8)
            self._counts["slow_takes"] += 1  # mapped on the caller's path; its pages fault in on use
            self._trim(nbytes)
            regions.append(_fresh(nbytes))
            self._wake.notify()
            return torch.frombuffer(regions[-1], dtype=torch.uint8)  # the storage holds the mapping

    def prepare(
        self, nbytes: int, *, limit: int, ahead: int = DEFAULT_AHEAD_BYTES, eager: bool = False
    ) -> None:
        """Keep mappings of ``nbytes`` mapped and faulted in ahead of :meth:`take`, off its path.

        A background thread (started on the first call) maps fresh mappings and populates
        their pages until ``ahead`` bytes of them are idle (at least one mapping), or,
        ``eager``, until the pool holds ``limit`` bytes; never past ``limit`` in all.
        """
        if nbytes < HUGE_PAGE_BYTES:
            return
        with self._lock:
            if nbytes not in self._sizes:
                self._sizes.append(nbytes)
            self._limit, self._ahead, self._eager = limit, ahead, eager
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._prepare_loop, name="lmcache-host-arena", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def register_once(
        self, buffer: torch.Tensor, register: Callable[[int, int], Callable[[], None] | None]
    ) -> None:
        """Call ``register(address, nbytes)`` of the mapping under ``buffer`` the first time a device uses it.

        What it returns is called before the mapping is unmapped (a device registration
        must end before its memory goes). A ``register`` that raises leaves the mapping
        unregistered (pageable: copies work, slower): logged, counted
        (``register_failures``) and not tried again. Buffers not from the pool are left alone.
        """
        ptr = buffer.data_ptr()
        with self._lock:
            for regions in self._regions.values():
                for region in regions:
                    address = _address(region)
                    if address <= ptr < address + len(region):
                        key = id(region)
                        if key in self._undo:
                            return
                        try:
                            undo = register(address, len(region))
                        except Exception as exc:  # the copies still work, from pageable memory
                            # logged as text: the exception's frames would keep the buffer alive
                            why = f"{type(exc).__name__}: {exc}"
                            _log.warning("a %d-byte chunk mapping stays unregistered: %s", len(region), why)
                            self._undo[key] = []
                            self._counts["register_failures"] += 1
                            return
                        self._undo[key] = [undo] if undo is not None else []
                        self._counts["registered_bytes"] += len(region)
                        return

    def stats(self) -> dict[str, int]:
        """Mappings the pool holds, how many nothing uses now, their bytes, and the counters.

        ``takes``: buffers handed out; ``slow_takes``: of those, mapped on the caller's path
        because no ready mapping was idle; ``prepared_bytes``: bytes the background thread
        mapped and faulted in; ``registered_bytes``: bytes registered with a device;
        ``register_failures``: mappings a device refused to register (left pageable);
        ``kept_mapped``: mappings never unmapped because ending their registration failed
        (their bytes stay in ``bytes``, and count against the bound).
        """
        with self._lock:
            lists = list(self._regions.values())
            return {
                "mappings": sum(len(regions) for regions in lists),
                "idle": sum(_idle(regions, i) for regions in lists for i in range(len(regions))),
                "bytes": self._mapped_bytes(),
                **{k: self._counts[k] for k in _COUNTERS},
            }

    def _mapped_bytes(self) -> int:
        """Bytes the pool holds mapped, kept ones included (they count against the bound)."""
        mapped = sum(len(r) for regions in self._regions.values() for r in regions)
        return mapped + sum(len(r) for r in self._kept)

    def _trim(self, keep: int) -> None:
        """Unmap the idle mappings of every size but ``keep`` (and of no size being prepared)."""
        for nbytes, regions in self._regions.items():
            if nbytes == keep or nbytes in self._sizes:
                continue
            for i in reversed(range(len(regions))):
                if _idle(regions, i):
                    self._unmap(regions.pop(i))
            self._hand[nbytes] = 0

    def _unmap(self, region: mmap.mmap) -> None:
        """Unmap ``region`` once its device registrations ended; a failure keeps it mapped.

        A device may still copy into memory it holds registered, so memory whose
        registration did not end is never unmapped (nor handed out again): it stays
        with the pool, counted (``kept_mapped``), until the process exits.
        """
        for undo in self._undo.pop(id(region), ()):
            try:
                undo()
            except Exception:
                what = "ending a device registration of a %d-byte host mapping failed: it stays mapped"
                _log.exception(what, len(region))
                self._kept.append(region)
                self._counts["kept_mapped"] += 1
                return
        region.close()

    def _prepare_loop(self) -> None:
        while True:
            with self._lock:
                nbytes = self._next_to_prepare()
                while nbytes is None:
                    self._wake.wait(1.0)
                    nbytes = self._next_to_prepare()
            region = _fresh(nbytes)  # mapped and faulted in without the lock: takes go on meanwhile
            _populate(region)
            with self._lock:
                self._regions.setdefault(nbytes, []).append(region)
                self._counts["prepared_bytes"] += nbytes
            del region

    def _next_to_prepare(self) -> int | None:
        """A chunk size to map one more mapping of now, or None. Caller holds the lock."""
        total = self._mapped_bytes()
        for nbytes in self._sizes:
            if total + nbytes > self._limit:
                continue
            if self._eager:
                return nbytes
            regions = self._regions.get(nbytes, [])
            idle = sum(_idle(regions, i) for i in range(len(regions))) * nbytes
            if idle < max(self._ahead, nbytes):
                return nbytes
        return None


def _address(region: mmap.mmap) -> int:
    """Where ``region`` is mapped (the temporary view is gone before this returns)."""
    import torch

    view = torch.frombuffer(region, dtype=torch.uint8)
    try:
        return int(view.data_ptr())
    finally:
        del view


def _fresh(nbytes: int) -> mmap.mmap:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_available():
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


def _populate(region: mmap.mmap) -> None:
    """Fault every page of ``region`` in now, without holding the GIL (ctypes releases it).

    A kernel without ``MADV_POPULATE_WRITE`` (before 5.14): the pages are written instead.
    """
    from ..hostmem._populate import populate

    try:
        populate(_address(region), len(region), lock=_NO_LOCK, stopped=lambda: False)
    except OSError:
        for offset in range(0, len(region), mmap.PAGESIZE):
            region[offset] = 0


#: ``populate`` takes a lock for its owner's unmapping; a mapping being prepared has no other user.
_NO_LOCK = threading.Lock()


def _refs(items: list[Any], i: int) -> int:
    return sys.getrefcount(items[i])


#: What :func:`_refs` counts for an item only its list references (measured, not assumed:
#: interpreters differ in the references a call's argument adds).
_ONLY_LISTED = _refs([bytearray()], 0)


def _idle(regions: list[mmap.mmap], i: int) -> bool:
    """Whether only ``regions`` references mapping ``i``: no tensor can reach its bytes."""
    return _refs(regions, i) == _ONLY_LISTED


#: The process's pool of chunk-buffer mappings.
POOL = HostBufferPool()


def host_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D uint8 host tensor of ``nbytes``, page aligned from 2 MiB on.

    ``pin``: page-locked, for a device's asynchronous copies. Otherwise, from
    :data:`HUGE_PAGE_BYTES` on, a mapping from :data:`POOL` (reused once no tensor uses
    it; fresh ones with huge pages requested).
    """
    import torch

    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes < HUGE_PAGE_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    return POOL.take(nbytes)

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

Buffers for a device's copies are pinned instead (torch caches pinned memory and reuses it).
"""

from __future__ import annotations

import functools
import logging
import mmap
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)
#: Below this a buffer is plain ``torch.empty`` (the allocator's heap reuses such sizes).
HUGE_PAGE_BYTES = 2 << 20


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
        self._regions: dict[int, list[mmap.mmap]] = {}
        self._hand: dict[int, int] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """An uninitialised 1-D uint8 tensor of ``nbytes`` over a free or fresh mapping."""
        import torch

        with self._lock:
            regions = self._regions.setdefault(nbytes, [])
            start = self._hand.get(nbytes, 0)
            for k in range(len(regions)):
                i = (start + k) % len(regions)
                if _idle(regions, i):
                    self._hand[nbytes] = i + 1
                    return torch.frombuffer(regions[i], dtype=torch.uint8)
            self._trim(nbytes)
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge_pages_available():
                region.madvise(mmap.MADV_HUGEPAGE)
            regions.append(region)
            del region  # only the list may hold it, or it never looks idle
            return torch.frombuffer(regions[-1], dtype=torch.uint8)  # the storage holds the mapping

    def stats(self) -> dict[str, int]:
        """Mappings the pool holds, how many nothing uses now, and their bytes."""
        with self._lock:
            lists = list(self._regions.values())
            return {
                "mappings": sum(len(regions) for regions in lists),
                "idle": sum(_idle(regions, i) for regions in lists for i in range(len(regions))),
                "bytes": sum(len(regions[i]) for regions in lists for i in range(len(regions))),
            }

    def _trim(self, keep: int) -> None:
        """Unmap the idle mappings of every size but ``keep``."""
        for nbytes, regions in self._regions.items():
            if nbytes == keep:
                continue
            for i in reversed(range(len(regions))):
                if _idle(regions, i):
                    regions.pop(i).close()
            self._hand[nbytes] = 0


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

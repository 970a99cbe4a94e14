"""Host memory shared between processes through file descriptors: the kit behind host-memory backends.

A *store* creates, opens and releases memory that can be mapped: sealed memfds and
POSIX shared memory for the ``cpu`` backend, files in an operator's directory for
``cpu.file``, anything a vendor can ``mmap``. The store is the only thing a
host-memory backend writes (:class:`HostMemoryStore`). It declares the *handle* a
consumer needs to find the memory as named, bounded wire fields
(``handle_fields``); this module turns that schema into the wrapper's wire fields
and validates it on the receiving side, so a store never parses anything. The rest,
which every such backend needs and which is easy to get subtly wrong, is here:

* **Sharing in place.** :meth:`HostMemoryIPCWrapper.wrap` of a large allocation of
  torch's (a KV cache) maps fresh shared memory over the allocation's own pages, a
  slice at a time: nothing moves, peak memory grows by one slice (32 MiB), and every
  tensor and view the engine holds keeps its address and sees the shared bytes. This
  needs a store that is also an :class:`InPlaceStore`.
* **Migration** otherwise (a small allocation, whose pages hold other data too;
  memory torch did not allocate; a store that is not an ``InPlaceStore``; an export of
  huge pages that the allocation's bounds do not fit): ``wrap`` copies the
  tensor's *whole storage* into fresh memory and re-points the *same* tensor object
  at it; only tensor objects passed to ``wrap`` are re-pointed (see its docstring).
* **Zero-copy reopening.** :meth:`HostMemoryIPCWrapper.to_tensor` maps the memory
  and replays dtype, shape, stride and storage offset exactly.
  :meth:`HostMemoryIPCWrapper.to_tensors`, which a cache context calls, maps
  separate exports (older engines' one allocation per layer) side by side in one
  address range, so their layers stack in one storage; this needs a store that is
  also a :class:`SideBySideStore`.
* **Page sizes.** Exports may be made of pages larger than the system's (memfds or
  files on hugetlbfs); the kit reads each export's page size from the export itself
  and aligns what it maps in place or side by side to it.
* **Lifetimes follow torch's reference counting.** A mapping is owned by the torch
  storage built over it, so it lives exactly as long as some tensor uses it. When
  the last one dies, a finalizer forgets the mapping and, in the process that made
  the memory, releases its handle. Wrappers hold handles, never memory.
* **One export per storage.** Views of one allocation (vLLM's per-layer views of one
  KV buffer) are shared once, share one handle and keep aliasing, and wrappers decoded
  from one wire record map that memory once between them; wrapping a tensor that
  already lives in a mapping of the store (made here, or reopened here) names it
  instead of copying.
* **Prefaulting.** :meth:`HostMemoryCacheContext.prefault_memory` maps every page of
  an engine's memory into the consumer (a server) ahead of its transfers, which would
  otherwise take a page fault per 4 KiB page they touch first.
* **Fork safety.** A forked child starts with no memory of its own, so nothing it
  does releases its parent's memory.
* **Names** (:class:`SegmentNames`) that are unguessable yet tell a garbage collector
  which process made them, the liveness test for that collector (:func:`find_stale`),
  and the memory limit that anonymous shared memory counts against
  (:func:`memory_headroom`).

torch is imported only when memory is wrapped or reopened, so a backend's probe and
gc hooks may use this module without loading torch.
"""

from __future__ import annotations

from .._headroom import CGROUP_ROOT as CGROUP_ROOT  # constants: importable, not curated
from .._headroom import Headroom, memory_headroom
from .._libc import PopulateUnsupported
from ._context import HostMemoryCacheContext
from ._filemap import FileMapIPCWrapper
from ._names import SegmentNames, find_stale, pid_namespace, producer_alive
from ._store import STORE_MEMBERS as STORE_MEMBERS
from ._store import Handle, HostMemoryStore, InPlaceStore, SideBySideStore
from ._wrapper import HOST_UUID as HOST_UUID
from ._wrapper import HostMemoryIPCWrapper

__all__ = [
    "FileMapIPCWrapper",
    "Handle",
    "Headroom",
    "HostMemoryCacheContext",
    "HostMemoryIPCWrapper",
    "HostMemoryStore",
    "InPlaceStore",
    "PopulateUnsupported",
    "SegmentNames",
    "SideBySideStore",
    "find_stale",
    "memory_headroom",
    "pid_namespace",
    "producer_alive",
]

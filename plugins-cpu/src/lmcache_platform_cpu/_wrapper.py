"""The two wrapper kinds of the ``cpu`` backend, both built on :mod:`lmcache_platform.hostmem`.

* ``CpuMemfdIPCWrapper`` (default): sealed memfds (:mod:`._memfd`). Their size cannot
  change, so no process can make a consumer's mapping fault, and nothing outlives
  the last process holding one. Producer and consumer must see each other's /proc
  (one pid namespace).
* ``CpuShmIPCWrapper``: named POSIX segments in /dev/shm (:mod:`._shm`), for processes
  that share /dev/shm but not their pids (separate containers). A same-user process
  can still truncate one; the cache context checks the size before each transfer.

The generic kit does the rest for both: ``wrap(tensor)`` makes the tensor's whole
storage shared memory once (views of one allocation share it): in place for a large
allocation (the memory is mapped over its own pages, nothing moves), else by a copy
that the *same* tensor object is re-pointed at; ``to_tensor()`` maps it zero-copy;
lifetimes follow torch's reference counting. ``LMCACHE_PLATFORM_CPU_IPC`` picks the kind an engine
exports (:mod:`._config`); a consumer accepts both.
"""

from __future__ import annotations

from typing import ClassVar

from lmcache_platform.hostmem import HostMemoryIPCWrapper

from . import _memfd, _shm


class CpuMemfdIPCWrapper(HostMemoryIPCWrapper):
    """Descriptor of a CPU tensor living in a sealed memfd of its producer.

    The handle (``memfd_pidns``, ``memfd_pid``, ``memfd_fd``, ``memfd_dev``, ``memfd_ino``,
    ``memfd_name``) finds the memfd through ``/proc`` and proves it is the one exported;
    ``memfd_nbytes`` is its exact size. All zero and empty for an empty tensor.
    """

    wire_tag: ClassVar[str] = "cpu.memfd/1"
    store = _memfd.STORE
    nbytes_field = "memfd_nbytes"

    memfd_pidns: int
    memfd_pid: int
    memfd_fd: int
    memfd_dev: int
    memfd_ino: int
    memfd_name: str
    memfd_nbytes: int

    def verify(self) -> None:
        """Nothing to check: the memfd's size is sealed and cannot shrink."""


class CpuShmIPCWrapper(HostMemoryIPCWrapper):
    """Descriptor of a CPU tensor living in a POSIX shared-memory segment.

    ``shm_name`` is the segment (empty for an empty tensor, which needs none) and
    ``shm_nbytes`` its exact size, checked against the real segment before mapping.
    """

    wire_tag: ClassVar[str] = "cpu.shm/1"
    store = _shm.STORE
    nbytes_field = "shm_nbytes"

    shm_name: str
    shm_nbytes: int

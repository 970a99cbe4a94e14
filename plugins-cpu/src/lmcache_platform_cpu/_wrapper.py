"""``CpuShmIPCWrapper``: CPU tensors shared through POSIX shared memory.

All the machinery is the generic host-memory kit of :mod:`lmcache_platform.hostmem`
over the /dev/shm store of :mod:`._shm`:

* ``wrap(tensor)`` moves the tensor's whole storage into a fresh segment (copying
  its bytes) and re-points the *same* tensor object at it, so the engine keeps its
  tensor and its contents. Per storage: views of one allocation get one segment and
  keep aliasing; a tensor already in a segment (made or reopened here) is named,
  not copied.
* ``to_tensor()`` maps the segment zero-copy and replays shape, stride and offset.
* Lifetimes follow torch's reference counting: a segment is unlinked when its last
  tensor dies or its last exporting wrapper closes; a consumer's mapping lives until
  its last view dies.
"""

from __future__ import annotations

from typing import ClassVar

from lmcache_platform.hostmem import HostMemoryIPCWrapper

from . import _shm


class CpuShmIPCWrapper(HostMemoryIPCWrapper):
    """Descriptor of a CPU tensor living in a POSIX shared-memory segment.

    ``shm_name`` is the segment (empty for an empty tensor, which needs none) and
    ``shm_nbytes`` its exact size, checked against the real segment before mapping.
    """

    wire_tag: ClassVar[str] = "cpu.shm/1"
    store = _shm.STORE
    name_field = "shm_name"
    nbytes_field = "shm_nbytes"

    shm_name: str
    shm_nbytes: int

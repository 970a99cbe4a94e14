"""``CPUCacheContext``: the host-memory kit's cache context, for the ``cpu`` backend.

The server reopens each layer's memory (``to_tensor()`` of either wrapper kind);
every store and retrieve is then a host-to-host copy done by the base's generic
torch ops, after the kit has checked that no named segment shrank
(:class:`lmcache_platform.hostmem.HostMemoryCacheContext`). Staging buffers are plain
host tensors, and the stream is the no-op ``NullStream``, because a host copy has
completed when it returns.
"""

from __future__ import annotations

from typing import ClassVar

from lmcache_platform.hostmem import HostMemoryCacheContext


class CPUCacheContext(HostMemoryCacheContext):
    """Cache context for KV tensors in host shared memory (device type ``cpu``)."""

    device_type: ClassVar[str] = "cpu"

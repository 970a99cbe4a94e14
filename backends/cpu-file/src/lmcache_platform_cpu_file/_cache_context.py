"""``CpuFileCacheContext``: the host-memory kit's cache context, unchanged.

The layers are plain CPU tensors once reopened, so the base's defaults fit: host
staging buffers, a no-op stream, and generic torch gathers and scatters. The kit
adds one check before each transfer: that no KV file was truncated under the mapping.
"""

from __future__ import annotations

from typing import ClassVar

from lmcache_platform.hostmem import HostMemoryCacheContext


class CpuFileCacheContext(HostMemoryCacheContext):
    """Cache context for KV tensors kept in KV files (device type ``cpu``)."""

    device_type: ClassVar[str] = "cpu"

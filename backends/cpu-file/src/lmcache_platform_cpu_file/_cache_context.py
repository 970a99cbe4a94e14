"""``CpuFileCacheContext``: the core cache-context machinery, unchanged, over host memory.

The layers are plain CPU tensors once reopened, so the base's defaults fit: host
staging buffers, a no-op stream, and generic torch gathers and scatters.
"""

from __future__ import annotations

from typing import ClassVar

from lmcache_platform import BaseCacheContext


class CpuFileCacheContext(BaseCacheContext):
    """Cache context for KV tensors kept in KV files (device type ``cpu``)."""

    device_type: ClassVar[str] = "cpu"

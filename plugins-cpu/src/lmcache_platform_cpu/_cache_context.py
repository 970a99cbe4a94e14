"""``CPUCacheContext``: the base cache-context machinery over host memory.

The server reopens each layer's segment (``CpuShmIPCWrapper.to_tensor``); every
store and retrieve is then a host-to-host copy done by the base's generic torch ops.
The base's defaults are already what the host needs, so nothing is overridden:
staging buffers are plain host tensors (``torch.empty`` on the context's device,
here ``cpu``), and the stream is the no-op ``NullStream``, because a host copy has
completed when it returns.
"""

from __future__ import annotations

from typing import ClassVar

from lmcache_platform import BaseCacheContext


class CPUCacheContext(BaseCacheContext):
    """Cache context for KV tensors in host shared memory (device type ``cpu``)."""

    device_type: ClassVar[str] = "cpu"

"""The CPU backend of lmcache-platform: KV tensors shared through sealed memfds or POSIX shared memory.

Public names load on first access, so importing the package (as the entry point
does) imports neither torch nor the memory machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_platform import lazy_exports

if TYPE_CHECKING:
    from ._cache_context import CPUCacheContext
    from ._config import IPC_ENV
    from ._gc import reclaim_stale_segments
    from ._memfd import MemfdCapacityError
    from ._shm import ShmCapacityError
    from ._wrapper import CpuMemfdIPCWrapper, CpuShmIPCWrapper

__all__ = [
    "IPC_ENV",
    "CPUCacheContext",
    "CpuMemfdIPCWrapper",
    "CpuShmIPCWrapper",
    "MemfdCapacityError",
    "ShmCapacityError",
    "reclaim_stale_segments",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "._cache_context": ["CPUCacheContext"],
        "._config": ["IPC_ENV"],
        "._gc": ["reclaim_stale_segments"],
        "._memfd": ["MemfdCapacityError"],
        "._shm": ["ShmCapacityError"],
        "._wrapper": ["CpuMemfdIPCWrapper", "CpuShmIPCWrapper"],
    },
)

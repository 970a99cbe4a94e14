"""The CPU backend of lmcache-platform: KV tensors shared through sealed memfds or POSIX shared memory.

Public names load on first access, so importing the package (as the entry point
does) imports neither torch nor the memory machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_HOME = {
    "CPUCacheContext": "._cache_context",
    "CpuMemfdIPCWrapper": "._wrapper",
    "CpuShmIPCWrapper": "._wrapper",
    "IPC_ENV": "._config",
    "MemfdCapacityError": "._memfd",
    "ShmCapacityError": "._shm",
    "reclaim_stale_segments": "._gc",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)

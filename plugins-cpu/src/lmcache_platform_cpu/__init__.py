"""The CPU backend of lmcache-platform: KV tensors shared through POSIX shared memory.

Public names load on first access, so importing the package (as the entry point
does) imports neither torch nor the shared-memory machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._cache_context import CPUCacheContext
    from ._gc import reclaim_stale_segments
    from ._shm import ShmCapacityError
    from ._wrapper import CpuShmIPCWrapper

__all__ = ["CPUCacheContext", "CpuShmIPCWrapper", "ShmCapacityError", "reclaim_stale_segments"]

_HOME = {
    "CPUCacheContext": "._cache_context",
    "CpuShmIPCWrapper": "._wrapper",
    "ShmCapacityError": "._shm",
    "reclaim_stale_segments": "._gc",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)

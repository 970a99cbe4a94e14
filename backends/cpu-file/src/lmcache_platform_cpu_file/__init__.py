"""``cpu.file``: an lmcache-platform backend keeping CPU KV caches in files.

For containers whose /dev/shm is tiny: the KV caches live in a directory the
operator chooses (``LMCACHE_PLATFORM_CPU_FILE_DIR``: a large tmpfs, a hugetlbfs
mount or local NVMe). Built on the public core API only, as a vendor's backend is.

Public names load on first access, so importing the package (as the entry point
does) imports neither torch nor the wrapper.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._cache_context import CpuFileCacheContext
    from ._gc import reclaim_stale_files
    from ._store import ENV_DIR, DirectoryError, FileCapacityError, FileStore
    from ._wrapper import CpuFileIPCWrapper

__all__ = [
    "ENV_DIR",
    "CpuFileCacheContext",
    "CpuFileIPCWrapper",
    "DirectoryError",
    "FileCapacityError",
    "FileStore",
    "reclaim_stale_files",
]

_HOME = {
    "CpuFileCacheContext": "._cache_context",
    "CpuFileIPCWrapper": "._wrapper",
    "DirectoryError": "._store",
    "ENV_DIR": "._store",
    "FileCapacityError": "._store",
    "FileStore": "._store",
    "reclaim_stale_files": "._gc",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)

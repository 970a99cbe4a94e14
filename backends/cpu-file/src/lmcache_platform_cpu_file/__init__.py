"""``cpu.file``: an lmcache-platform backend keeping CPU KV caches in files.

For containers whose /dev/shm is tiny: the KV caches live in a directory the
operator chooses (``LMCACHE_PLATFORM_CPU_FILE_DIR``: a large tmpfs, a hugetlbfs
mount or local NVMe). Built on the public core API only, as a vendor's backend is.

Public names load on first access, so importing the package (as the entry point
does) imports neither torch nor the wrapper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_platform import lazy_exports

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

__getattr__ = lazy_exports(
    __name__,
    {
        "._cache_context": ["CpuFileCacheContext"],
        "._gc": ["reclaim_stale_files"],
        "._store": ["ENV_DIR", "DirectoryError", "FileCapacityError", "FileStore"],
        "._wrapper": ["CpuFileIPCWrapper"],
    },
)

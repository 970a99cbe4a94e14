"""lmcache-platform's file-system remote store: ``serve --remote file:///absolute/dir``.

One file per entry in a directory on local disk or a shared file system, written
atomically, bounded with least-recently-used eviction, shared safely by several servers.
See ``docs/tiers.md``.
"""

from ._store import FileStore, FileStoreConfig

__all__ = ["FileStore", "FileStoreConfig"]

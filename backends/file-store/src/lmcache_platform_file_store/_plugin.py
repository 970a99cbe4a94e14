"""The hook implementations: the remote-store API major, and opening a store for a ``file://`` URL."""

from __future__ import annotations

from lmcache_platform.remote import RemoteOptions, RemoteStore, RemoteURL, hookimpl


@hookimpl
def lmcache_remote_api_version() -> int:
    return 1


@hookimpl
def lmcache_remote_open(url: RemoteURL, options: RemoteOptions) -> RemoteStore:
    from ._store import FileStore, FileStoreConfig

    return FileStore(FileStoreConfig.from_url(url, options))

"""Remote stores: the plugin point behind ``lmcache-platform serve --remote URL``.

A remote store is a shared key-value store of bytes that every node's KV-cache server
reads and writes (Valkey, Valkey Cluster; a vendor's Mooncake or S3 store). Stores are
separate distributions found through the ``lmcache.remote`` entry-point group, one entry
point per URL scheme, exactly as device backends are found through ``lmcache.platform``:
loaded lazily (only the scheme asked for is imported) and isolated when they fail.

What a store author uses:

* :class:`RemoteStore`, the protocol a store implements (batched, pipelined calls with a
  timeout each), and the errors its calls raise (:class:`RemoteError` and subclasses);
* :data:`hookimpl` and :mod:`lmcache_platform.remote.hookspecs` (two hooks);
* :class:`RemoteURL` and :class:`RemoteOptions`, what the open hook receives;
* the conformance suite: ``pytest --pyargs lmcache_platform.remote.conformance
  --lmcache-remote URL`` (see :mod:`lmcache_platform.remote.conformance`).

What an operator or a server uses: :func:`open_remote` and :func:`list_remote_stores`.
What the bytes mean (the entry format, its checksum and the refusal of anything that
does not match) is the server's business, not the store's: see docs/multi-node.md.
Importing this package imports no store and no client library.
"""

from ._errors import (
    RemoteConfigError,
    RemoteError,
    RemotePartialError,
    RemoteStoreLoadError,
    RemoteStoreNotFoundError,
    RemoteTimeout,
    RemoteUnavailable,
)
from ._registry import (
    ENTRY_POINT_GROUP,
    REMOTE_API_VERSION,
    RemoteStoreInfo,
    list_remote_stores,
    open_remote,
)
from ._store import Buffer, RemoteOptions, RemoteStore, RemoteURL, read_secret_file
from .hookspecs import hookimpl

__all__ = [
    "ENTRY_POINT_GROUP",
    "REMOTE_API_VERSION",
    "Buffer",
    "RemoteConfigError",
    "RemoteError",
    "RemoteOptions",
    "RemotePartialError",
    "RemoteStore",
    "RemoteStoreInfo",
    "RemoteStoreLoadError",
    "RemoteStoreNotFoundError",
    "RemoteTimeout",
    "RemoteURL",
    "RemoteUnavailable",
    "hookimpl",
    "list_remote_stores",
    "open_remote",
    "read_secret_file",
]

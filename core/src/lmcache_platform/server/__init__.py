"""The reference KV-cache server, its engine-side client and the cache's content keys.

:class:`ReferenceServer` serves the platform API end to end over one UNIX socket
(``lmcache-platform serve`` runs it in the foreground, :class:`ServerProcess` in a
spawned process); :class:`ServerClient` is what an engine's connector calls.
:func:`cache_namespace` and :func:`chunk_keys` compute the keys under which engines
share chunks. The request format lives in ``server._protocol``. Importing this
package imports neither torch nor a backend.
"""

from .._errors import ServerError
from ._client import ChunkSpec, GetResult, KeyedChunkSpec, PutResult, Registration, ServerClient
from ._keys import KEY_BYTES, cache_namespace, chunk_keys
from ._server import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HOST_BYTES,
    SOCKET_NAME,
    ReferenceServer,
    ServerProcess,
)

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HOST_BYTES",
    "KEY_BYTES",
    "SOCKET_NAME",
    "ChunkSpec",
    "GetResult",
    "KeyedChunkSpec",
    "PutResult",
    "ReferenceServer",
    "Registration",
    "ServerClient",
    "ServerError",
    "ServerProcess",
    "cache_namespace",
    "chunk_keys",
]

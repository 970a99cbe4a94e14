"""The reference KV-cache server, its engine-side client and the cache's content keys.

:class:`ReferenceServer` serves the platform API end to end over one UNIX socket
(``lmcache-platform serve`` runs it in the foreground, :class:`ServerProcess` in a
spawned process); :class:`ServerClient` is a blocking client, :class:`AsyncClient` the
one an engine's hot path uses (it never blocks: requests in, :class:`Pending` futures out).
Both send the same typed requests (one type per op, with its result type: :class:`GetRequest`
answers with a :class:`GetResult`) through ``execute``.
:func:`cache_namespace` and :func:`chunk_keys` compute the keys under which engines
share chunks. The request format is in ``docs/wire-format.md``. Importing this
package imports neither torch nor a backend.
"""

from .._errors import ServerError, ServerUnavailable
from ..client import AsyncClient, ChunkSpec, KeyedChunkSpec, Pending, ServerClient, SessionField, new_lease_id
from ..protocol import (
    KEY_BYTES,
    Chunk,
    GetRequest,
    GetResult,
    LookupRequest,
    LookupResult,
    PingRequest,
    PingResult,
    PutRequest,
    PutResult,
    RawRequest,
    RegisterRequest,
    Registration,
    ReleaseRequest,
    RemovalsRequest,
    RemovalsResult,
    Request,
    RetrieveRequest,
    RetrieveResult,
    ShutdownRequest,
    StatusRequest,
    StoreRequest,
    StoreResult,
    UnregisterRequest,
    cache_namespace,
    chunk_keys,
)
from ._process import ServerProcess
from ._server import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HOST_BYTES,
    DEFAULT_TORCH_THREADS,
    SOCKET_NAME,
    ReferenceServer,
)

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HOST_BYTES",
    "DEFAULT_TORCH_THREADS",
    "KEY_BYTES",
    "SOCKET_NAME",
    "AsyncClient",
    "Chunk",
    "ChunkSpec",
    "GetRequest",
    "GetResult",
    "KeyedChunkSpec",
    "LookupRequest",
    "LookupResult",
    "Pending",
    "PingRequest",
    "PingResult",
    "PutRequest",
    "PutResult",
    "RawRequest",
    "ReferenceServer",
    "RegisterRequest",
    "Registration",
    "ReleaseRequest",
    "RemovalsRequest",
    "RemovalsResult",
    "Request",
    "RetrieveRequest",
    "RetrieveResult",
    "ServerClient",
    "ServerError",
    "ServerProcess",
    "ServerUnavailable",
    "SessionField",
    "ShutdownRequest",
    "StatusRequest",
    "StoreRequest",
    "StoreResult",
    "UnregisterRequest",
    "cache_namespace",
    "chunk_keys",
    "new_lease_id",
]

"""The protocol engines and the server speak: one typed request and result per op, their wire
encoding, framing and the cache's content keys.

Both sides import this package, and it imports neither of them: a client
(:mod:`lmcache_platform.client`) and the server (:mod:`lmcache_platform.server`) stand on it
side by side. Each op is written once in ``_ops`` (its request type and result type: a
:class:`GetRequest` answers with a :class:`GetResult`); ``_messages`` turns them into bytes
and back, checked field by field; :func:`cache_namespace` and :func:`chunk_keys` compute the
keys under which engines share chunks. The request format is in ``docs/wire-format.md``.
"""

from __future__ import annotations

from ._keys import KEY_BYTES, cache_namespace, chunk_keys
from ._ops import (
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
)

__all__ = [
    "KEY_BYTES",
    "Chunk",
    "GetRequest",
    "GetResult",
    "LookupRequest",
    "LookupResult",
    "PingRequest",
    "PingResult",
    "PutRequest",
    "PutResult",
    "RawRequest",
    "RegisterRequest",
    "Registration",
    "ReleaseRequest",
    "RemovalsRequest",
    "RemovalsResult",
    "Request",
    "RetrieveRequest",
    "RetrieveResult",
    "ShutdownRequest",
    "StatusRequest",
    "StoreRequest",
    "StoreResult",
    "UnregisterRequest",
    "cache_namespace",
    "chunk_keys",
]

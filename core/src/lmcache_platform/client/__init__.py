"""The engine side of the server's socket: a blocking client and the non-blocking one an
engine's hot path uses.

:class:`ServerClient` blocks (tools, tests, ``on_connect`` hooks); :class:`AsyncClient`
never blocks (requests in, :class:`Pending` futures out). Both send the typed requests of
:mod:`lmcache_platform.protocol` through ``execute``. Nothing here imports the server's own
modules: an engine loads only this package and the protocol.
"""

from __future__ import annotations

from .._errors import ServerError, ServerUnavailable
from ..protocol._ops import SessionField
from ._async import AsyncClient
from ._client import ChunkSpec, KeyedChunkSpec, ServerClient
from ._pending import Pending, new_lease_id

__all__ = [
    "AsyncClient",
    "ChunkSpec",
    "KeyedChunkSpec",
    "Pending",
    "ServerClient",
    "ServerError",
    "ServerUnavailable",
    "SessionField",
    "new_lease_id",
]

"""The reference KV-cache server and its engine-side client.

:class:`ReferenceServer` serves the platform API end to end over one UNIX socket
(:class:`ServerProcess` runs it in a spawned process); :class:`ServerClient` is what an
engine's connector calls. The request format lives in ``server._protocol``. Importing
this package imports neither torch nor a backend.
"""

from .._errors import ServerError
from ._client import ChunkSpec, Registration, ServerClient
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
    "SOCKET_NAME",
    "ChunkSpec",
    "ReferenceServer",
    "Registration",
    "ServerClient",
    "ServerError",
    "ServerProcess",
]

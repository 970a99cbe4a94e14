"""The reference KV-cache server; with it, every name of the client and the protocol.

:class:`ReferenceServer` serves the platform API end to end over one UNIX socket
(``lmcache-platform serve`` runs it in the foreground, :class:`ServerProcess` in a
spawned process). The engine side lives beside it and imports none of it:
``lmcache_platform.client`` (:class:`ServerClient`, blocking; :class:`AsyncClient`,
the one an engine's hot path uses: requests in, :class:`Pending` futures out) and
``lmcache_platform.protocol`` (one typed request and result per op, a
:class:`GetRequest` answered with a :class:`GetResult`; :func:`cache_namespace` and
:func:`chunk_keys`, the keys under which engines share chunks), both re-exported here.
The request format is in ``docs/wire-format.md``. Importing this package imports neither
torch nor a backend.
"""

from .. import client, protocol
from ..client import *  # noqa: F403 - the engine side, re-exported (see lmcache_platform.client)
from ..protocol import *  # noqa: F403 - what both sides speak (see lmcache_platform.protocol)
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
    "SOCKET_NAME",
    "ReferenceServer",
    "ServerProcess",
]
__all__ += client.__all__
__all__ += protocol.__all__

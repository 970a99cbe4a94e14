"""The Valkey remote store of lmcache-platform (``valkey://``, ``valkeys://``, ``valkey+cluster://``).

Installed, it serves ``lmcache-platform serve --remote URL`` through the ``lmcache.remote``
entry points; nothing here is imported until a server asks for one of its schemes. Built
on the ``valkey`` client (the redis-py fork) and core's public
:mod:`lmcache_platform.remote` API only, as a vendor's store would be.
"""

from ._config import ValkeyConfig
from ._store import ValkeyStore

__all__ = ["ValkeyConfig", "ValkeyStore"]

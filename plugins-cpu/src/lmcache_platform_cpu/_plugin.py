"""Hook implementations of the ``cpu`` backend. Imports nothing heavy at import time."""

from __future__ import annotations

from lmcache_platform import API_VERSION, hookimpl


@hookimpl
def lmcache_platform_api_version() -> int:
    return API_VERSION

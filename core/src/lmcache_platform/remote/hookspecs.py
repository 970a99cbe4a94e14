"""The hook specifications of a remote store: the whole remote-store contract.

A remote store is a module holding ``@hookimpl`` functions (the marker of
:mod:`lmcache_platform.remote`, project ``lmcache_platform_remote``, so a device
backend's hooks and a store's never mix), advertised under the entry-point group
``lmcache.remote``. The entry-point name is the URL scheme the store serves; one module
may serve several schemes through several entry points (``valkey``, ``valkeys``,
``valkey+cluster``). Only the module of the scheme an operator asks for is imported.

As for device backends, pluggy validates hook names and arguments at registration and
core calls the one store's implementation directly; a store that fails to import, speaks
another API major or raises from a hook is isolated (logged once, reported as a
:class:`~lmcache_platform.remote.RemoteStoreLoadError` naming its distribution and entry
point) and the server keeps serving without a remote tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ._store import RemoteOptions, RemoteStore, RemoteURL

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec", "lmcache_remote_api_version", "lmcache_remote_open"]

PROJECT_NAME = "lmcache_platform_remote"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for remote-store hook implementations: ``@hookimpl def lmcache_remote_...``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec(firstresult=True)
def lmcache_remote_api_version() -> int:  # type: ignore[empty-body]
    """Say which remote-store API major this store was written against.

    Returns:
        The major as a literal ``int`` (``return 1``), never core's own constant.

    Enforcement: must equal :data:`lmcache_platform.remote.REMOTE_API_VERSION`, else
    the store fails to load, naming both versions. Required. Since remote API 1.
    """


@hookspec(firstresult=True)
def lmcache_remote_open(url: RemoteURL, options: RemoteOptions) -> RemoteStore | None:
    """Return a store for ``url`` (its scheme is this entry point's name).

    Args:
        url: the parsed URL (no password: core refuses one in a URL).
        options: timeouts, credentials (read them with ``options.password()``), TLS files
            and the store's own ``settings``.

    Returns:
        An object with the :class:`~lmcache_platform.remote.RemoteStore` methods. Do not
        block on the network here: a store that is down when the server starts must not
        stop it; connect on first use and let calls raise ``RemoteUnavailable`` meanwhile.
        Raise :class:`~lmcache_platform.remote.RemoteConfigError` for a URL or option this
        store cannot use, naming it.

    Enforcement: the answer must have every ``RemoteStore`` method; ``None`` or anything
    else fails the open with :class:`~lmcache_platform.remote.RemoteStoreLoadError`.
    Required. Since remote API 1.
    """

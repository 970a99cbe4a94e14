"""Finding and opening remote stores: the ``lmcache.remote`` group of the plugin engine.

Everything but opening is the engine's (:mod:`lmcache_platform._plugins.engine`): the
entry points are read from installed metadata once, importing nothing; :func:`open_remote`
loads only the store behind the URL's scheme, which pluggy validates against
:mod:`lmcache_platform.remote.hookspecs` and the engine checks for its API major and its
open hook. A store that fails any step is recorded as failed with its traceback, logged
once at WARNING and reported as :class:`RemoteStoreLoadError` whenever its scheme is
asked for; other schemes are untouched. There is no selection: a scheme names exactly
one store, and two distributions claiming one scheme is a problem reported for that
scheme.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

from .._plugins.engine import ApiCheck, Engine, Group, Record, Status
from . import hookspecs
from ._errors import RemoteConfigError, RemoteError, RemoteStoreLoadError, RemoteStoreNotFoundError
from ._store import SCHEME_RE, RemoteOptions, RemoteStore, RemoteURL

logger = logging.getLogger(__name__)

#: The entry-point group remote stores advertise themselves under.
ENTRY_POINT_GROUP = "lmcache.remote"
#: The remote-store API major this core speaks (what ``lmcache_remote_api_version`` returns).
REMOTE_API_VERSION = 1

#: The remote-store group: what makes ``lmcache.remote`` differ from other groups.
STORES: Group[None] = Group(
    entry_points=ENTRY_POINT_GROUP,
    kind="remote store",
    hookspecs=hookspecs,
    hook_prefix="lmcache_remote_",
    names=SCHEME_RE,
    name_rule="a remote store's entry-point name is its URL scheme: "
    "lowercase letters and digits, one optional '+part'",
    api=ApiCheck("lmcache_remote_api_version", REMOTE_API_VERSION, "remote-store API", RemoteStoreLoadError),
    error=RemoteStoreLoadError,
    logger=logger,
    required=("lmcache_remote_open",),
)


@dataclass(frozen=True)
class RemoteStoreInfo:
    """One installed remote store, for listings: ``status`` is ``not loaded``, ``ok`` or ``failed``."""

    scheme: str
    distribution: str | None
    version: str | None
    entry_point: str
    status: str
    reason: str = ""


class RemoteRegistry:
    """The remote stores of one process; :data:`REGISTRY` is the live one."""

    def __init__(self, search_path: list[str] | None = None) -> None:
        self.engine: Engine[None] = Engine(STORES, search_path=search_path)

    def install(self, scheme: str, plugin: object, *, distribution: str, version: str) -> None:
        """Add ``plugin`` as if an installed distribution advertised it for ``scheme`` (tests)."""
        self.engine.install(scheme, plugin, distribution=distribution, version=version)

    def schemes(self) -> list[str]:
        return self.engine.names()

    def stores(self, *, load: bool = False) -> list[RemoteStoreInfo]:
        """Every installed store, by scheme; ``load=True`` imports and validates each first."""
        return [
            RemoteStoreInfo(r.name, r.distribution, r.version, r.entry_point or "", r.status.value, r.reason)
            for r in self.engine.records(load=load)
        ]

    def store(self, scheme: str) -> Record[None]:
        """The loaded store serving ``scheme``; raises its load error or a not-found error."""
        rec = self.engine.get(scheme)
        if rec is None:
            installed = self.engine.names()
            raise RemoteStoreNotFoundError(
                f"no installed remote store serves the URL scheme {scheme!r} "
                f"(installed: {', '.join(installed) or 'none'}); {_install_hint(scheme)}",
                scheme=scheme,
                installed=installed,
            )
        self.engine.load(rec)
        if rec.status is not Status.OK:
            assert rec.error is not None
            raise rec.error
        return rec

    def open(self, url: str | RemoteURL, options: RemoteOptions | None = None) -> RemoteStore:
        """A store for ``url``: see :func:`open_remote`."""
        parsed = url if isinstance(url, RemoteURL) else RemoteURL.parse(url)
        options = options or RemoteOptions()
        rec = self.store(parsed.scheme)
        try:
            store = self.engine.call(rec, "lmcache_remote_open", url=parsed, options=options)
        except (RemoteConfigError, RemoteError):
            raise
        except Exception as exc:
            error = rec.error_of(
                f"remote store {parsed.scheme!r} ({rec.origin}) failed to open {parsed.text}: "
                f"{type(exc).__name__}: {exc}"
            )
            error.traceback = traceback.format_exc()
            raise error from exc
        if not isinstance(store, RemoteStore):
            raise rec.error_of(
                f"remote store {parsed.scheme!r} ({rec.origin}) returned {store!r} from "
                "lmcache_remote_open, "
                "not an object with the RemoteStore methods (get_many, exists_many, put_many, ping, close)"
            )
        return store


#: The first-party stores, by the schemes they serve: (distribution, its folder in a checkout).
FIRST_PARTY: dict[str, tuple[str, str]] = {
    "file": ("lmcache-platform-file-store", "backends/file-store"),
    **{
        s: ("lmcache-platform-valkey", "backends/valkey")
        for s in ("valkey", "valkeys", "valkey+cluster", "valkeys+cluster")
    },
}


def _install_hint(scheme: str) -> str:
    """How to get a store for ``scheme``: its first-party distribution, or how stores are found."""
    if scheme in FIRST_PARTY:
        distribution, folder = FIRST_PARTY[scheme]
        return f"install {distribution} (from a checkout of lmcache-platform: pip install ./{folder})"
    return (
        "a store is a distribution advertising its scheme in the lmcache.remote entry-point group "
        "(see docs/remote-stores.md); `lmcache-platform list` shows the installed ones"
    )


#: The live remote-store registry of this process.
REGISTRY = RemoteRegistry()


def open_remote(url: str | RemoteURL, options: RemoteOptions | None = None) -> RemoteStore:
    """Open the remote store ``url`` names, through the store installed for its scheme.

    Imports only that store's module (on first use). Raises
    :class:`RemoteConfigError` for a malformed URL (or one with a password),
    :class:`RemoteStoreNotFoundError` when no installed store serves the scheme, and
    :class:`RemoteStoreLoadError` (naming the distribution and entry point) when the store
    fails to load or to open. Opening does not wait for the network.
    """
    return REGISTRY.open(url, options)


def list_remote_stores(*, load: bool = False) -> list[RemoteStoreInfo]:
    """Every installed remote store, by scheme; ``load=True`` imports and validates each first."""
    return REGISTRY.stores(load=load)

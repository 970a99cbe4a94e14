"""Finding and opening remote stores: entry points by URL scheme, loaded lazily, isolated.

The device-backend machinery in miniature, built on the same discovery
(:mod:`lmcache_platform._plugins.discovery`): the ``lmcache.remote`` entry points are
read from installed metadata once, without importing anything; :func:`open_remote`
imports only the module behind the URL's scheme, registers it with a pluggy plugin
manager of its own (hook names and arguments validated against
:mod:`lmcache_platform.remote.hookspecs`), checks the API major, and asks it for a store.
A store that fails any step is recorded as failed with its traceback, logged once at
WARNING and reported as :class:`RemoteStoreLoadError` whenever its scheme is asked for;
other schemes are untouched. There is no selection: a scheme names exactly one store,
and two distributions claiming one scheme is a problem reported for that scheme.
"""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import pluggy

from .._plugins import discovery
from . import hookspecs
from ._errors import RemoteConfigError, RemoteError, RemoteStoreLoadError, RemoteStoreNotFoundError
from ._store import SCHEME_RE, RemoteOptions, RemoteStore, RemoteURL

logger = logging.getLogger("lmcache_platform.remote")

#: The entry-point group remote stores advertise themselves under.
ENTRY_POINT_GROUP = "lmcache.remote"
#: The remote-store API major this core speaks (what ``lmcache_remote_api_version`` returns).
REMOTE_API_VERSION = 1

_HOOK_PREFIX = "lmcache_remote_"
_SPEC_NAMES = frozenset(n for n in dir(hookspecs) if n.startswith(_HOOK_PREFIX))
_SCHEME_RULE = (
    "a remote store's entry-point name is its URL scheme: lowercase letters and digits, one optional '+part'"
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


@dataclass(eq=False)
class _Record:
    spec: discovery.BackendSpec
    status: str = "not loaded"
    error: RemoteStoreLoadError | None = None
    pm: pluggy.PluginManager | None = None

    def error_of(self, message: str) -> RemoteStoreLoadError:
        s = self.spec
        return RemoteStoreLoadError(
            message, backend=s.name, distribution=s.distribution, version=s.version, entry_point=s.entry_point
        )

    def where(self) -> str:
        s = self.spec
        return f"{s.distribution} {s.version}, entry point {s.entry_point!r}" if s.distribution else "manual"


class RemoteRegistry:
    """The remote stores of one process; :data:`REGISTRY` is the live one."""

    def __init__(self, search_path: list[str] | None = None) -> None:
        self._lock = threading.RLock()
        self._records: dict[str, _Record] = {}
        self._scanned = False
        #: Directories to read metadata from; ``None`` means ``sys.path`` (tests narrow it).
        self.search_path = search_path

    def _ensure_scanned(self) -> None:
        with self._lock:
            if not self._scanned:
                specs = discovery.scan(
                    ENTRY_POINT_GROUP, self.search_path, names=SCHEME_RE, rule=_SCHEME_RULE
                )
                for spec in specs:
                    self._records.setdefault(spec.name, _Record(spec))
                self._scanned = True

    def install(self, scheme: str, plugin: object, *, distribution: str, version: str) -> None:
        """Add ``plugin`` as if an installed distribution advertised it for ``scheme`` (tests)."""
        spec = discovery.BackendSpec(
            name=scheme,
            distribution=distribution,
            version=version,
            entry_point=f"{scheme} = <installed by test>",
            load=lambda: plugin,
            problem=None if SCHEME_RE.match(scheme) else f"invalid scheme {scheme!r}: {_SCHEME_RULE}",
        )
        with self._lock:
            self._ensure_scanned()
            self._records[scheme] = _Record(spec)

    def schemes(self) -> list[str]:
        self._ensure_scanned()
        return sorted(self._records)

    def stores(self, *, load: bool = False) -> list[RemoteStoreInfo]:
        """Every installed store, by scheme; ``load=True`` imports and validates each first."""
        self._ensure_scanned()
        with self._lock:
            out = []
            for scheme, rec in sorted(self._records.items()):
                if load and rec.status == "not loaded":
                    self._load(rec)
                reason = (
                    "; ".join(ln.strip() for ln in str(rec.error).splitlines() if ln.strip())
                    if rec.error
                    else ""
                )
                out.append(
                    RemoteStoreInfo(
                        scheme,
                        rec.spec.distribution,
                        rec.spec.version,
                        rec.spec.entry_point,
                        rec.status,
                        reason,
                    )
                )
            return out

    def _plugin_manager(self, scheme: str) -> pluggy.PluginManager:
        """The loaded store's plugin manager; raises its load error or a not-found error."""
        self._ensure_scanned()
        with self._lock:
            rec = self._records.get(scheme)
            if rec is None:
                installed = sorted(self._records)
                raise RemoteStoreNotFoundError(
                    f"no installed remote store serves the URL scheme {scheme!r} "
                    f"(installed: {', '.join(installed) or 'none'}; the first-party Valkey store is "
                    "pip install lmcache-platform-valkey)",
                    scheme=scheme,
                    installed=installed,
                )
            if rec.status == "not loaded":
                self._load(rec)
            if rec.error is not None:
                raise rec.error
            assert rec.pm is not None
            return rec.pm

    def _load(self, rec: _Record) -> None:
        """Import, register and validate one store; on any failure record it (isolated) and log once."""
        try:
            if rec.spec.problem:
                raise rec.error_of(rec.spec.problem)
            plugin = rec.spec.load()
            unknown = sorted(n for n in dir(plugin) if n.startswith(_HOOK_PREFIX) and n not in _SPEC_NAMES)
            if unknown:
                raise rec.error_of(
                    f"remote store {rec.spec.name!r} implements unknown hooks: {', '.join(unknown)} "
                    f"(known: {', '.join(sorted(_SPEC_NAMES))})"
                )
            pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            pm.add_hookspecs(hookspecs)
            pm.register(plugin, name=rec.spec.name)  # pluggy checks argument names here
            api = _call(pm, "lmcache_remote_api_version")
            if api != REMOTE_API_VERSION:
                raise rec.error_of(
                    f"remote store {rec.spec.name!r} ({rec.where()}) targets remote-store API {api!r}, "
                    f"but this lmcache-platform speaks API {REMOTE_API_VERSION}"
                )
            if not pm.hook.lmcache_remote_open.get_hookimpls():
                raise rec.error_of(f"remote store {rec.spec.name!r} does not implement lmcache_remote_open")
        except (Exception, SystemExit) as exc:  # a store calling sys.exit() must not exit the server
            rec.status = "failed"
            error = (
                exc
                if isinstance(exc, RemoteStoreLoadError)
                else rec.error_of(
                    f"remote store {rec.spec.name!r} ({rec.where()}) failed to load: "
                    f"{type(exc).__name__}: {exc}"
                )
            )
            error.traceback = traceback.format_exc()
            if error is not exc:
                error.__cause__ = exc
            rec.error = error
            logger.warning("lmcache-platform: %s\n%s", error, error.traceback)
            return
        rec.pm, rec.status = pm, "ok"

    def open(self, url: str | RemoteURL, options: RemoteOptions | None = None) -> RemoteStore:
        """A store for ``url``: see :func:`open_remote`."""
        parsed = url if isinstance(url, RemoteURL) else RemoteURL.parse(url)
        options = options or RemoteOptions()
        pm = self._plugin_manager(parsed.scheme)
        rec = self._records[parsed.scheme]
        try:
            store = _call(pm, "lmcache_remote_open", url=parsed, options=options)
        except (RemoteConfigError, RemoteError):
            raise
        except Exception as exc:
            error = rec.error_of(
                f"remote store {parsed.scheme!r} ({rec.where()}) failed to open {parsed.text}: "
                f"{type(exc).__name__}: {exc}"
            )
            error.traceback = traceback.format_exc()
            raise error from exc
        if not isinstance(store, RemoteStore):
            raise rec.error_of(
                f"remote store {parsed.scheme!r} ({rec.where()}) returned {store!r} from "
                "lmcache_remote_open, "
                "not an object with the RemoteStore methods (get_many, exists_many, put_many, ping, close)"
            )
        return store


def _call(pm: pluggy.PluginManager, hook: str, **kwargs: Any) -> Any:
    """The one registered store's implementation of ``hook`` (``None`` if it has none)."""
    for impl in getattr(pm.hook, hook).get_hookimpls():
        return impl.function(*(kwargs[arg] for arg in impl.argnames))
    return None


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

"""The process-wide registry: backend records, loading with isolation, cached tables.

Data flow: :mod:`.discovery` lists backends from metadata; the first lookup of a
device type loads (imports and validates) only that type's backends, asks them
for their classes and probe, lets :mod:`.selection` choose, and caches the chosen
classes in two plain dicts. Later lookups are a dict hit: no lock, no pluggy call.

A backend that fails to import, declares another API major, has unknown hooks,
raises from a hook or returns the wrong kind of class is recorded as failed with
its traceback, unregistered again (never left half-registered), logged once at
WARNING, and reported only when someone asks for its device type.
"""

from __future__ import annotations

import enum
import logging
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from .. import _env, hookspecs
from .._errors import (
    ApiVersionError,
    BackendLoadError,
    BackendNotFoundError,
    BackendSelectionError,
)
from .._events import DeviceEvent
from .._ipc_wrapper import DeviceIPCWrapper
from .._kv.context import BaseCacheContext
from .._types import Availability
from .._version import API_VERSION
from . import discovery, selection

if TYPE_CHECKING:
    import torch

    WrapperFactory = Callable[[torch.Tensor], DeviceIPCWrapper]
else:
    WrapperFactory = Callable[[Any], DeviceIPCWrapper]

logger = logging.getLogger("lmcache_platform")

_HOOK_PREFIX = "lmcache_platform_"
_SPEC_NAMES = frozenset(n for n in dir(hookspecs) if n.startswith(_HOOK_PREFIX))
_WHAT_CONTEXT = "cache-context class"
_WHAT_WRAPPER = "KV-cache wrapper factory"


class Status(str, enum.Enum):
    """Where a backend stands in this process."""

    #: Not imported yet (backends load on first use, or with ``load=True``).
    NOT_LOADED = "not loaded"
    #: Loaded and validated; its probe says it can serve here.
    OK = "ok"
    #: Importing, registering or validating it failed; ``reason`` and ``traceback`` say why.
    FAILED = "failed"
    #: Named in ``LMCACHE_PLATFORM_DISABLE``, so never loaded.
    DISABLED = "disabled"
    #: Loaded, but it cannot serve here (its probe said no, or it gives no classes).
    UNAVAILABLE = "unavailable"


@dataclass(eq=False)
class _Backend:
    """Mutable record of one backend (from an entry point or registered by hand)."""

    name: str
    distribution: str | None
    version: str | None
    entry_point: str | None
    load: Callable[[], object]
    manual: bool = False
    problem: str | None = None
    status: Status = Status.NOT_LOADED
    reason: str = ""
    error: BackendLoadError | None = None
    plugin: object | None = None
    context_class: type[BaseCacheContext] | None = None
    wrapper_class: type[DeviceIPCWrapper] | None = None
    wire_classes: tuple[type[DeviceIPCWrapper], ...] = ()
    event_class: type[DeviceEvent] | None = None

    @property
    def device_type(self) -> str:
        return discovery.device_type_of(self.name)

    @property
    def usable(self) -> bool:
        return self.status is Status.OK

    def error_of(self, message: str, kind: type[BackendLoadError] = BackendLoadError) -> BackendLoadError:
        """A load error of ``kind`` that names this backend, its distribution and entry point."""
        return kind(
            message,
            backend=self.name,
            distribution=self.distribution,
            version=self.version,
            entry_point=self.entry_point,
        )


@dataclass(frozen=True)
class BackendInfo:
    """Read-only view of a backend, for listings and diagnostics."""

    name: str
    device_type: str
    distribution: str | None
    version: str | None
    entry_point: str | None
    status: Status
    reason: str
    traceback: str | None
    manual: bool
    #: How this backend was chosen for its device type, one of ``"explicit"``
    #: (``LMCACHE_PLATFORM_BACKEND``), ``"primary"`` (named exactly like the device type) or
    #: ``"only"`` (the one usable backend); ``None`` when it is not the selected one.
    selected_by: str | None = None
    #: One line saying why it was chosen ("" when it is not the selected one).
    why_selected: str = ""

    @property
    def selected(self) -> bool:
        """Whether this backend serves its device type in this process."""
        return self.selected_by is not None


@dataclass(frozen=True)
class TableState:
    """A snapshot of one lookup table and whether it counts as discovered.

    ``discovered`` keeps the upstream name: a discovered table is frozen, so a lookup
    that misses raises instead of loading backends.
    """

    entries: Mapping[str, Any]
    discovered: bool


@dataclass
class _Table:
    """device type -> class or factory. A ``frozen`` table does not resolve misses."""

    entries: dict[str, Any] = field(default_factory=dict)
    frozen: bool = False
    #: Device types whose entries came from selection (dropped when backends change).
    auto: set[str] = field(default_factory=set)

    def snapshot(self) -> TableState:
        return TableState(dict(self.entries), self.frozen)

    def restore(self, state: TableState | Mapping[str, Any]) -> None:
        self.entries.clear()  # in place: the hot path holds a reference to this dict
        self.auto.clear()
        if isinstance(state, TableState):
            self.entries.update(state.entries)
            self.frozen = state.discovered
        else:
            self.entries.update(state)
            self.frozen = True

    def forget(self, device_type: str) -> None:
        if device_type in self.auto:
            self.auto.discard(device_type)
            self.entries.pop(device_type, None)


class Registry:
    """All backend state of one process. The module-level :data:`REGISTRY` is the live one."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._backends: dict[str, _Backend] = {}
        self._scanned = False
        #: device type -> backend name last logged as its choice (log each choice once).
        self._announced: dict[str, str] = {}
        #: Directories to read metadata from; ``None`` means ``sys.path`` (tests narrow it).
        self.search_path: list[str] | None = None
        self.contexts = _Table()
        self.wrappers = _Table()

    # -- metadata -----------------------------------------------------------------------

    def _ensure_scanned(self) -> None:
        """Read metadata once; the lock makes racing first callers scan exactly once."""
        with self._lock:
            if self._scanned:
                return
            if _env.autoload_enabled():
                for spec in discovery.scan(path=self.search_path):
                    self._add(
                        _Backend(
                            name=spec.name,
                            distribution=spec.distribution,
                            version=spec.version,
                            entry_point=spec.entry_point,
                            load=spec.load,
                            problem=spec.problem,
                        )
                    )
            self._scanned = True

    def _add(self, backend: _Backend) -> None:
        if backend.name in _env.disabled_backends() and not backend.manual:
            backend.status = Status.DISABLED
            backend.reason = f"disabled by {_env.DISABLE_ENV}"
        self._backends[backend.name] = backend

    def refresh(self) -> None:
        """Forget everything read from metadata and every cached choice; re-scan on next use.

        Manually registered backends stay. Modules already imported stay imported.
        """
        with self._lock:
            for name, backend in list(self._backends.items()):
                if not backend.manual:
                    self._unregister(backend)
                    del self._backends[name]
                else:
                    self._unregister(backend)
                    backend.status, backend.reason, backend.error = Status.NOT_LOADED, "", None
            for table in (self.contexts, self.wrappers):
                for device_type in list(table.auto):
                    table.forget(device_type)
            self._announced.clear()
            self._scanned = False

    # -- loading ------------------------------------------------------------------------

    def _unregister(self, backend: _Backend) -> None:
        if self._pm.has_plugin(backend.name):
            self._pm.unregister(name=backend.name)

    def _call(self, backend: _Backend, hook: str, **kwargs: Any) -> Any:
        """Call one backend's implementation of ``hook``; ``None`` if it has none."""
        for impl in getattr(self._pm.hook, hook).get_hookimpls():
            if impl.plugin_name == backend.name:
                return impl.function(*(kwargs[arg] for arg in impl.argnames))
        return None

    def _load(self, backend: _Backend) -> None:
        """Import, register and validate one backend; on any failure record it and roll back."""
        try:
            if backend.problem:
                raise backend.error_of(backend.problem)
            plugin = backend.load()
            self._register(backend, plugin)
            self._validate(backend)
        except (Exception, SystemExit) as exc:  # a backend calling sys.exit() must not exit the host
            self._unregister(backend)
            backend.plugin = None
            backend.context_class = backend.wrapper_class = None
            backend.wire_classes = ()
            backend.event_class = None
            backend.status = Status.FAILED
            tb = traceback.format_exc()
            where = f"{backend.distribution} {backend.version}" if backend.distribution else "manual"
            error = (
                exc
                if isinstance(exc, BackendLoadError)
                else backend.error_of(
                    f"backend {backend.name!r} ({where}, entry point {backend.entry_point!r}) "
                    f"failed to load: {type(exc).__name__}: {exc}"
                )
            )
            error.traceback = tb
            if error is not exc:
                error.__cause__ = exc
            backend.error = error
            # One line for listings; pluggy's validation errors span several, all useful.
            backend.reason = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
            backend.reason = backend.reason or type(exc).__name__
            logger.warning("lmcache-platform: %s\n%s", backend.reason, tb)

    def _register(self, backend: _Backend, plugin: object) -> None:
        unknown = sorted(n for n in dir(plugin) if n.startswith(_HOOK_PREFIX) and n not in _SPEC_NAMES)
        if unknown:
            raise backend.error_of(
                f"backend {backend.name!r} implements unknown hooks: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(_SPEC_NAMES))})"
            )
        # pluggy validates argument names against the specs here (PluginValidationError).
        self._pm.register(plugin, name=backend.name)
        backend.plugin = plugin

    def _validate(self, backend: _Backend) -> None:
        name, dt = backend.name, backend.device_type
        api = self._call(backend, "lmcache_platform_api_version")
        if api != API_VERSION:
            raise backend.error_of(
                f"backend {name!r} from {backend.distribution or 'a manual registration'} "
                f"{backend.version or ''} targets backend API {api!r}, but this lmcache-platform "
                f"speaks API {API_VERSION}"
                + ("" if api is not None else " (it must implement lmcache_platform_api_version)"),
                ApiVersionError,
            )
        ctx = self._call(backend, "lmcache_platform_cache_context_class", device_type=dt)
        wrapper = self._call(backend, "lmcache_platform_ipc_wrapper_class", device_type=dt)
        wire = self._call(backend, "lmcache_platform_wire_classes", device_type=dt)
        probe = self._call(backend, "lmcache_platform_probe", device_type=dt)
        event = self._call(backend, "lmcache_platform_device_event_class", device_type=dt)
        if ctx is None and wrapper is None:
            backend.status = Status.UNAVAILABLE
            backend.reason = f"provides no classes for device type {dt!r}"
            return
        _check_class(backend, "cache-context", ctx, BaseCacheContext)
        _check_class(backend, "IPC-wrapper", wrapper, DeviceIPCWrapper)
        wire_classes = (wrapper,) if wire is None else tuple(wire)
        for cls in wire_classes:
            _check_class(backend, "wire", cls, DeviceIPCWrapper)
        if probe is not None and not isinstance(probe, Availability):
            raise TypeError(f"lmcache_platform_probe returned {probe!r}, not an Availability")
        if event is not None:
            _check_class(backend, "device-event", event, DeviceEvent)
        backend.context_class, backend.wrapper_class = ctx, wrapper
        backend.wire_classes = wire_classes
        backend.event_class = event
        if probe is None or probe.ok:
            backend.status, backend.reason = Status.OK, ""
        else:
            backend.status, backend.reason = Status.UNAVAILABLE, probe.reason

    # -- resolution ---------------------------------------------------------------------

    def _backends_for(self, device_type: str) -> list[_Backend]:
        return [b for n, b in sorted(self._backends.items()) if b.device_type == device_type]

    def _load_if_needed(self, backend: object) -> None:
        assert isinstance(backend, _Backend)
        if backend.status is Status.NOT_LOADED:
            self._load(backend)

    def _choose(self, device_type: str, what: str) -> selection.Choice:
        """Apply the selection rule to ``device_type``, loading only what it needs (locked).

        Each new choice is logged once at INFO, with the rule that made it.
        """
        self._ensure_scanned()
        with self._lock:
            choice = selection.select(
                device_type,
                self._backends_for(device_type),
                _env.preferred_backends(),
                what=what,
                load=self._load_if_needed,
                installed=sorted(self._backends),
            )
            chosen = choice.backend
            assert isinstance(chosen, _Backend)
            if self._announced.get(device_type) != chosen.name:
                self._announced[device_type] = chosen.name
                where = f"{chosen.distribution} {chosen.version}" if chosen.distribution else "manual"
                logger.info(
                    "lmcache-platform: device type %r uses backend %r (%s): %s",
                    device_type,
                    chosen.name,
                    where,
                    choice.why,
                )
            return choice

    def _select(self, device_type: str, what: str) -> _Backend:
        chosen = self._choose(device_type, what).backend
        assert isinstance(chosen, _Backend)
        return chosen

    def _fill(self, device_type: str, what: str) -> None:
        chosen = self._select(device_type, what)
        with self._lock:
            for table, value in (
                (self.contexts, chosen.context_class),
                (self.wrappers, chosen.wrapper_class.wrap if chosen.wrapper_class else None),
            ):
                if value is not None and device_type not in table.entries and not table.frozen:
                    table.entries[device_type] = value
                    table.auto.add(device_type)

    def _lookup(self, table: _Table, device_type: str, what: str) -> Any:
        try:
            return table.entries[device_type]
        except KeyError:
            pass
        if not table.frozen:
            self._fill(device_type, what)
            if device_type in table.entries:
                return table.entries[device_type]
        known = ", ".join(sorted(table.entries)) or "none"
        raise BackendNotFoundError(
            f"No {what} registered for device type {device_type!r} (registered: {known})",
            device_type=device_type,
        )

    def cache_context_class(self, device_type: str) -> type[BaseCacheContext]:
        return self._lookup(self.contexts, device_type, _WHAT_CONTEXT)  # type: ignore[no-any-return]

    def wrapper_factory(self, device_type: str) -> WrapperFactory:
        return self._lookup(self.wrappers, device_type, _WHAT_WRAPPER)  # type: ignore[no-any-return]

    def wire_classes_for(self, device_type: str) -> dict[str, type[DeviceIPCWrapper]]:
        """wire tag -> wrapper class, for the decoder's allow-list of this device type."""
        classes: list[type[DeviceIPCWrapper]] = []
        factory = self.wrappers.entries.get(device_type)
        owner = getattr(factory, "__self__", factory)
        if isinstance(owner, type) and issubclass(owner, DeviceIPCWrapper):
            classes.append(owner)
        if not self.wrappers.frozen:
            try:
                classes.extend(self._select(device_type, _WHAT_WRAPPER).wire_classes)
            except BackendSelectionError:
                if not classes:
                    raise
        if not classes:
            raise BackendNotFoundError(
                f"No {_WHAT_WRAPPER} registered for device type {device_type!r}",
                device_type=device_type,
            )
        return {cls.wire_tag: cls for cls in classes}

    def device_event_class(self, device_type: str) -> type[DeviceEvent] | None:
        """The event class of the backend serving ``device_type`` (None: it has none).

        A cache-context class installed by hand (:func:`restore_backends`) has no
        backend behind it, so no events either.
        """
        table = self.contexts
        if table.frozen or (device_type in table.entries and device_type not in table.auto):
            return None
        return self._select(device_type, "device event class").event_class

    def selected_backend(self, device_type: str) -> BackendInfo:
        """The backend serving ``device_type`` here (see :func:`selected_backend`)."""
        choice = self._choose(device_type, "backend")
        assert isinstance(choice.backend, _Backend)
        return self._info(choice.backend, choice)

    def survey(
        self, *, load: bool = True
    ) -> tuple[list[BackendInfo], dict[str, BackendSelectionError | None]]:
        """Every backend, the selected ones marked, and each device type's selection error or None.

        ``load=False`` reads metadata only: nothing is imported or selected.
        """
        infos = self.backends(load=load)
        if not load:
            return infos, {}
        chosen: dict[str, BackendInfo] = {}
        errors: dict[str, BackendSelectionError | None] = {}
        for device_type in sorted({i.device_type for i in infos}):
            try:
                info = self.selected_backend(device_type)
            except BackendSelectionError as exc:
                errors[device_type] = exc
            else:
                chosen[info.name], errors[device_type] = info, None
        return [chosen.get(i.name, i) for i in infos], errors

    # -- manual registration ------------------------------------------------------------

    def register_backend(
        self, plugin: object, name: str, *, distribution: str | None = None, version: str | None = None
    ) -> None:
        """Register a plugin object under a backend name, in this process only.

        Validated at once: a failing backend raises its :class:`BackendLoadError` and is
        not registered at all.
        """
        if not discovery.BACKEND_NAME_RE.match(name):
            raise ValueError(f"invalid backend name {name!r}")
        backend = _Backend(
            name=name,
            distribution=distribution,
            version=version,
            entry_point=None,
            load=lambda: plugin,
            manual=True,
        )
        with self._lock:
            if name in self._backends:
                raise ValueError(f"a backend named {name!r} is already registered")
            self._load(backend)
            if backend.status is Status.FAILED:
                assert backend.error is not None
                raise backend.error
            self._backends[name] = backend
            self._forget(backend.device_type)

    def install(self, name: str, plugin: object, *, distribution: str, version: str) -> None:
        """Add a backend exactly as if an installed entry point advertised it (test kit)."""
        spec = discovery.BackendSpec(
            name=name,
            distribution=distribution,
            version=version,
            entry_point=f"{name} = <installed by test>",
            load=lambda: plugin,
            problem=None if discovery.BACKEND_NAME_RE.match(name) else f"invalid name {name!r}",
        )
        with self._lock:
            self._ensure_scanned()
            self._add(
                _Backend(
                    name=spec.name,
                    distribution=distribution,
                    version=version,
                    entry_point=spec.entry_point,
                    load=spec.load,
                    problem=spec.problem,
                )
            )
            self._forget(spec.device_type)

    def unregister_backend(self, name: str) -> None:
        with self._lock:
            backend = self._backends.pop(name)
            self._unregister(backend)
            self._forget(backend.device_type)

    def _forget(self, device_type: str) -> None:
        self.contexts.forget(device_type)
        self.wrappers.forget(device_type)
        self._announced.pop(device_type, None)

    def register_kv_wrapper(self, device_type: str, factory: WrapperFactory) -> None:
        """Upstream shortcut: use ``factory`` for ``device_type``, over any backend."""
        with self._lock:
            self.wrappers.entries[device_type] = factory
            self.wrappers.auto.discard(device_type)

    # -- reporting ----------------------------------------------------------------------

    def _info(self, b: _Backend, choice: selection.Choice | None = None) -> BackendInfo:
        return BackendInfo(
            name=b.name,
            device_type=b.device_type,
            distribution=b.distribution,
            version=b.version,
            entry_point=b.entry_point,
            status=b.status,
            reason=b.reason,
            traceback=b.error.traceback if b.error else None,
            manual=b.manual,
            selected_by=choice.rule.value if choice else None,
            why_selected=choice.why if choice else "",
        )

    def backends(self, *, load: bool = False) -> list[BackendInfo]:
        """Every known backend, sorted; ``load=True`` loads them all first."""
        self._ensure_scanned()
        with self._lock:
            if load:
                for backend in self._backends.values():
                    if backend.status is Status.NOT_LOADED:
                        self._load(backend)
            return [self._info(b) for _, b in sorted(self._backends.items())]

    def device_types(self) -> list[str]:
        self._ensure_scanned()
        return sorted({b.device_type for b in self._backends.values()})

    def plugins(self) -> Iterable[tuple[str, object]]:
        """(name, plugin) of every loaded backend."""
        return [(n, p) for n, p in self._pm.list_name_plugin() if n is not None]

    def call(self, name: str, hook: str, **kwargs: Any) -> Any:
        """Call loaded backend ``name``'s implementation of ``hook``; ``None`` if it has none."""
        with self._lock:
            backend = self._backends[name]
        return self._call(backend, hook, **kwargs)

    def call_all(self, hook: str, **kwargs: Any) -> list[tuple[str, Any, BaseException | None]]:
        """Call ``hook`` on every loaded backend; one backend raising does not stop the rest."""
        results: list[tuple[str, Any, BaseException | None]] = []
        for name, _plugin in self.plugins():
            backend = self._backends.get(name)
            if backend is None:
                continue
            try:
                results.append((name, self._call(backend, hook, **kwargs), None))
            except (Exception, SystemExit) as exc:
                logger.warning("lmcache-platform: backend %r failed in %s: %s", name, hook, exc)
                results.append((name, None, exc))
        return results

    # -- test support -------------------------------------------------------------------

    def snapshot_all(self) -> dict[str, Any]:
        with self._lock:
            return {
                "backends": dict(self._backends),
                "scanned": self._scanned,
                "contexts": (self.contexts.snapshot(), set(self.contexts.auto)),
                "wrappers": (self.wrappers.snapshot(), set(self.wrappers.auto)),
                "plugins": list(self.plugins()),
                "search_path": self.search_path,
            }

    def restore_all(self, state: dict[str, Any]) -> None:
        with self._lock:
            for name, _ in list(self.plugins()):
                self._pm.unregister(name=name)
            for name, plugin in state["plugins"]:
                self._pm.register(plugin, name=name)
            self._backends = dict(state["backends"])
            self._scanned = state["scanned"]
            self.search_path = state["search_path"]
            for table, (snap, auto) in (
                (self.contexts, state["contexts"]),
                (self.wrappers, state["wrappers"]),
            ):
                table.restore(snap)
                table.auto.update(auto)

    def clear(self, *, scanned: bool) -> None:
        """Empty state; ``scanned=True`` means "metadata already read, found nothing"."""
        with self._lock:
            for name, _ in list(self.plugins()):
                self._pm.unregister(name=name)
            self._backends = {}
            self._scanned = scanned
            self._announced = {}
            self.contexts.restore(TableState({}, False))
            self.wrappers.restore(TableState({}, False))


def _check_class(backend: _Backend, kind: str, cls: object, base: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(
            f"backend {backend.name!r} returned {cls!r} as its {kind} class; "
            f"expected a subclass of {base.__name__}"
        )
    declared = getattr(cls, "device_type", "")
    if declared != backend.device_type:
        raise TypeError(
            f"backend {backend.name!r}: {cls.__qualname__}.device_type is {declared!r}, but the "
            f"entry-point name says {backend.device_type!r}"
        )
    if base is DeviceIPCWrapper and not getattr(cls, "wire_tag", ""):
        raise TypeError(f"backend {backend.name!r}: {cls.__qualname__} declares no wire_tag")


#: The live registry of this process.
REGISTRY = Registry()
wire_classes_for = REGISTRY.wire_classes_for


def selected_backend(device_type: str) -> BackendInfo:
    """Which backend serves ``device_type`` in this process, resolving it if needed.

    The answer carries the backend's distribution, version and status; ``selected_by``
    says which selection rule chose it and ``why_selected`` says why, in one line. Raises
    the :class:`BackendSelectionError` that a lookup of the device type would raise
    (:class:`BackendNotFoundError`, :class:`AmbiguousBackendError`,
    :class:`BackendUnavailableError`).
    """
    return REGISTRY.selected_backend(device_type)


def list_backends(*, load: bool = True) -> list[BackendInfo]:
    """Every installed or registered backend, sorted by name: what ``lmcache-platform list`` shows.

    With ``load`` (the default) every backend is imported and validated and every device
    type is resolved, so ``status``, ``reason`` and ``selected_by`` are final; a device
    type whose selection fails has no selected backend, and :func:`selected_backend`
    raises its error. ``load=False`` reads installed metadata only and imports nothing:
    every status is ``not loaded`` and nothing is selected.
    """
    return REGISTRY.survey(load=load)[0]

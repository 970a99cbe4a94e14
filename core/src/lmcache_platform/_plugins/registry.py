"""Device backends over the plugin engine: their checks, the cached per-device tables.

The ``lmcache.platform`` group is one :class:`~.engine.Group` (:data:`BACKENDS`): entry-point
names are ``<device_type>`` or ``<device_type>.<variant>``, the key is the device type,
and :func:`_check` asks a backend for its classes and probe and checks every answer.
The :class:`~.engine.Engine` loads, isolates and reports backends; this module adds what
is particular to device types: the first lookup of one lets :mod:`.selection` choose
among its backends (loading only what the rule needs) and caches the chosen classes in
two plain dicts. Later lookups are a dict hit: no lock, no pluggy call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _env, hookspecs
from .._errors import ApiVersionError, BackendLoadError, BackendNotFoundError, BackendSelectionError
from .._events import DeviceEvent
from .._ipc_wrapper import DeviceIPCWrapper
from .._kv.context import BaseCacheContext
from .._types import Availability
from .._version import API_VERSION
from . import discovery, selection
from .engine import ApiCheck, Call, Declined, Engine, Group, Record, Status

if TYPE_CHECKING:
    import torch

    WrapperFactory = Callable[[torch.Tensor], DeviceIPCWrapper]
else:
    WrapperFactory = Callable[[Any], DeviceIPCWrapper]

#: A public name (operators configure it): the backend chosen per device type, and why.
logger = logging.getLogger("lmcache_platform.plugins")

_WHAT_CONTEXT = "cache-context class"
_WHAT_WRAPPER = "KV-cache wrapper factory"


@dataclass(frozen=True)
class BackendClasses:
    """What a sound backend answered for its device type (the engine keeps it as ``answers``)."""

    context: type[BaseCacheContext]
    wrapper: type[DeviceIPCWrapper]
    wire: tuple[type[DeviceIPCWrapper], ...]
    event: type[DeviceEvent] | None


def _check(backend: Record[BackendClasses], call: Call) -> BackendClasses:
    """Ask a registered backend for its classes and probe; check each answer."""
    dt = backend.key
    ctx = call("lmcache_platform_cache_context_class", device_type=dt)
    wrapper = call("lmcache_platform_ipc_wrapper_class", device_type=dt)
    wire = call("lmcache_platform_wire_classes", device_type=dt)
    probe = call("lmcache_platform_probe", device_type=dt)
    event = call("lmcache_platform_device_event_class", device_type=dt)
    if ctx is None and wrapper is None:
        raise Declined(f"provides no classes for device type {dt!r}")
    _check_class(backend, "cache-context", ctx, BaseCacheContext)
    _check_class(backend, "IPC-wrapper", wrapper, DeviceIPCWrapper)
    wire_classes = (wrapper,) if wire is None else tuple(wire)
    for cls in wire_classes:
        _check_class(backend, "wire", cls, DeviceIPCWrapper)
    if probe is not None and not isinstance(probe, Availability):
        raise TypeError(f"lmcache_platform_probe returned {probe!r}, not an Availability")
    if event is not None:
        _check_class(backend, "device-event", event, DeviceEvent)
    if probe is not None and not probe.ok:
        raise Declined(probe.reason)
    return BackendClasses(ctx, wrapper, wire_classes, event)


def _check_class(backend: Record[BackendClasses], kind: str, cls: object, base: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(
            f"backend {backend.name!r} returned {cls!r} as its {kind} class; "
            f"expected a subclass of {base.__name__}"
        )
    declared = getattr(cls, "device_type", "")
    if declared != backend.key:
        raise TypeError(
            f"backend {backend.name!r}: {cls.__qualname__}.device_type is {declared!r}, but the "
            f"entry-point name says {backend.key!r}"
        )
    if base is DeviceIPCWrapper and not getattr(cls, "wire_tag", ""):
        raise TypeError(f"backend {backend.name!r}: {cls.__qualname__} declares no wire_tag")


def _disabled(name: str) -> str:
    return f"disabled by {_env.DISABLE_ENV}" if name in _env.disabled_backends() else ""


#: The device-backend group: the whole of what makes ``lmcache.platform`` differ from other groups.
BACKENDS: Group[BackendClasses] = Group(
    entry_points=discovery.ENTRY_POINT_GROUP,
    kind="backend",
    hookspecs=hookspecs,
    hook_prefix="lmcache_platform_",
    names=discovery.BACKEND_NAME_RE,
    name_rule=discovery.BACKEND_NAME_RULE,
    api=ApiCheck("lmcache_platform_api_version", API_VERSION, "backend API", ApiVersionError),
    error=BackendLoadError,
    logger=logger,
    key_of=discovery.device_type_of,
    check=_check,
    disabled=_disabled,
    autoload=_env.autoload_enabled,
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
        self.engine: Engine[BackendClasses] = Engine(BACKENDS)
        self._lock = self.engine.lock
        #: device type -> backend name last logged as its choice (log each choice once).
        self._announced: dict[str, str] = {}
        self.contexts = _Table()
        self.wrappers = _Table()

    @property
    def search_path(self) -> list[str] | None:
        """Directories to read metadata from; ``None`` means ``sys.path`` (tests narrow it)."""
        return self.engine.search_path

    @search_path.setter
    def search_path(self, path: list[str] | None) -> None:
        self.engine.search_path = path

    def refresh(self) -> None:
        """Forget everything read from metadata and every cached choice; re-scan on next use.

        Manually registered backends stay. Modules already imported stay imported.
        """
        with self._lock:
            self.engine.refresh()
            for table in (self.contexts, self.wrappers):
                for device_type in list(table.auto):
                    table.forget(device_type)
            self._announced.clear()

    # -- selection ----------------------------------------------------------------------

    def _load(self, backend: object) -> None:
        assert isinstance(backend, Record)
        self.engine.load(backend)

    def _choose(self, device_type: str, what: str) -> selection.Choice:
        """Apply the selection rule to ``device_type``, loading only what it needs (locked).

        Each new choice is logged once at INFO, with the rule that made it.
        """
        with self._lock:
            choice = selection.select(
                device_type,
                self.engine.for_key(device_type),
                _env.preferred_backends(),
                what=what,
                load=self._load,
                installed=self.engine.names(),
            )
            chosen = choice.backend
            assert isinstance(chosen, Record)
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

    def _select(self, device_type: str, what: str) -> BackendClasses:
        """The classes of the backend chosen for ``device_type``."""
        chosen = self._choose(device_type, what).backend
        assert isinstance(chosen, Record) and isinstance(chosen.answers, BackendClasses)
        return chosen.answers

    def _fill(self, device_type: str, what: str) -> None:
        chosen = self._select(device_type, what)
        with self._lock:
            for table, value in ((self.contexts, chosen.context), (self.wrappers, chosen.wrapper.wrap)):
                if device_type not in table.entries and not table.frozen:
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
                classes.extend(self._select(device_type, _WHAT_WRAPPER).wire)
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
        return self._select(device_type, "device event class").event

    def selected_backend(self, device_type: str) -> BackendInfo:
        """The backend serving ``device_type`` here (see :func:`selected_backend`)."""
        choice = self._choose(device_type, "backend")
        assert isinstance(choice.backend, Record)
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

    # -- registration -------------------------------------------------------------------

    def register_backend(
        self, plugin: object, name: str, *, distribution: str | None = None, version: str | None = None
    ) -> None:
        """Register a plugin object under a backend name, in this process only.

        Validated at once: a failing backend raises its :class:`BackendLoadError` and is
        not registered at all.
        """
        with self._lock:
            self._forget(self.engine.register(plugin, name, distribution=distribution, version=version).key)

    def install(self, name: str, plugin: object, *, distribution: str, version: str) -> None:
        """Add a backend exactly as if an installed entry point advertised it (test kit)."""
        with self._lock:
            self._forget(self.engine.install(name, plugin, distribution=distribution, version=version).key)

    def unregister_backend(self, name: str) -> None:
        with self._lock:
            self._forget(self.engine.unregister(name).key)

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

    def _info(self, b: Record[BackendClasses], choice: selection.Choice | None = None) -> BackendInfo:
        return BackendInfo(
            name=b.name,
            device_type=b.key,
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
        return [self._info(b) for b in self.engine.records(load=load)]

    def device_types(self) -> list[str]:
        return self.engine.keys()

    def plugins(self) -> Iterable[tuple[str, object]]:
        """(name, plugin) of every loaded backend."""
        return self.engine.registered()

    def call(self, name: str, hook: str, **kwargs: Any) -> Any:
        """Call loaded backend ``name``'s implementation of ``hook``; ``None`` if it has none."""
        backend = self.engine.get(name)
        if backend is None:
            raise KeyError(name)
        return self.engine.call(backend, hook, **kwargs)

    def call_all(self, hook: str, **kwargs: Any) -> list[tuple[str, Any, BaseException | None]]:
        """Call ``hook`` on every loaded backend; one backend raising does not stop the rest."""
        return self.engine.call_each(hook, **kwargs)

    # -- test support -------------------------------------------------------------------

    def snapshot_all(self) -> dict[str, Any]:
        with self._lock:
            return {
                "engine": self.engine.snapshot(),
                "contexts": (self.contexts.snapshot(), set(self.contexts.auto)),
                "wrappers": (self.wrappers.snapshot(), set(self.wrappers.auto)),
            }

    def restore_all(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.engine.restore(state["engine"])
            for table, (snap, auto) in (
                (self.contexts, state["contexts"]),
                (self.wrappers, state["wrappers"]),
            ):
                table.restore(snap)
                table.auto.update(auto)

    def clear(self, *, scanned: bool) -> None:
        """Empty state; ``scanned=True`` means "metadata already read, found nothing"."""
        with self._lock:
            self.engine.clear(scanned=scanned)
            self._announced = {}
            self.contexts.restore(TableState({}, False))
            self.wrappers.restore(TableState({}, False))


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

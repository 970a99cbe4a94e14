"""The plugin engine: one mechanism for every entry-point group core loads plugins from.

A :class:`Group` says what differs between groups: the entry-point group, the hook-spec
module, the rule for entry-point names and the key a name serves (a device type for
``lmcache.platform``, a URL scheme for ``lmcache.remote``), the API-version hook, the
hooks a plugin must implement and the check of its answers. An :class:`Engine` does the
rest, the same way for every group:

* :mod:`.discovery` reads the group's entry points once, importing nothing;
* :meth:`Engine.load` imports one plugin when its key is first asked for (never the
  plugins of other keys), refuses hooks the specs do not define, registers it with the
  group's pluggy ``PluginManager`` (which checks hook and argument names), then checks
  its API major, its required hooks and its answers;
* a plugin that fails any step (fails to import, raises or calls ``sys.exit()`` from a
  hook, answers wrongly) is recorded as failed with its traceback, unregistered again,
  logged once at WARNING and reported only for its own key; the others keep working;
* :meth:`Engine.snapshot` and :meth:`Engine.restore` give tests a hermetic state.

**Why core calls one implementation at a time** rather than ``pm.hook.<name>(...)``:
each plugin answers for its own key only (a backend for its device type, a store for its
URL scheme), and core must know which plugin gave an answer, to check it and to isolate
and name the plugin that gave a wrong one. A fan-out call runs every registered plugin,
returns their answers without their authors (or only the first one) and stops at the
first exception. So pluggy validates plugins when they register, and :meth:`Engine.call`
calls the one implementation of the one plugin asked. Nothing here is on a data path:
the groups cache what the plugins answered.
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
import re
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, TypeVar

import pluggy

from .._errors import BackendLoadError
from . import discovery

#: What a group's check keeps of a plugin's answers (classes for a backend, nothing for a store).
Answers = TypeVar("Answers")
#: ``call(hook, **kwargs)``: one plugin's own implementation of ``hook`` (see :meth:`Engine.call`).
Call = Callable[..., Any]


class Status(str, enum.Enum):
    """Where a backend (or a remote store) stands in this process."""

    #: Not imported yet (a backend loads on first use of its device type, a store on first
    #: use of its scheme, or with ``load=True``).
    NOT_LOADED = "not loaded"
    #: Loaded and validated; it can serve here.
    OK = "ok"
    #: Importing, registering or checking it failed; ``reason`` and ``traceback`` say why.
    FAILED = "failed"
    #: Switched off by the operator (``LMCACHE_PLATFORM_DISABLE``), so never loaded.
    DISABLED = "disabled"
    #: Loaded, but it cannot serve here (its probe said no, or it gives no classes).
    UNAVAILABLE = "unavailable"


class Declined(Exception):
    """Raised by a group's check: the plugin is sound but cannot serve here, for this reason."""


@dataclass(frozen=True)
class ApiCheck:
    """The hook through which a plugin says which API major it was written against."""

    hook: str
    #: The major this core speaks.
    version: int
    #: How messages name the API (``"backend API"``).
    label: str
    #: What a mismatch raises (a subclass of the group's error).
    error: type[BackendLoadError]


def _same(name: str) -> str:
    return name


def _enabled(name: str) -> str:
    return ""


def _autoload() -> bool:
    return True


@dataclass(frozen=True)
class Group(Generic[Answers]):
    """One entry-point group: how its plugins are named, found, checked and reported."""

    #: The entry-point group (``lmcache.platform``).
    entry_points: str
    #: What messages call one plugin (``"backend"``, ``"remote store"``).
    kind: str
    #: The hook-spec module; pluggy checks registrations against it.
    hookspecs: ModuleType
    #: Every hook name of the group starts with it: a plugin attribute that does and is
    #: not a spec is an unknown hook (a typo, or a newer API).
    hook_prefix: str
    #: The entry-point name rule, and the same in words for the problem of a bad name.
    names: re.Pattern[str]
    name_rule: str
    api: ApiCheck
    #: The load error of the group (its failures are reported as this type).
    error: type[BackendLoadError]
    logger: logging.Logger
    #: Entry-point name -> the key it serves (``"cuda.rocm"`` -> ``"cuda"``).
    key_of: Callable[[str], str] = _same
    #: Hooks a plugin must implement (besides the API hook).
    required: tuple[str, ...] = ()
    #: Asks a registered plugin its answers and checks them: returns what to keep, raises
    #: :class:`Declined` when the plugin cannot serve here, anything else to fail it.
    check: Callable[[Record[Answers], Call], Answers] | None = None
    #: Entry-point name -> why it is switched off ("" when it is not). Manual ones never are.
    disabled: Callable[[str], str] = _enabled
    #: Whether to read entry points at all (else only manual registrations count).
    autoload: Callable[[], bool] = _autoload


@dataclass(eq=False)
class Record(Generic[Answers]):
    """Mutable record of one plugin (from an entry point or registered by hand)."""

    group: Group[Answers]
    name: str
    distribution: str | None
    version: str | None
    entry_point: str | None
    load: Callable[[], object]
    manual: bool = False
    #: Set when the metadata itself is wrong (bad name, name clash).
    problem: str | None = None
    status: Status = Status.NOT_LOADED
    reason: str = ""
    error: BackendLoadError | None = None
    #: The registered plugin object, while it is registered.
    plugin: object | None = None
    #: What the group's check kept (``None`` unless the plugin is ``ok``).
    answers: Answers | None = None

    @property
    def key(self) -> str:
        return self.group.key_of(self.name)

    @property
    def usable(self) -> bool:
        return self.status is Status.OK

    @property
    def source(self) -> str:
        """``"acme-xpu 1.0"``, or ``"a manual registration"``."""
        return " ".join(p for p in (self.distribution, self.version) if p) or "a manual registration"

    @property
    def origin(self) -> str:
        """``"acme-xpu 1.0, entry point 'xpu = acme_xpu'"``, or ``"manual"``."""
        if not self.distribution:
            return "manual"
        return f"{self.distribution} {self.version}, entry point {self.entry_point!r}"

    def error_of(self, message: str, kind: type[BackendLoadError] | None = None) -> BackendLoadError:
        """A load error (the group's, or ``kind``) naming this plugin, its distribution and entry point."""
        return (kind or self.group.error)(
            message,
            backend=self.name,
            distribution=self.distribution,
            version=self.version,
            entry_point=self.entry_point,
        )


@dataclass(frozen=True)
class EngineState:
    """A snapshot of an engine (:meth:`Engine.snapshot`), for :meth:`Engine.restore`."""

    records: Mapping[str, Record[Any]]
    scanned: bool
    search_path: list[str] | None


def plugin_manager(hookspecs: ModuleType) -> pluggy.PluginManager:
    """A pluggy plugin manager that knows the specs of ``hookspecs`` (its ``PROJECT_NAME``).

    The one place core makes one: each engine holds one, and the conformance suite and the
    benchmarks use this function for theirs.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


class Engine(Generic[Answers]):
    """The plugins of one :class:`Group` in this process: records, loading, isolation, calls."""

    def __init__(self, group: Group[Answers], *, search_path: list[str] | None = None) -> None:
        self.group = group
        #: Held while records change; groups hold it for their own caches too.
        self.lock = threading.RLock()
        self._pm = plugin_manager(group.hookspecs)
        self._specs = frozenset(n for n in dir(group.hookspecs) if n.startswith(group.hook_prefix))
        self._records: dict[str, Record[Answers]] = {}
        self._scanned = False
        #: Directories to read metadata from; ``None`` means ``sys.path`` (tests narrow it).
        self.search_path = search_path

    # -- records ------------------------------------------------------------------------

    def _ensure_scanned(self) -> None:
        """Read metadata once; the lock makes racing first callers scan exactly once."""
        with self.lock:
            if self._scanned:
                return
            g = self.group
            if g.autoload():
                for spec in discovery.scan(g.entry_points, self.search_path, names=g.names, rule=g.name_rule):
                    self._add(self._from_spec(spec))
            self._scanned = True

    def _from_spec(self, spec: discovery.BackendSpec) -> Record[Answers]:
        return Record(
            self.group,
            spec.name,
            spec.distribution,
            spec.version,
            spec.entry_point,
            spec.load,
            problem=spec.problem,
        )

    def _sorted(self) -> list[Record[Answers]]:
        return [r for _, r in sorted(self._records.items())]

    def _add(self, record: Record[Answers]) -> None:
        old = self._records.get(record.name)
        if old is not None:
            self._release(old)
        why = "" if record.manual else self.group.disabled(record.name)
        if why:
            record.status, record.reason = Status.DISABLED, why
        self._records[record.name] = record

    def names(self) -> list[str]:
        self._ensure_scanned()
        return sorted(self._records)

    def keys(self) -> list[str]:
        self._ensure_scanned()
        return sorted({r.key for r in self._records.values()})

    def get(self, name: str) -> Record[Answers] | None:
        self._ensure_scanned()
        return self._records.get(name)

    def for_key(self, key: str) -> list[Record[Answers]]:
        """The plugins serving ``key``, by name; none of them is loaded here."""
        self._ensure_scanned()
        with self.lock:
            return [r for r in self._sorted() if r.key == key]

    def records(self, *, load: bool = False) -> list[Record[Answers]]:
        """Every plugin, by name; ``load=True`` loads each first."""
        self._ensure_scanned()
        with self.lock:
            records = self._sorted()
            if load:
                for record in records:
                    self.load(record)
            return records

    def registered(self) -> list[tuple[str, object]]:
        """(name, plugin) of every plugin registered with pluggy (loaded, not failed)."""
        with self.lock:
            return [(r.name, r.plugin) for r in self._sorted() if self._registered_as(r) is not None]

    def install(self, name: str, plugin: object, *, distribution: str, version: str) -> Record[Answers]:
        """Add ``plugin`` exactly as if an installed entry point advertised it (test kit)."""
        g = self.group
        problem = discovery.name_problem(name, g.names, g.name_rule)
        entry_point = f"{name} = <installed by test>"
        record = Record(g, name, distribution, version, entry_point, lambda: plugin, problem=problem)
        with self.lock:
            self._ensure_scanned()
            self._add(record)
        return record

    def register(
        self, plugin: object, name: str, *, distribution: str | None = None, version: str | None = None
    ) -> Record[Answers]:
        """Register ``plugin`` as ``name`` by hand, loaded at once: one that fails raises its load error."""
        kind = self.group.kind
        if not self.group.names.match(name):
            raise ValueError(f"invalid {kind} name {name!r}")
        record = Record(self.group, name, distribution, version, None, lambda: plugin, manual=True)
        with self.lock:
            self._ensure_scanned()
            if name in self._records:
                raise ValueError(f"a {kind} named {name!r} is already registered")
            self.load(record)
            if record.status is Status.FAILED:
                assert record.error is not None
                raise record.error
            self._records[name] = record
        return record

    def unregister(self, name: str) -> Record[Answers]:
        """Forget plugin ``name`` (``KeyError`` if there is none); returns its record."""
        with self.lock:
            record = self._records.pop(name)
            self._release(record)
            return record

    def refresh(self) -> None:
        """Forget what metadata said and re-read it on next use; manual plugins load again.

        Modules already imported stay imported.
        """
        with self.lock:
            for name, record in list(self._records.items()):
                self._release(record)
                if record.manual:
                    record.status, record.reason, record.error = Status.NOT_LOADED, "", None
                    record.plugin = record.answers = None
                else:
                    del self._records[name]
            self._scanned = False

    # -- loading ------------------------------------------------------------------------

    def load(self, record: Record[Answers]) -> None:
        """Import, register and check ``record``'s plugin, once; a failure is isolated.

        A failing plugin is recorded (``FAILED``, its error with the traceback, a one-line
        reason), unregistered again and logged once at WARNING; nothing is raised.
        """
        with self.lock:
            if record.status is not Status.NOT_LOADED:
                return
            try:
                if record.problem:
                    raise record.error_of(record.problem)
                self._register(record, record.load())
                answers = self._check(record)
            except Declined as declined:
                record.status, record.reason = Status.UNAVAILABLE, str(declined)
            except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() must not exit the host
                self._fail(record, exc)
            else:
                record.answers, record.status, record.reason = answers, Status.OK, ""

    def _register(self, record: Record[Answers], plugin: object) -> None:
        g = self.group
        unknown = sorted(n for n in dir(plugin) if n.startswith(g.hook_prefix) and n not in self._specs)
        if unknown:
            raise record.error_of(
                f"{g.kind} {record.name!r} implements unknown hooks: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(self._specs))})"
            )
        # One module may serve several names (valkey, valkeys): pluggy registers an object once.
        if self._pm.get_name(plugin) is None:
            self._pm.register(plugin, name=record.name)  # pluggy checks argument names here
        record.plugin = plugin

    def _check(self, record: Record[Answers]) -> Answers | None:
        g, api = self.group, self.group.api
        answer = self.call(record, api.hook)
        if answer != api.version:
            raise record.error_of(
                f"{g.kind} {record.name!r} from {record.source} targets {api.label} {answer!r}, "
                f"but this lmcache-platform speaks API {api.version}"
                + ("" if answer is not None else f" (it must implement {api.hook})"),
                api.error,
            )
        for hook in g.required:
            if self._impl(record, hook) is None:
                raise record.error_of(f"{g.kind} {record.name!r} does not implement {hook}")
        return None if g.check is None else g.check(record, functools.partial(self.call, record))

    def _fail(self, record: Record[Answers], exc: BaseException) -> None:
        """Record ``exc`` (being handled) as ``record``'s failure, roll it back and log it once."""
        self._release(record)
        record.plugin = record.answers = None
        record.status = Status.FAILED
        tb = traceback.format_exc()
        error = (
            exc
            if isinstance(exc, self.group.error)
            else record.error_of(
                f"{self.group.kind} {record.name!r} ({record.origin}) failed to load: "
                f"{type(exc).__name__}: {exc}"
            )
        )
        error.traceback = tb
        if error is not exc:
            error.__cause__ = exc
        record.error = error
        # One line for listings; pluggy's validation errors span several, all useful.
        record.reason = one_line(error) or type(exc).__name__
        self.group.logger.warning("lmcache-platform: %s\n%s", record.reason, tb)

    def _release(self, record: Record[Answers]) -> None:
        """Unregister ``record``'s plugin from pluggy, unless another record holds the same object."""
        name = self._registered_as(record)
        if name is not None and not any(
            self._registered_as(r) == name for r in self._records.values() if r is not record
        ):
            self._pm.unregister(name=name)

    def _registered_as(self, record: Record[Answers]) -> str | None:
        """The name pluggy holds ``record``'s plugin under (another record's, for a shared module)."""
        return None if record.plugin is None else self._pm.get_name(record.plugin)

    # -- calls --------------------------------------------------------------------------

    def _impl(self, record: Record[Answers], hook: str) -> pluggy.HookImpl | None:
        name = self._registered_as(record)
        caller: pluggy.HookCaller = getattr(self._pm.hook, hook)
        return next((impl for impl in caller.get_hookimpls() if impl.plugin_name == name), None)

    def call(self, record: Record[Answers], hook: str, **kwargs: Any) -> Any:
        """``record``'s own implementation of ``hook``, given the arguments it takes; ``None`` if none."""
        impl = self._impl(record, hook)
        return None if impl is None else impl.function(*(kwargs[arg] for arg in impl.argnames))

    def call_each(self, hook: str, **kwargs: Any) -> list[tuple[str, Any, BaseException | None]]:
        """Call ``hook`` on every registered plugin; one raising is logged and does not stop the rest."""
        results: list[tuple[str, Any, BaseException | None]] = []
        for name, _ in self.registered():
            record = self._records[name]
            try:
                results.append((name, self.call(record, hook, **kwargs), None))
            except (Exception, SystemExit) as exc:
                self.group.logger.warning(
                    "lmcache-platform: %s %r failed in %s: %s", self.group.kind, name, hook, exc
                )
                results.append((name, None, exc))
        return results

    # -- test support -------------------------------------------------------------------

    def snapshot(self) -> EngineState:
        """Every record as it stands now (copies: loading one later does not change the snapshot)."""
        with self.lock:
            return EngineState(_copies(self._records), self._scanned, self.search_path)

    def restore(self, state: EngineState) -> None:
        """Go back to ``state``: its records, and exactly their plugins registered."""
        with self.lock:
            self._unregister_all()
            self._records = _copies(state.records)
            self._scanned = state.scanned
            self.search_path = state.search_path
            for name, record in sorted(self._records.items()):
                if record.plugin is not None and self._registered_as(record) is None:
                    self._pm.register(record.plugin, name=name)

    def clear(self, *, scanned: bool) -> None:
        """Forget every plugin; ``scanned=True`` means "metadata already read, found nothing"."""
        with self.lock:
            self._unregister_all()
            self._records = {}
            self._scanned = scanned

    def _unregister_all(self) -> None:
        for name, _ in self._pm.list_name_plugin():
            self._pm.unregister(name=name)


def _copies(records: Mapping[str, Record[Answers]]) -> dict[str, Record[Answers]]:
    return {name: copy.copy(record) for name, record in records.items()}


def one_line(error: BaseException) -> str:
    """An error's message on one line (pluggy's validation errors span several)."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())

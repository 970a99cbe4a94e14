"""Conformance: the backend's hooks, classes and declarations (no device needed)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest

from lmcache_platform import (
    API_VERSION,
    Availability,
    BaseCacheContext,
    DeviceEvent,
    DeviceIPCWrapper,
    Status,
    WireField,
    hookspecs,
    selected_backend,
)
from lmcache_platform._ipc_wrapper import BASE_FIELDS
from lmcache_platform._plugins.engine import plugin_manager
from lmcache_platform.conformance._target import Target
from lmcache_platform.wire import DEVICE_TYPE_RE, WIRE_TAG_RE

SPECS = {name for name in dir(hookspecs) if name.startswith("lmcache_platform_")}
#: A device type no backend serves, to check that hooks decline what they do not serve.
FOREIGN = "conformance_nodevice"


@pytest.fixture(scope="module")
def plugin(lmcache_backend: Target) -> object:
    """The entry point's object, loaded as core loads it."""
    try:
        return lmcache_backend.spec.load()
    except Exception as exc:
        pytest.fail(f"entry point {lmcache_backend.spec.entry_point!r} does not import: {exc!r}")


@pytest.fixture(scope="module")
def hooks(plugin: object, lmcache_backend: Target) -> Any:
    """The plugin registered in a fresh plugin manager: pluggy validates every hookimpl."""
    pm = plugin_manager(hookspecs)
    pm.register(plugin, name=lmcache_backend.name)
    return pm.hook


def test_the_backend_loads(lmcache_backend: Target) -> None:
    """Core imported and validated the entry point (status ok, or unavailable with a reason)."""
    info = lmcache_backend.info
    assert info.status is not Status.FAILED, f"{lmcache_backend.describe()}\n{info.traceback}"
    assert info.status in (Status.OK, Status.UNAVAILABLE), lmcache_backend.describe()
    assert info.distribution, "the backend must come from an installed distribution"
    assert DEVICE_TYPE_RE.fullmatch(lmcache_backend.device_type)


def test_every_hook_function_is_a_marked_implementation_of_a_known_spec(
    plugin: object, lmcache_backend: Target
) -> None:
    named = {n for n in dir(plugin) if n.startswith("lmcache_platform_")}
    unknown = named - SPECS
    assert not unknown, f"not hook specs of lmcache-platform (typo, or a newer API?): {sorted(unknown)}"
    pm = plugin_manager(hookspecs)
    pm.register(plugin, name=lmcache_backend.name)  # raises PluginValidationError on bad arguments
    registered = {caller.name for caller in pm.get_hookcallers(plugin) or ()}
    unmarked = named - registered
    assert not unmarked, f"functions missing the @lmcache_platform.hookimpl marker: {sorted(unmarked)}"


def test_the_required_hooks_are_implemented(plugin: object) -> None:
    for name in (
        "lmcache_platform_api_version",
        "lmcache_platform_cache_context_class",
        "lmcache_platform_ipc_wrapper_class",
    ):
        assert callable(getattr(plugin, name, None)), f"{name} is required"


def test_it_declares_the_backend_api_of_this_core(hooks: Any) -> None:
    declared = hooks.lmcache_platform_api_version()
    assert type(declared) is int, f"lmcache_platform_api_version returned {declared!r}, not an int"
    assert declared == API_VERSION, f"the backend targets API {declared}; this core speaks {API_VERSION}"


def test_it_serves_its_device_type_with_classes_of_the_right_bases(
    hooks: Any, lmcache_backend: Target
) -> None:
    dt = lmcache_backend.device_type
    ctx = hooks.lmcache_platform_cache_context_class(device_type=dt)
    wrapper = hooks.lmcache_platform_ipc_wrapper_class(device_type=dt)
    assert isinstance(ctx, type) and issubclass(ctx, BaseCacheContext), ctx
    assert isinstance(wrapper, type) and issubclass(wrapper, DeviceIPCWrapper), wrapper
    assert ctx.device_type == dt, f"{ctx.__qualname__}.device_type is {ctx.device_type!r}, not {dt!r}"
    assert wrapper.device_type == dt, f"{wrapper.__qualname__}.device_type is {wrapper.device_type!r}"
    assert not inspect.isabstract(ctx) and not inspect.isabstract(wrapper)


def test_it_declines_device_types_it_does_not_serve(hooks: Any) -> None:
    assert hooks.lmcache_platform_cache_context_class(device_type=FOREIGN) is None
    assert hooks.lmcache_platform_ipc_wrapper_class(device_type=FOREIGN) is None
    assert hooks.lmcache_platform_wire_classes(device_type=FOREIGN) is None
    assert hooks.lmcache_platform_device_event_class(device_type=FOREIGN) is None


def test_its_device_events_if_any_are_of_its_device_type(hooks: Any, lmcache_backend: Target) -> None:
    dt = lmcache_backend.device_type
    event = hooks.lmcache_platform_device_event_class(device_type=dt)
    if event is None:
        return  # copies that complete before they return need no events (the host)
    assert isinstance(event, type) and issubclass(event, DeviceEvent), event
    assert event.device_type == dt, f"{event.__qualname__}.device_type is {event.device_type!r}, not {dt!r}"
    assert not inspect.isabstract(event)


def wire_classes(hooks: Any, device_type: str) -> list[type[DeviceIPCWrapper]]:
    wrapper = hooks.lmcache_platform_ipc_wrapper_class(device_type=device_type)
    listed = hooks.lmcache_platform_wire_classes(device_type=device_type)
    return [wrapper] if listed is None else list(listed)


def picks_per_tensor(wrapper: type[DeviceIPCWrapper]) -> bool:
    """Whether ``wrapper`` overrides ``wrapper_class_for`` (it may name other wire classes)."""
    own = getattr(wrapper.wrapper_class_for, "__func__", None)
    return own is not DeviceIPCWrapper.wrapper_class_for.__func__  # type: ignore[attr-defined]


def test_wire_classes_have_stable_unique_tags_and_include_the_wrapper(
    hooks: Any, lmcache_backend: Target
) -> None:
    dt = lmcache_backend.device_type
    classes = wire_classes(hooks, dt)
    wrapper = hooks.lmcache_platform_ipc_wrapper_class(device_type=dt)
    if not picks_per_tensor(wrapper):  # a class that picks is checked by what it picks (test_ipc)
        assert wrapper in classes, "the wrapper class must be one of the wire classes"
    tags = [cls.wire_tag for cls in classes]
    assert len(set(tags)) == len(tags), f"wire tags repeat: {tags}"
    for cls in classes:
        assert isinstance(cls, type) and issubclass(cls, DeviceIPCWrapper), cls
        assert cls.device_type == dt, f"{cls.__qualname__}.device_type is {cls.device_type!r}"
        assert WIRE_TAG_RE.fullmatch(cls.wire_tag), f"{cls.__qualname__}.wire_tag {cls.wire_tag!r}"


def test_every_wire_field_is_a_bounded_primitive(hooks: Any, lmcache_backend: Target) -> None:
    """Untrusted input is bounded before it is used: every field declares its limits."""
    for cls in wire_classes(hooks, lmcache_backend.device_type):
        for name, spec in cls.wire_fields.items():
            where = f"{cls.__qualname__}.wire_fields[{name!r}]"
            assert name not in BASE_FIELDS, f"{where} shadows a base field"
            assert isinstance(spec, WireField), f"{where} is not a WireField"
            assert spec.kind in (int, str, bytes, list), f"{where}: kind {spec.kind!r} is not a primitive"
            if spec.kind in (str, bytes, list):
                assert spec.max_len is not None, f"{where} has no max_len"
            if spec.kind in (int, list):
                assert spec.lo is not None and spec.hi is not None, f"{where} needs lo and hi bounds"


def test_the_probe_answers_with_an_availability(hooks: Any, lmcache_backend: Target) -> None:
    answer = hooks.lmcache_platform_probe(device_type=lmcache_backend.device_type)
    assert answer is None or isinstance(answer, Availability), f"the probe returned {answer!r}"
    if answer is not None and not answer.ok:
        assert answer.reason.strip(), "an unavailable backend must say why"
    again = hooks.lmcache_platform_probe(device_type=lmcache_backend.device_type)
    assert again == answer, "the probe must answer the same twice in a row"


def test_gc_in_dry_run_lists_strings(hooks: Any, plugin: object, lmcache_backend: Target) -> None:
    if not callable(getattr(plugin, "lmcache_platform_gc", None)):
        pytest.skip(f"{lmcache_backend.name} implements no gc hook (optional)")
    answers = hooks.lmcache_platform_gc(dry_run=True)  # pluggy drops a None answer
    assert len(answers) <= 1
    for answer in answers:
        assert isinstance(answer, list) and all(isinstance(x, str) for x in answer), answer


def test_the_entry_point_module_imports_without_torch(lmcache_backend: Target) -> None:
    """Discovery imports the module for every resolution of its device type; keep it light."""
    module = lmcache_backend.spec.entry_point.partition("=")[2].strip().partition(":")[0]
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        "heavy = [m for m in ('torch',) if m in sys.modules]\n"
        "assert not heavy, f'importing the entry point imported {heavy}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_core_selects_it_in_this_and_in_a_spawned_process(lmcache_backend: Target, lmcache_peer: Any) -> None:
    assert selected_backend(lmcache_backend.device_type).name == lmcache_backend.name
    hello = lmcache_peer.call("hello", device_type=lmcache_backend.device_type)
    assert hello["backend"] == lmcache_backend.name
    assert hello["distribution"] == lmcache_backend.info.distribution

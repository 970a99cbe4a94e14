"""Benchmark sections for the control path: dispatch overhead and import cost.

Dispatch is timed in this process with :mod:`timeit` (per call, loop included, as
``timeit`` reports it; the empty loop is listed so net costs can be derived).
Import cost is timed in fresh interpreters, since it happens once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import timeit
import types
from collections.abc import Sequence
from typing import Any

from .._errors import LMCachePlatformError
from .stats import Report, Result, Settings, Skip, SpeedTarget

#: Cached factory lookup may cost at most this many dict lookups.
DISPATCH_LIMIT = 3.0

_NULL_DEVICE = "benchnull"


def bench_dispatch(report: Report, settings: Settings) -> None:
    """Cached ``get_kv_wrapper_factory`` against a dict lookup and a pluggy hook call."""
    from .. import get_kv_wrapper_factory, hookspecs
    from .._plugins.engine import plugin_manager

    device_type = settings.device
    try:
        factory = get_kv_wrapper_factory(device_type)
    except LMCachePlatformError as exc:
        report.skipped.append(Skip("dispatch", "get_kv_wrapper_factory", str(exc).splitlines()[0]))
        return
    table = {device_type: factory}

    pm = plugin_manager(hookspecs)
    pm.register(_one_impl(device_type, factory), name="bench")
    hook = pm.hook.lmcache_platform_ipc_wrapper_class
    if hook(device_type=device_type) is not factory:
        raise RuntimeError("the pluggy baseline did not return the factory")

    cases = {
        "empty loop": "pass",
        "dict lookup": "table[dt]",
        "get_kv_wrapper_factory (cached)": "get(dt)",
        "dict lookup via a function call": "getitem(dt)",
        "pluggy hook call (1 impl)": "hook(device_type=dt)",
    }
    env = {
        "table": table,
        "dt": device_type,
        "get": get_kv_wrapper_factory,
        "getitem": table.__getitem__,
        "hook": hook,
    }
    runs, budget = settings.repeats(5, 9), 0.02 if settings.quick else 0.1
    results = [
        Result("dispatch", case, "ns", tuple(t * 1e9 for t in values), {"device": device_type})
        for case, values in per_call(cases, env, runs, budget).items()
    ]
    base = next(r for r in results if r.case == "dict lookup")
    results = [r if r.case == "empty loop" else r.relative_to(base) for r in results]
    report.results.extend(results)
    cached = next(r for r in results if r.case.startswith("get_kv_wrapper_factory"))
    report.targets.append(
        SpeedTarget.at_most(
            "dispatch.cached_lookup",
            f"cached get_kv_wrapper_factory <= {DISPATCH_LIMIT:g} x dict lookup",
            cached.ratio,
            DISPATCH_LIMIT,
            note="timeit per call, loop overhead included in both",
        )
    )


def per_call(
    cases: dict[str, str], env: dict[str, Any], runs: int, budget_s: float
) -> dict[str, list[float]]:
    """Seconds per execution of each statement, ``runs`` times each.

    Each repeat lasts about ``budget_s``; the repeats of all cases are interleaved,
    so a load change on a shared machine hits every case alike.
    """
    timers, numbers = {}, {}
    for name, stmt in cases.items():
        timer = timers[name] = timeit.Timer(stmt, globals=env)
        number = 1
        while (elapsed := timer.timeit(number)) < budget_s / 10:
            number *= 10
        numbers[name] = max(1, int(number * budget_s / max(elapsed, 1e-9)))
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, timer in timers.items():
            out[name].append(timer.timeit(numbers[name]) / numbers[name])
    return out


def _one_impl(device_type: str, factory: object) -> object:
    from ..hookspecs import hookimpl

    @hookimpl
    def lmcache_platform_ipc_wrapper_class(device_type: str) -> object:
        return factory if device_type == served else None

    served = device_type
    return types.SimpleNamespace(lmcache_platform_ipc_wrapper_class=lmcache_platform_ipc_wrapper_class)


def bench_create_dispatch(report: Report, settings: Settings, *, layers: int = 32) -> None:
    """``create_cache_context`` minus the direct constructor, with a context that does nothing.

    A do-nothing backend is registered in this process for the run (and removed
    afterwards), so the difference is the facade's own work: argument checks,
    the device-type scan over the wrappers, the class lookup and the config.
    """
    import torch

    from .. import create_cache_context
    from .._plugins.registry import REGISTRY
    from .._types import CacheContextConfig

    ctx_cls, wrapper_cls, plugin = _null_backend()
    wrappers = [
        wrapper_cls(dtype=torch.float16, shape=(1,), stride=(1,), storage_offset=0, device_uuid="")
        for _ in range(layers)
    ]
    state = REGISTRY.snapshot_all()
    try:
        REGISTRY.register_backend(plugin, _NULL_DEVICE, distribution="bench", version="0")
        if type(create_cache_context(wrappers)) is not ctx_cls:
            raise RuntimeError("create_cache_context did not dispatch to the benchmark backend")
        env = {"create": create_cache_context, "cls": ctx_cls, "w": wrappers, "Config": CacheContextConfig}
        runs, budget = settings.repeats(5, 9), 0.02 if settings.quick else 0.1
        timed = per_call({"facade": "create(w)", "direct": "cls(w, Config())"}, env, runs, budget)
    finally:
        REGISTRY.restore_all(state)
    params = {"layers": layers}
    as_us = [t * 1e6 for t in timed["facade"]]
    direct_us = [t * 1e6 for t in timed["direct"]]
    report.results += [
        Result("dispatch", "create_cache_context (do-nothing context)", "us", tuple(as_us), params),
        Result("dispatch", "direct constructor + config", "us", tuple(direct_us), params),
        Result(
            "dispatch",
            "create_cache_context dispatch overhead",
            "us",
            tuple(f - d for f, d in zip(as_us, direct_us, strict=True)),
            params,
            note="per call, paired difference of the two rows above",
        ),
    ]


def _null_backend() -> tuple[type[Any], type[Any], object]:
    """A backend whose context and wrapper do nothing, for measuring the facade alone."""
    from .._ipc_wrapper import DeviceIPCWrapper
    from .._kv.context import BaseCacheContext
    from .._version import API_VERSION
    from ..hookspecs import hookimpl

    def unused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("benchmark stand-in")

    def init(self: Any, kv_caches: Sequence[Any], config: Any) -> None:
        self.kv_caches, self.config = kv_caches, config

    abstract = {n: unused for n in getattr(BaseCacheContext, "__abstractmethods__", ())}
    ctx_cls = type(
        "NullContext",
        (BaseCacheContext,),
        {
            **abstract,
            "device_type": _NULL_DEVICE,
            "__init__": init,
            "close": lambda self: None,
        },
    )
    wrapper_cls = type(
        "NullWrapper",
        (DeviceIPCWrapper,),
        {
            "device_type": _NULL_DEVICE,
            "wire_tag": "bench.null/1",
            "wrap": classmethod(unused),
            "to_tensor": unused,
        },
    )

    @hookimpl
    def lmcache_platform_api_version() -> int:
        return API_VERSION

    @hookimpl
    def lmcache_platform_cache_context_class(device_type: str) -> type[Any] | None:
        return ctx_cls if device_type == _NULL_DEVICE else None

    @hookimpl
    def lmcache_platform_ipc_wrapper_class(device_type: str) -> type[Any] | None:
        return wrapper_cls if device_type == _NULL_DEVICE else None

    plugin = types.SimpleNamespace(
        lmcache_platform_api_version=lmcache_platform_api_version,
        lmcache_platform_cache_context_class=lmcache_platform_cache_context_class,
        lmcache_platform_ipc_wrapper_class=lmcache_platform_ipc_wrapper_class,
    )
    return ctx_cls, wrapper_cls, plugin


# -- import cost ----------------------------------------------------------------------

_IMPORT_ONLY = """\
import json, sys, time
t0 = time.perf_counter()
import lmcache_platform
t1 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "torch": "torch" in sys.modules}))
"""

_RESOLVE = """\
import json, sys, time
device = sys.argv[1]
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import lmcache_platform
t2 = time.perf_counter()
lmcache_platform.get_kv_wrapper_factory(device)
t3 = time.perf_counter()
print(json.dumps({"import_torch": t1 - t0, "import": t2 - t1, "resolve": t3 - t2}))
"""


def _fresh(code: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"fresh interpreter failed:\n{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def bench_import(report: Report, settings: Settings) -> None:
    """``import lmcache_platform`` and the first resolution, each in fresh interpreters.

    The first resolution of ``cpu`` imports the backend's wrapper module, which
    needs torch. An engine has torch loaded already, so those processes import
    torch first (timed apart): the rows after it are the framework's own cost.
    """
    device_type = settings.device
    light = [_fresh(_IMPORT_ONLY) for _ in range(settings.repeats(5, 15))]
    try:
        heavy = [_fresh(_RESOLVE, device_type) for _ in range(settings.repeats(2, 5))]
    except RuntimeError as exc:
        report.skipped.append(
            Skip("import", f"first resolution of {device_type}", str(exc).strip().splitlines()[-1])
        )
        heavy = []
    ms = 1e3
    report.results.append(
        Result("import", "import lmcache_platform", "ms", tuple(r["import"] * ms for r in light))
    )
    if heavy:
        report.results += [
            Result(
                "import",
                "import lmcache_platform (torch already loaded)",
                "ms",
                tuple(r["import"] * ms for r in heavy),
            ),
            Result("import", "import torch (reference)", "ms", tuple(r["import_torch"] * ms for r in heavy)),
            Result(
                "import",
                f"first resolution of {device_type!r} (torch loaded)",
                "ms",
                tuple(r["resolve"] * ms for r in heavy),
                {"device": device_type},
                note="metadata scan, backend import, hooks, probe, selection",
            ),
        ]
    with_torch = sum(r["torch"] for r in light)
    report.targets.append(
        SpeedTarget.at_most(
            "import.no_torch",
            "`import lmcache_platform` imports torch in 0 of the fresh processes",
            float(with_torch),
            0.0,
            note=f"{len(light)} processes",
        )
    )

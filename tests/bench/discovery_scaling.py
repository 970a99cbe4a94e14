#!/usr/bin/env python3
"""Discovery scaling: the cost of the first ``cpu`` resolution against N and K.

Builds synthetic environments: a site directory holding N installed distributions
(``*.dist-info`` directories, most without entry points, like a real environment),
K of which are backends advertised under ``lmcache.platform``. Exactly one backend
is ``cpu``; the others serve ``dev1``..``dev{K-1}``. Every backend module is slow to
import on purpose (``--delay-ms``, default 20 ms, as a real accelerator SDK is).

Each approach then resolves ``cpu`` in fresh processes that see only that site
directory (``python -S -E`` plus an explicit ``sys.path`` of the site dir and a
directory of symlinks to lmcache-platform's own dependencies, which carry no
metadata):

* ``lazy``: this framework, ``lmcache_platform.get_kv_wrapper_factory("cpu")``.
  It reads metadata, then imports only the entry points named ``cpu``/``cpu.*``.
* ``pluggy``: pluggy's ``PluginManager.load_setuptools_entrypoints("lmcache.platform")``
  then one hook call; it imports every backend.
* ``walk``: the package-walk approach (upstream LMCache's discovery era): a package
  of K modules walked with ``pkgutil``, each imported and scanned for wrapper
  subclasses.

Only the resolution is timed (the frameworks themselves are imported first). The
table reports the median of ``--runs`` fresh processes, with min and max, and how
many backend modules each approach imported. Targets: lazy K=50 / K=1 <= 1.2 while
the eager approaches grow with K. Not a pytest module: run it as a script::

    PYTHONPATH=tests .venv/bin/python -m bench.discovery_scaling --plot docs/_static/discovery-scaling.png
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_platform._bench.stats import SCHEMA_VERSION, SpeedTarget, figure

APPROACHES = ("lazy", "pluggy", "walk")
LABELS = {
    "lazy": "lmcache-platform (lazy)",
    "pluggy": "pluggy load_setuptools_entrypoints",
    "walk": "package walk (pkgutil)",
}
#: Flatness limit of the lazy approach: K=max over K=min.
FLAT_LIMIT = 1.2

_BACKEND_MODULE = '''\
"""Synthetic backend {index}: serves {device!r}; slow to import on purpose."""
import time

time.sleep({delay!r})

from lmcache_platform import API_VERSION, BaseCacheContext, DeviceIPCWrapper, hookimpl


def _unused(*args, **kwargs):
    raise NotImplementedError


class Wrapper(DeviceIPCWrapper):
    device_type = {device!r}
    wire_tag = "bench.{device}/1"
    wrap = classmethod(_unused)
    to_tensor = _unused


Context = type(
    "Context", (BaseCacheContext,),
    {{"device_type": {device!r}, **{{n: _unused for n in BaseCacheContext.__abstractmethods__}}}},
)


@hookimpl
def lmcache_platform_api_version():
    return API_VERSION


@hookimpl
def lmcache_platform_ipc_wrapper_class(device_type):
    return Wrapper if device_type == {device!r} else None


@hookimpl
def lmcache_platform_cache_context_class(device_type):
    return Context if device_type == {device!r} else None
'''

# Runs in the fresh process: python -S -E -c CHILD approach site deps
_CHILD = textwrap.dedent("""\
    import json, sys, time
    approach, site, deps = sys.argv[1:4]
    sys.path[:] = [site, deps] + [p for p in sys.path if p]
    import importlib, inspect, pkgutil
    import pluggy
    import lmcache_platform
    from lmcache_platform import DeviceIPCWrapper, hookspecs

    t0 = time.perf_counter()
    if approach == "lazy":
        cls = lmcache_platform.get_kv_wrapper_factory("cpu").__self__
    elif approach == "pluggy":
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        pm.load_setuptools_entrypoints("lmcache.platform")
        cls = pm.hook.lmcache_platform_ipc_wrapper_class(device_type="cpu")
    else:
        pkg = importlib.import_module("benchwalk")
        found = {}
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            module = importlib.import_module(info.name)
            for _, obj in inspect.getmembers(module, inspect.isclass):
                if issubclass(obj, DeviceIPCWrapper) and obj.device_type:
                    found.setdefault(obj.device_type, obj)
        cls = found["cpu"]
    seconds = time.perf_counter() - t0
    imported = sum(1 for n in sys.modules if n.startswith(("benchbk_", "benchwalk.")))
    print(json.dumps({"seconds": seconds, "imported": imported, "device_type": cls.device_type}))
""")


@dataclass(frozen=True)
class Env:
    n: int
    k: int
    site: Path


def dependency_dir(root: Path) -> Path:
    """A directory of symlinks to the packages lmcache-platform and pluggy import.

    Symlinked package directories carry no ``*.dist-info``, so the child processes
    see the synthetic site dir's metadata and nothing else.
    """
    probe = (
        "import sys, json; before = set(sys.modules)\n"
        "import lmcache_platform, lmcache_platform.hookspecs, pluggy, importlib_metadata\n"
        "new = {n.split('.')[0] for n in set(sys.modules) - before}\n"
        "out = {}\n"
        "for n in sorted(new - set(sys.stdlib_module_names)):\n"
        "    f = getattr(sys.modules[n], '__file__', None)\n"
        "    if f: out[n] = f\n"
        "print(json.dumps(out))\n"
    )
    found = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    deps = root / "deps"
    deps.mkdir()
    for file in found.values():
        path = Path(file)
        target = path.parent if path.name == "__init__.py" else path
        (deps / target.name).symlink_to(target)
    return deps


def build_env(root: Path, n: int, k: int, delay_s: float) -> Env:
    """Write N distributions (K of them backends) and a K-module walk package into a site dir."""
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= K <= N, got N={n}, K={k}")
    site = root / f"site-n{n}-k{k}"
    walk = site / "benchwalk"
    walk.mkdir(parents=True)
    (walk / "__init__.py").write_text("")
    for i in range(k):
        device = "cpu" if i == 0 else f"dev{i}"
        source = _BACKEND_MODULE.format(index=i, device=device, delay=delay_s)
        (site / f"benchbk_{i}.py").write_text(source)
        (walk / f"mod_{i}.py").write_text(source)
        _dist(site, f"bench-backend-{i}", entry_points=f"[lmcache.platform]\n{device} = benchbk_{i}\n")
    for j in range(n - k):
        # One in five ordinary distributions has entry points, none in our group.
        eps = f"[console_scripts]\nfiller-{j} = filler_{j}:main\n" if j % 5 == 0 else None
        _dist(site, f"filler-{j}", entry_points=eps)
    compileall.compile_dir(str(site), quiet=1)  # a real environment has its bytecode
    return Env(n, k, site)


def _dist(site: Path, name: str, *, entry_points: str | None) -> None:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nSummary: synthetic distribution\n"
    )
    (info / "WHEEL").write_text(
        "Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


def resolve_once(approach: str, env: Env, deps: Path) -> dict[str, Any]:
    """Resolve ``cpu`` once in a fresh, isolated process; return its report."""
    proc = subprocess.run(
        [sys.executable, "-S", "-E", "-c", _CHILD, approach, str(env.site), str(deps)],
        capture_output=True,
        text=True,
        cwd=env.site.parent,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{approach} (N={env.n}, K={env.k}) failed:\n{proc.stderr}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if report["device_type"] != "cpu":
        raise RuntimeError(f"{approach} resolved {report['device_type']!r}, not 'cpu'")
    return report


def measure(ns: list[int], ks: list[int], runs: int, delay_s: float) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lmcache-discovery-") as tmp:
        root = Path(tmp)
        deps = dependency_dir(root)
        for n in ns:
            for k in ks:
                env = build_env(root, n, k, delay_s)
                for approach in APPROACHES:
                    reports = [resolve_once(approach, env, deps) for _ in range(runs)]
                    ms = [r["seconds"] * 1e3 for r in reports]
                    results.append(
                        {
                            "approach": approach,
                            "n": n,
                            "k": k,
                            "runs": runs,
                            "median_ms": statistics.median(ms),
                            "min_ms": min(ms),
                            "max_ms": max(ms),
                            "values_ms": ms,
                            "modules_imported": reports[0]["imported"],
                        }
                    )
    return {
        "schema": SCHEMA_VERSION,
        "params": {
            "n": ns,
            "k": ks,
            "runs": runs,
            "delay_ms": delay_s * 1e3,
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        },
        "results": results,
        "targets": [t.to_json() for t in targets(results, ns, ks)],
    }


def _median(results: list[dict[str, Any]], approach: str, n: int, k: int) -> float:
    return float(next(r["median_ms"] for r in results if (r["approach"], r["n"], r["k"]) == (approach, n, k)))


def targets(results: list[dict[str, Any]], ns: list[int], ks: list[int]) -> list[SpeedTarget]:
    """Per N: lazy is flat in K (ratio <= 1.2); the eager approaches are not."""
    lo, hi = min(ks), max(ks)
    out: list[SpeedTarget] = []
    if lo == hi:
        return out
    for n in ns:
        for approach in APPROACHES:
            ratio = _median(results, approach, n, hi) / _median(results, approach, n, lo)
            goal = f"{LABELS[approach]}, N={n}: first resolution K={hi} / K={lo}"
            if approach == "lazy":
                out.append(
                    SpeedTarget.at_most(f"discovery.lazy.n{n}", goal + f" <= {FLAT_LIMIT}", ratio, FLAT_LIMIT)
                )
            else:
                out.append(
                    SpeedTarget.at_least(
                        f"discovery.{approach}.n{n}",
                        goal + f" > {FLAT_LIMIT} (eager grows with K)",
                        ratio,
                        FLAT_LIMIT,
                    )
                )
    return out


def format_table(data: dict[str, Any]) -> str:
    p = data["params"]
    lines = [
        f"First `cpu` resolution in a fresh process: median (min..max) of {p['runs']} runs, ms; "
        f"backend import delay {p['delay_ms']:g} ms; [modules imported]",
        f"{'N':>5} {'K':>3}  " + "  ".join(f"{LABELS[a]:<36}" for a in APPROACHES),
    ]
    for n in p["n"]:
        for k in p["k"]:
            cells = []
            for a in APPROACHES:
                r = next(x for x in data["results"] if (x["approach"], x["n"], x["k"]) == (a, n, k))
                cell = (
                    f"{r['median_ms']:8.1f} ({r['min_ms']:.1f}..{r['max_ms']:.1f}) [{r['modules_imported']}]"
                )
                cells.append(f"{cell:<36}")
            lines.append(f"{n:>5} {k:>3}  " + "  ".join(cells))
    if data["targets"]:
        lines.append("")
        lines.append("Targets:")
        for t in data["targets"]:
            verdict = {True: "pass", False: "MISS", None: "n/a"}[t["passed"]]
            lines.append(f"  [{verdict}] {t['goal']}: {t['value']:.2f}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    styles = ["-", "--", ":", "-."]
    title = f"Discovery scaling (backend import delay {data['params']['delay_ms']:g} ms)"
    with figure(path, title, legend_size=7) as ax:
        for i, n in enumerate(data["params"]["n"]):
            for a, color in zip(APPROACHES, ("tab:green", "tab:red", "tab:purple"), strict=True):
                rows = sorted(
                    (r for r in data["results"] if r["approach"] == a and r["n"] == n), key=lambda r: r["k"]
                )
                ax.errorbar(
                    [r["k"] for r in rows],
                    [r["median_ms"] for r in rows],
                    yerr=[
                        [r["median_ms"] - r["min_ms"] for r in rows],
                        [r["max_ms"] - r["median_ms"] for r in rows],
                    ],
                    color=color,
                    linestyle=styles[i % len(styles)],
                    marker="o",
                    capsize=3,
                    label=f"{LABELS[a]}, N={n}",
                )
        ax.set_xlabel("backends installed (K)")
        ax.set_ylabel("first `cpu` resolution (ms)")
        ax.set_xscale("log")
        ax.set_yscale("log")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[100, 1000], help="distributions installed")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 10, 50], help="backends among them")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per case")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="import delay of each backend")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.add_argument("--save", type=Path, help="also write the JSON document here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.delay_ms < 0:
        parser.error("--runs must be >= 1 and --delay-ms >= 0")
    if any(k < 1 for k in args.k) or any(k > n for n in args.n for k in args.k):
        parser.error("every K must be >= 1 and <= every N")
    data = measure(sorted(set(args.n)), sorted(set(args.k)), args.runs, args.delay_ms / 1e3)
    if args.plot:
        plot(data, args.plot)
        data["plot"] = str(args.plot)
    document = json.dumps(data, indent=2)
    if args.save:
        args.save.write_text(document + "\n")
    print(document if args.json else format_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

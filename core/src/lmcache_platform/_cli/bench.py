"""``lmcache-platform bench``: hand-off, migration, transfer, dispatch, import and server-path figures.

Speed goals are measured here and printed as pass/miss next to the figures; no
test asserts a timing. Sections live in :mod:`lmcache_platform._bench`; this one runs them,
then prints a table (or ``--json``) and optionally plots the hand-off. torch is
imported only by the sections that need it, so ``--help`` stays light.

Exit status: 0 when every section ran (a missed target is a figure, not a failure),
1 when a section raised, 2 on bad usage (such as ``--device cuda`` without CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .._bench.stats import NOISY_SPREAD, Report, Result, Settings, Skip, figure
from .._errors import LMCachePlatformError
from .._units import parse_bytes
from ._args import positive_int as _positive

#: section -> (title, parameter columns, what ratios compare with)
SECTIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "import": ("Import cost, in fresh interpreters (ms)", (), ""),
    "dispatch": (
        "Dispatch overhead per call (timeit, loop included)",
        ("layers",),
        "ratio = median / dict lookup",
    ),
    "handoff": (
        "Hand-off of a 32-layer KV-cache set to a spawned process (ms)",
        ("size",),
        "ratio = median / ours",
    ),
    "handoff stages": (
        "Our hand-off by stage (ms; decode and to_tensors() in the receiver)",
        ("size", "message_bytes"),
        "",
    ),
    "migration": (
        "One-time migration into shared memory (ms)",
        ("size",),
        "ratio = median / ours: first wrap",
    ),
    "migration memory": (
        "Peak memory added by sharing the set (MiB, VmHWM of a fresh process)",
        ("size", "peak_mib"),
        "",
    ),
    "transfer": (
        "Store/retrieve of 256-token chunks, 32 layers (GB/s, higher is better)",
        ("format", "engine_layout", "chunk_bytes"),
        "ratio = median / copy_ of the same bytes and shape",
    ),
    "server": (
        "A real serve between two engine processes: put and get per request (GB/s)",
        ("scenario", "chunks", "per_request"),
        "ratio = median / copy_ of the same bytes (host: with the server's torch threads)",
    ),
}
ORDER = tuple(SECTIONS)
_RUNNABLE = ("import", "dispatch", "handoff", "migration", "transfer", "server")
#: What runs without --section: the server path starts processes of its own and takes minutes.
_DEFAULT = ("import", "dispatch", "handoff", "migration", "transfer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="device type of the KV caches (default: cpu)"
    )
    parser.add_argument(
        "--layout",
        choices=("vllm", "per-layer"),
        default="vllm",
        help="KV set of the hand-off and migration sections: current vLLM's views of one "
        "allocation (default) or one allocation per layer (older engines)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, fewer repeats: a smoke run (10 to 30 s on 2 cores)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--save", type=Path, metavar="FILE", help="also write the JSON document to FILE")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="write a PNG of hand-off time against size per method"
    )
    parser.add_argument(
        "--section",
        action="append",
        choices=_RUNNABLE,
        dest="sections",
        help="run only this section (repeatable; default: all but server, the server path: a real "
        "serve and two engine processes, with --chunks, --per-request and --chunk-format)",
    )
    parser.add_argument(
        "--chunks",
        type=_positive,
        metavar="N",
        help="server: working set in chunks (default: 64 on cuda, 8 on cpu)",
    )
    parser.add_argument(
        "--per-request",
        type=_positive,
        metavar="N",
        help="server: chunks per put or get (default: 8 on cuda, 4 on cpu)",
    )
    parser.add_argument(
        "--chunk-format",
        choices=("blocks", "tokens"),
        default="blocks",
        help="server: the contexts' chunk format: the engine's own blocks, as the vLLM connector "
        "registers them (default), or token-major",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        metavar="LIST",
        help="hand-off and migration sizes, e.g. 64M,1G (default: 64M,1G,4G; --quick: 4M,16M,64M)",
    )
    parser.add_argument(
        "--runs", type=_positive, metavar="N", help="repeats of every measurement (default: per section)"
    )
    parser.add_argument(
        "--threads",
        type=_positive,
        metavar="N",
        help="torch intra-op threads in this process (default: torch's choice); "
        "1 keeps copies steady on a busy machine",
    )


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"64M,1G"`` -> bytes: a comma-separated list in :func:`~lmcache_platform.parse_bytes`'s grammar."""
    sizes = []
    for item in text.split(","):
        try:
            value = parse_bytes(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {item!r} (use e.g. 64M or 1G)") from None
        if value < 1 << 20:
            raise argparse.ArgumentTypeError(f"size {item!r} is below 1 MiB")
        sizes.append(value)
    return tuple(sorted(set(sizes)))


def run(args: argparse.Namespace) -> int:
    device: str = args.device
    if device == "cuda" and not _cuda_available():
        print(
            "lmcache-platform bench: --device cuda needs a CUDA build of torch and a visible GPU",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    settings = Settings(
        device=device,
        quick=args.quick,
        runs=args.runs,
        sizes=args.sizes,
        layout=getattr(args, "layout", "vllm"),
    )
    with _sigterm_exits():
        report = _measure(settings, args.sections or _DEFAULT, args)
    if args.plot:
        if plot_handoff(report, args.plot):
            report.meta["plot"] = str(args.plot)
        else:
            report.skipped.append(Skip("plot", str(args.plot), "no hand-off figures to plot"))
    document = json.dumps(report.to_json(), indent=2)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(document + "\n")
    print(document if args.json else format_report(report))
    return 1 if report.errors else 0


def _measure(settings: Settings, names: Sequence[str], args: argparse.Namespace | None = None) -> Report:
    """Run the sections ``names``; one that raises is reported as an error and the rest go on."""
    report = Report(meta=_meta(settings))
    sections = _sections(settings, report, args)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    for name in names:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            sections[name]()
        except LMCachePlatformError as exc:
            report.skipped.append(Skip(name, "all", str(exc).splitlines()[0]))
        except Exception as exc:
            traceback.print_exc()
            report.errors.append(Skip(name, "all", f"{type(exc).__name__}: {exc}"))
        timings[name] = round(time.perf_counter() - t0, 2)
    report.meta["seconds"] = {"total": round(time.perf_counter() - started, 2), **timings}
    report.meta["loadavg_end"] = _loadavg()
    return report


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit``, so finally blocks and atexit release shared memory."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sections(
    settings: Settings, report: Report, args: argparse.Namespace | None = None
) -> dict[str, Callable[[], None]]:
    def imports() -> None:
        from .._bench.dispatch import bench_import

        bench_import(report, settings)

    def dispatch() -> None:
        from .._bench.dispatch import bench_create_dispatch, bench_dispatch

        bench_dispatch(report, settings)
        bench_create_dispatch(report, settings)

    def handoff() -> None:
        from .._bench.handoff import bench_handoff

        bench_handoff(report, settings)

    def migration() -> None:
        from .._bench.handoff import bench_migration
        from .._bench.peak import bench_peak

        bench_migration(report, settings)
        bench_peak(report, settings)

    def transfer() -> None:
        from .._bench.transfer import bench_transfer

        bench_transfer(report, settings)

    def server() -> None:
        from .._bench.serverpath import bench_server

        bench_server(
            report,
            settings,
            chunks=getattr(args, "chunks", None),
            per_request=getattr(args, "per_request", None),
            chunk_format=getattr(args, "chunk_format", "blocks"),
        )

    return {
        "import": imports,
        "dispatch": dispatch,
        "handoff": handoff,
        "migration": migration,
        "transfer": transfer,
        "server": server,
    }


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _meta(settings: Settings) -> dict[str, Any]:
    import torch

    from .._bench.kvsets import memory_available
    from .._version import __version__

    mem, shm = memory_available()
    meta: dict[str, Any] = {
        "lmcache_platform": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": settings.device,
        "quick": settings.quick,
        "runs": settings.runs,
        "sizes": list(settings.sizes) if settings.sizes else None,
        "mem_available_bytes": mem,
        "shm_free_bytes": shm,
        "loadavg_start": _loadavg(),
    }
    try:
        from .._plugins.registry import selected_backend

        b = selected_backend(settings.device)
        meta["backend"] = {"name": b.name, "distribution": b.distribution, "version": b.version}
    except LMCachePlatformError as exc:
        meta["backend"] = {"error": str(exc).splitlines()[0]}
    if settings.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    return meta


# -- output -----------------------------------------------------------------------------


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_report(report: Report) -> str:
    m = report.meta
    backend = m.get("backend", {})
    lines = [
        f"lmcache-platform bench: device {m['device']}{', quick' if m['quick'] else ''}; "
        f"lmcache-platform {m['lmcache_platform']}, Python {m['python']}, torch {m['torch']}, "
        f"{m['cpus']} CPUs ({m['torch_threads']} torch threads), load {m['loadavg_start']}",
        "backend: "
        + (
            f"{backend.get('name')} ({backend.get('distribution')} {backend.get('version')})"
            if "name" in backend
            else str(backend.get("error"))
        ),
        f"figures: median, min and max over repeated runs; noisy: max > {NOISY_SPREAD:g} x min",
    ]
    for section in ORDER:
        rows = report.section(section)
        if not rows:
            continue
        title, keys, ratio_note = SECTIONS[section]
        lines += ["", f"== {title} ==" + (f"  [{ratio_note}]" if ratio_note else "")]
        table = [
            [
                *(str(r.params.get(k) or "") for k in keys),
                r.case,
                _fmt(r.median),
                _fmt(r.min),
                _fmt(r.max),
                r.unit,
                f"{r.ratio:.2f}" if r.ratio is not None else "",
                "noisy" if r.noisy else "",
            ]
            for r in rows
        ]
        header = [*keys, "case", "median", "min", "max", "unit", "ratio", ""]
        lines += _columns([header, *table], right=set(range(len(keys) + 1, len(header))))
    lines += ["", "== Targets (benchmark figures, not assertions) =="]
    for t in report.targets:
        value = "not measured" if t.value is None else f"{t.value:.3g}"
        lines.append(f"  [{t.verdict:>4}] {t.goal}: {value}" + (f"  ({t.note})" if t.note else ""))
    for title, items in (("Skipped", report.skipped), ("Errors (see the tracebacks above)", report.errors)):
        if items:
            lines += ["", f"== {title} =="]
        for s in items:
            where = " ".join(str(v) for k, v in s.params.items() if k in ("size", "format"))
            lines.append(f"  {s.section} / {s.case}{' / ' + where if where else ''}: {s.reason}")
    seconds = m.get("seconds", {})
    if seconds:
        lines += ["", "took " + ", ".join(f"{k} {v:g} s" for k, v in seconds.items())]
    return "\n".join(lines)


def _columns(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def plot_handoff(report: Report, path: Path) -> bool:
    """Hand-off time against size, one line per method (log-log); False if nothing to plot."""
    rows = report.section("handoff")
    if not rows:
        return False
    by_method: dict[str, list[Result]] = {}
    for r in rows:
        by_method.setdefault(r.case, []).append(r)
    m = report.meta
    with figure(path, f"Hand-off to another process ({m['device']}, {m['cpus']} CPUs)", legend_size=8) as ax:
        for method, results in by_method.items():
            results.sort(key=lambda r: r.params["size_bytes"])
            xs = [r.params["size_bytes"] / (1 << 20) for r in results]
            ax.errorbar(
                xs,
                [r.median for r in results],
                yerr=[[r.median - r.min for r in results], [r.max - r.median for r in results]],
                marker="o",
                capsize=3,
                label=method,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        labels = {r.params["size_bytes"]: str(r.params["size"]) for r in rows}
        ax.set_xticks([n / (1 << 20) for n in sorted(labels)], [labels[n] for n in sorted(labels)])
        ax.minorticks_off()
        ax.set_xlabel("KV-cache set size (32 layers)")
        ax.set_ylabel("hand-off time (ms)")
    return True

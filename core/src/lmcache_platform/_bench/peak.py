"""How much sharing an engine's KV set raises peak memory: one fresh process per figure (``VmHWM``).

Run as ``python -m lmcache_platform._bench.peak METHOD SIZE LAYOUT``; prints one JSON
line. The process builds the hand-off benchmark's KV set (every page written), notes
its peak resident memory (``ru_maxrss``), shares the set by ``METHOD``, then reads
every byte through the engine's own tensors, so pages that moved into shared memory
count as resident again, and notes the peak once more. Methods:

* ``wrap``: ``wrap_kv_caches`` of the existing allocation (what an engine does);
* ``empty``: the set born in the backend's memory (``HostMemoryIPCWrapper.empty``),
  then wrapped;
* ``share_memory_``: torch's ``Tensor.share_memory_()`` (``file_system`` strategy), for
  reference.

The peak is reset (``/proc/self/clear_refs``) once the set is built, so torch's import
does not mask small sets.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Any

from .kvsets import kv_set, no_room, size_params, sizes_of
from .stats import Report, Result, Settings, Skip, SpeedTarget

METHODS = ("wrap", "empty", "share_memory_")
_TIMEOUT_S = 600.0


def measure(method: str, size: int, layout: str) -> dict[str, float]:
    """Run one fresh process; return its figures in MiB (``before``, ``peak``, ``added``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_platform._bench.peak", method, str(size), layout],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"peak-memory probe {method} {size} failed ({proc.returncode}): "
            f"{proc.stderr.strip().splitlines()[-1:] or proc.stdout}"
        )
    figures: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return figures


#: What wrapping an existing allocation may add to peak memory: this share of it, or FLOOR.
ADDED_SHARE, ADDED_FLOOR = 0.05, 64 << 20
LABELS = {
    "wrap": "ours: wrap an existing allocation",
    "empty": "ours: born shared (empty), then wrap",
    "share_memory_": "share_memory_ (file_system)",
}


def bench_peak(report: Report, settings: Settings) -> None:
    """Peak memory added by sharing the hand-off set, per method and size (fresh processes)."""
    for size in sizes_of(settings):
        params = size_params(size, "cpu", settings.layout)
        for method in METHODS:
            if method == "empty" and settings.layout != "vllm":
                continue  # born shared means one allocation: the views-of-one-allocation set
            why = no_room(2 * size if method == "share_memory_" else size, size, "cpu")
            if why:
                report.skipped.append(Skip("migration memory", LABELS[method], why, params))
                continue
            try:
                figures = measure(method, size, settings.layout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                report.errors.append(Skip("migration memory", LABELS[method], str(exc), params))
                continue
            report.results.append(
                Result(
                    "migration memory",
                    LABELS[method],
                    "MiB added",
                    (figures["added"],),
                    {**params, "peak_mib": figures["peak"]},
                )
            )
    wraps = [r for r in report.section("migration memory") if r.case == LABELS["wrap"]]
    largest = max(wraps, key=lambda r: r.params["size_bytes"], default=None)
    allowed = (max(ADDED_SHARE * largest.params["size_bytes"], ADDED_FLOOR) / (1 << 20)) if largest else 0.0
    report.targets.append(
        SpeedTarget.at_most(
            "migration.peak_memory",
            f"wrapping an existing allocation adds <= {ADDED_SHARE:.0%} of it (at least "
            f"{ADDED_FLOOR >> 20} MiB) to peak memory",
            largest.median if largest else None,
            allowed,
            note=f"{largest.params['size']}: {allowed:.0f} MiB allowed" if largest else "not measured",
        )
    )


def _max_rss_mib() -> float:
    """This process's peak resident memory since exec (``VmHWM``), in MiB.

    ``ru_maxrss`` would be the same figure but for one thing: Linux carries it over
    ``exec`` from the process that forked, so a child of a large benchmark process
    reports its parent's peak. ``VmHWM`` belongs to the memory of this program only.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass  # no /proc: fall back to ru_maxrss, right when this process was not forked big
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _reset_peak() -> bool:
    """Start the peak over from the current resident set (Linux >= 4.0), so that importing
    torch, whose transient peak can exceed a small set, does not hide the figure."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _born_shared(size: int, layout: str) -> list[Any]:
    """The hand-off set's views over one allocation made in the backend's memory, pages written."""
    import torch

    from .. import get_kv_wrapper_factory

    owner = getattr(get_kv_wrapper_factory("cpu"), "__self__", None)
    if owner is None or not hasattr(owner, "empty"):
        raise SystemExit(f"the cpu backend's wrapper ({owner}) cannot allocate memory born shared")
    shapes = kv_set(size, "meta", layout)  # geometry only
    if len({t.untyped_storage().nbytes() for t in shapes}) != 1 or len(shapes) < 2:
        raise SystemExit("'empty' needs the views-of-one-allocation layout (--layout vllm)")
    base = owner.empty(shapes[0].untyped_storage().nbytes(), dtype=torch.uint8)
    base.fill_(1)
    typed = base.view(shapes[0].dtype)
    return [typed.as_strided(t.shape, t.stride(), t.storage_offset()) for t in shapes]


def main(argv: list[str]) -> None:
    method, size, layout = argv[0], int(argv[1]), argv[2]
    if method not in METHODS:
        raise SystemExit(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    import torch

    from .. import wrap_kv_caches

    tensors = _born_shared(size, layout) if method == "empty" else kv_set(size, "cpu", layout)
    reset = _reset_peak()
    before = _max_rss_mib()
    wrappers: list[Any] = []
    if method == "share_memory_":
        torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
        for t in tensors:
            t.share_memory_()
    else:
        wrappers = wrap_kv_caches(tensors)
    total = sum(int(t.view(torch.uint8).amax()) for t in tensors)  # every page resident again
    peak = _max_rss_mib()
    print(
        json.dumps(
            {
                "before": before,
                "peak": peak,
                "added": peak - before,
                "checksum": total,
                "peak_reset": reset,
                "pid": os.getpid(),
            }
        )
    )
    for w in wrappers:
        w.close()


if __name__ == "__main__":
    main(sys.argv[1:])

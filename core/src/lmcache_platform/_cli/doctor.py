"""``lmcache-platform doctor``: what this host offers the platform layer, and what to fix.

Every probe is isolated: a missing torch, a broken backend or an unreadable
/dev/shm becomes a finding with a hint, never a crash. ``--json`` prints::

    {"schema": 1, "ok": bool,
     "python": {"version", "implementation", "executable", "platform"},
     "torch": {"installed", "version", "cuda_build", "hip_build", "cuda_available",
               "devices": [{"index", "name"}], "cuda_visible_devices", "error"},
     "backends": <the `lmcache-platform list --json` report>,
     "stale_resources": {"<backend>": ["<resource>", ...]},
     "shm": {"path", "total_bytes", "free_bytes", "error"},
     "hints": [{"level": "error" | "warning" | "info", "message"}]}

Exit status 1 when a hint has level ``error`` (nothing could serve KV caches on
this host as it stands), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

SCHEMA = 1
SHM_PATH = "/dev/shm"
#: Below this, a real model's KV cache does not fit in /dev/shm (Docker's default is 64 MiB).
SHM_MIN_BYTES = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def _python() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
    }


def _torch() -> dict[str, Any]:
    out: dict[str, Any] = {
        "installed": False, "version": None, "cuda_build": None, "hip_build": None,
        "cuda_available": False, "devices": [], "error": None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }  # fmt: skip
    try:
        import torch
    except Exception as exc:  # a broken install is a finding, not a crash
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(
        installed=True,
        version=torch.__version__,
        cuda_build=torch.version.cuda,
        hip_build=getattr(torch.version, "hip", None),
    )
    try:
        out["cuda_available"] = torch.cuda.is_available()
        if out["cuda_available"]:
            out["devices"] = [
                {"index": i, "name": torch.cuda.get_device_name(i)} for i in range(torch.cuda.device_count())
            ]
    except Exception as exc:  # a driver mismatch raises here
        out["error"] = f"CUDA query failed: {type(exc).__name__}: {exc}"
    return out


def _backends() -> tuple[dict[str, Any] | None, dict[str, list[str]], str | None]:
    from . import gc as _gc
    from . import list as _list

    try:
        report = _list.collect(load=True)
        stale, _failed = _gc.reclaim(dry_run=True)
    except Exception as exc:  # the registry itself failing is the finding
        return None, {}, f"{type(exc).__name__}: {exc}"
    return report, {k: v for k, v in stale.items() if v}, None


def _shm() -> dict[str, Any]:
    out: dict[str, Any] = {"path": SHM_PATH, "total_bytes": None, "free_bytes": None, "error": None}
    try:
        st = os.statvfs(SHM_PATH)
    except OSError as exc:
        out["error"] = f"{exc.strerror or exc}"
        return out
    out["total_bytes"] = st.f_blocks * st.f_frsize
    out["free_bytes"] = st.f_bavail * st.f_frsize
    return out


def collect() -> dict[str, Any]:
    """Run every probe and derive the hints."""
    report: dict[str, Any] = {"schema": SCHEMA, "python": _python(), "torch": _torch()}
    backends, stale, backend_error = _backends()
    report["backends"] = backends if backends is not None else {"error": backend_error}
    report["stale_resources"] = stale
    report["shm"] = _shm()
    report["hints"] = _hints(report, backends, backend_error)
    report["ok"] = not any(h["level"] == "error" for h in report["hints"])
    return report


def _hints(
    r: dict[str, Any], backends: dict[str, Any] | None, backend_error: str | None
) -> list[dict[str, str]]:
    hints: list[dict[str, str]] = []

    def add(level: str, message: str) -> None:
        hints.append({"level": level, "message": message})

    t = r["torch"]
    if not t["installed"]:
        add("error", f"torch is not importable ({t['error']}); install the torch build your "
                     "engine uses (CPU, CUDA or ROCm), e.g. `pip install torch`")  # fmt: skip
    elif t["error"]:
        add("warning", f"{t['error']}; check the NVIDIA driver against torch's CUDA "
                       f"{t['cuda_build']}")  # fmt: skip
    elif t["cuda_build"] and not t["cuda_available"]:
        visible = t["cuda_visible_devices"]
        why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no device or driver"
        add("info", f"torch is built for CUDA {t['cuda_build']} but sees no GPU ({why})")

    if backends is None:
        add("error", f"the backend registry failed: {backend_error}")
    else:
        entries = backends["backends"]
        if not entries:
            add("error", "no backend is installed: `pip install lmcache-platform-cpu` "
                         "(and lmcache-platform-cuda on GPU hosts)")  # fmt: skip
        for b in entries:
            if b["status"] == "failed":
                add("warning", f"backend {b['name']} ({b['distribution']} {b['version']}) failed "
                               f"to load: {b['reason']}; see `lmcache-platform list`")  # fmt: skip
        for device_type, entry in backends["device_types"].items():
            mine = [b for b in entries if b["device_type"] == device_type]
            if entry["ambiguous"]:
                add("warning", f"several backends serve {device_type}: choose one with "
                               "LMCACHE_PLATFORM_BACKEND=<name>")  # fmt: skip
            elif entry["error"] and not any(b["status"] == "failed" for b in mine):
                reasons = "; ".join(f"{b['name']}: {b['reason'] or b['status']}" for b in mine)
                add("info", f"{device_type} is not usable on this host ({reasons})")
        served = {b["device_type"] for b in entries}
        if t["cuda_available"] and "cuda" not in served:
            add("info", "a GPU is visible but no cuda backend is installed: "
                        "`pip install lmcache-platform-cuda`")  # fmt: skip
        if "cpu" in served and (backends["device_types"].get("cpu") or {}).get("selected") is None:
            add("error", "no usable backend serves the cpu device type; see `lmcache-platform list`")
    for backend, resources in r["stale_resources"].items():
        add("warning", f"{len(resources)} resource(s) of dead processes left by {backend}: "
                       "reclaim them with `lmcache-platform gc --yes`")  # fmt: skip

    shm = r["shm"]
    fix = ("enlarge it (Docker: `--shm-size=16g`; Kubernetes: an emptyDir volume with "
           "medium: Memory on /dev/shm) or use the cpu.file backend "
           "(`pip install lmcache-platform-cpu-file`, LMCACHE_PLATFORM_BACKEND=cpu.file) "
           "on a large tmpfs or local disk")  # fmt: skip
    if shm["error"]:
        add("warning", f"{SHM_PATH} is not usable ({shm['error']}): {fix}")
    elif shm["total_bytes"] < SHM_MIN_BYTES:
        add("warning", f"{SHM_PATH} is only {_gib(shm['total_bytes'])} (CPU KV caches live "
                       f"there): {fix}")  # fmt: skip
    elif shm["free_bytes"] < SHM_MIN_BYTES:
        add("warning", f"{SHM_PATH} has only {_gib(shm['free_bytes'])} free of "
                       f"{_gib(shm['total_bytes'])}: free it or {fix}")  # fmt: skip
    return hints


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def format_text(r: dict[str, Any]) -> str:
    p, t, shm = r["python"], r["torch"], r["shm"]
    lines = [f"python    {p['version']} ({p['implementation']}) {p['executable']}"]
    if t["installed"]:
        build = (f"CUDA {t['cuda_build']}" if t["cuda_build"]
                 else f"HIP {t['hip_build']}" if t["hip_build"] else "CPU-only")  # fmt: skip
        devices = ", ".join(f"{d['index']}: {d['name']}" for d in t["devices"]) or "none visible"
        lines.append(f"torch     {t['version']} ({build}); GPUs: {devices}")
    else:
        lines.append("torch     not installed")
    backends = r["backends"]
    if "error" in backends:
        lines.append(f"backends  registry failed: {backends['error']}")
    else:
        for b in backends["backends"]:
            chosen = " (selected)" if b["selected"] else ""
            reason = f": {b['reason']}" if b["reason"] else ""
            lines.append(
                f"backend   {b['name']:<10} {b['distribution'] or '(manual)'} "
                f"{b['version'] or ''} {b['status']}{chosen}{reason}"
            )
        if not backends["backends"]:
            lines.append("backends  none installed")
    if shm["error"]:
        lines.append(f"shm       {shm['path']}: {shm['error']}")
    else:
        lines.append(f"shm       {shm['path']}: {_gib(shm['free_bytes'])} free of "
                     f"{_gib(shm['total_bytes'])}")  # fmt: skip
    for h in r["hints"]:
        lines.append(f"{h['level']:<9} {h['message']}")
    lines.append("ok" if r["ok"] else "problems found")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0 if report["ok"] else 1

"""``lmcache-platform doctor``: what this host offers the platform layer, and what to fix.

Every probe is isolated: a missing torch, a broken backend or a backend's doctor hook
raising becomes a finding with a hint, never a crash. What is specific to a backend
(where its memory lives, how much room is left) comes from the optional
``lmcache_platform_doctor`` hook of the backend selected for each device type, so
doctor reports on what actually serves. ``--json`` prints::

    {"schema": 2, "ok": bool,
     "python": {"version", "implementation", "executable", "platform"},
     "torch": {"installed", "version", "cuda_build", "hip_build", "cuda_available",
               "devices": [{"index", "name"}], "cuda_visible_devices", "error"},
     "backends": <the `lmcache-platform list --json` report, remote stores included>,
     "vllm": {"installed", "version", "connector", "error"},
     "stale_resources": {"<backend>": ["<resource>", ...]},
     "findings": [{"backend", "device_type", "level", "message"}],
     "hints": [{"level": "error" | "warning" | "info", "message"}]}

Schema 2 replaced schema 1's ``shm`` section by the backends' ``findings``; ``vllm`` was
added to it later: whether vLLM and the connector (``lmcache_platform.vllm``) import in
this Python, tried in a child process (importing vLLM takes seconds and may fail
natively), so "why no hits?" starts from one command. Exit status
1 when a hint has level ``error`` (nothing could serve KV caches on this host as it
stands), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

from .._env import BACKEND_ENV

SCHEMA = 2


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
        "installed": False,
        "version": None,
        "cuda_build": None,
        "hip_build": None,
        "cuda_available": False,
        "devices": [],
        "error": None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
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


def _vllm() -> dict[str, Any]:
    """Whether vLLM and the connector import in this interpreter, tried in a child process."""
    import importlib.util
    import subprocess

    out: dict[str, Any] = {"installed": False, "version": None, "connector": False, "error": None}
    if importlib.util.find_spec("vllm") is None:
        return out
    out["installed"] = True
    code = "import vllm; print(vllm.__version__); import lmcache_platform.vllm"
    try:
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=_VLLM_IMPORT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        out["error"] = f"importing vllm took over {_VLLM_IMPORT_TIMEOUT_S} s"
        return out
    lines = child.stdout.splitlines()
    out["version"] = lines[0] if lines else None
    if child.returncode == 0:
        out["connector"] = True
    else:
        errors = [line for line in child.stderr.splitlines() if line and not line.startswith(" ")]
        out["error"] = errors[-1] if errors else f"exit status {child.returncode}"
    return out


#: How long ``import vllm`` may take in the child (it imports torch and much more).
_VLLM_IMPORT_TIMEOUT_S = 300


def _backends() -> tuple[dict[str, Any] | None, dict[str, list[str]], str | None]:
    from . import gc as _gc
    from . import list as _list

    try:
        report = _list.collect(load=True)
        stale, _failed = _gc.reclaim(dry_run=True)
    except Exception as exc:  # the registry itself failing is the finding
        return None, {}, f"{type(exc).__name__}: {exc}"
    return report, {k: v for k, v in stale.items() if v}, None


def _findings(backends: dict[str, Any] | None) -> list[dict[str, str]]:
    """Each selected backend's own lines, from its optional ``lmcache_platform_doctor`` hook."""
    from .._plugins.registry import REGISTRY
    from .._types import DoctorFinding

    out: list[dict[str, str]] = []
    for device_type, entry in (backends or {}).get("device_types", {}).items():
        name = entry["selected"]
        if name is None:
            continue
        try:
            answer = REGISTRY.call(name, "lmcache_platform_doctor", device_type=device_type)
            found = [] if answer is None else [*answer]
            bad = [f for f in found if not isinstance(f, DoctorFinding)]
            if bad:
                raise TypeError(f"returned {bad[0]!r}, not a DoctorFinding")
        except Exception as exc:  # a backend's bug is a finding, never a crash
            found = [
                DoctorFinding.warning(
                    f"its lmcache_platform_doctor hook failed: {type(exc).__name__}: {exc}".replace("\n", " ")
                )
            ]
        out += [
            {"backend": name, "device_type": device_type, "level": f.level, "message": f.message}
            for f in found
        ]
    return out


def collect() -> dict[str, Any]:
    """Run every probe and derive the hints."""
    report: dict[str, Any] = {"schema": SCHEMA, "python": _python(), "torch": _torch(), "vllm": _vllm()}
    backends, stale, backend_error = _backends()
    report["backends"] = backends if backends is not None else {"error": backend_error}
    report["stale_resources"] = stale
    report["findings"] = _findings(backends)
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
        add(
            "error",
            f"torch is not importable ({t['error']}); install the torch build your "
            "engine uses (CPU, CUDA or ROCm), e.g. `pip install torch`",
        )
    elif t["error"]:
        add("warning", f"{t['error']}; check the NVIDIA driver against torch's CUDA {t['cuda_build']}")
    elif t["cuda_build"] and not t["cuda_available"]:
        visible = t["cuda_visible_devices"]
        why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no device or driver"
        add("info", f"torch is built for CUDA {t['cuda_build']} but sees no GPU ({why})")

    if backends is None:
        add("error", f"the backend registry failed: {backend_error}")
    else:
        entries = backends["backends"]
        if not entries:
            add(
                "error",
                "no backend is installed: `pip install lmcache-platform-cpu` "
                "(and lmcache-platform-cuda on GPU hosts)",
            )
        for b in entries:
            if b["status"] == "failed":
                add(
                    "warning",
                    f"backend {b['name']} ({b['distribution']} {b['version']}) failed "
                    f"to load: {b['reason']}; see `lmcache-platform list`",
                )
        for device_type, entry in backends["device_types"].items():
            # cpu is what every host must serve; other device types may be absent here.
            level = "error" if device_type == "cpu" else "warning"
            mine = [b for b in entries if b["device_type"] == device_type]
            if entry["ambiguous"]:
                equals = [b["name"] for b in mine if b["status"] == "ok"]
                add(
                    level,
                    f"{device_type} is ambiguous: {', '.join(equals)} can all serve it and "
                    f"none is the primary backend {device_type!r}; choose one with "
                    f"{BACKEND_ENV}={equals[0]} (the same for engine and server)",
                )
            elif entry["selected"] is None and entry.get("explicit"):
                # The selection error says it all: what was chosen, its state, why, what to do.
                add(
                    level,
                    (entry["error"] or f"{BACKEND_ENV} chooses a backend that cannot serve").splitlines()[0],
                )
            elif entry["selected"] is None and not any(b["status"] == "failed" for b in mine):
                reasons = "; ".join(f"{b['name']}: {b['reason'] or b['status']}" for b in mine)
                add(
                    "error" if device_type == "cpu" else "info",
                    f"no usable backend serves {device_type} on this host ({reasons})",
                )
            elif entry["selected"] is None and device_type == "cpu":
                add(
                    "error",
                    "no usable backend serves cpu: see the failures above and `lmcache-platform list`",
                )
        served = {b["device_type"] for b in entries}
        if t["cuda_available"] and "cuda" not in served:
            add(
                "info",
                "a GPU is visible but no cuda backend is installed: `pip install lmcache-platform-cuda`",
            )
    v = r["vllm"]
    if v["installed"] and v["error"]:
        what = "vLLM" if v["version"] is None else "the connector (lmcache_platform.vllm)"
        add("warning", f"{what} does not import here: {v['error']}; see docs/vllm.md, Install")
    for backend, resources in r["stale_resources"].items():
        add(
            "warning",
            f"{len(resources)} resource(s) of dead processes left by {backend}: "
            "reclaim them with `lmcache-platform gc --yes`",
        )

    for f in r["findings"]:
        if f["level"] != "info":
            add(f["level"], f"{f['backend']}: {f['message']}")
    return hints


def format_text(r: dict[str, Any]) -> str:
    p, t, backends = r["python"], r["torch"], r["backends"]
    infos = [f for f in r["findings"] if f["level"] == "info"]
    # Columns fit their longest entry, so long backend names (cpu.hugetlb) stay aligned.
    width = max([9, *(len(f["backend"]) for f in infos)]) + 1
    lines = [f"{'python':<{width}}{p['version']} ({p['implementation']}) {p['executable']}"]
    if t["installed"]:
        build = (
            f"CUDA {t['cuda_build']}"
            if t["cuda_build"]
            else f"HIP {t['hip_build']}"
            if t["hip_build"]
            else "CPU-only"
        )
        devices = ", ".join(f"{d['index']}: {d['name']}" for d in t["devices"]) or "none visible"
        lines.append(f"{'torch':<{width}}{t['version']} ({build}); GPUs: {devices}")
    else:
        lines.append(f"{'torch':<{width}}not installed")
    v = r["vllm"]
    if not v["installed"]:
        vllm = "not installed in this Python (the connector runs in vLLM's venv: docs/vllm.md)"
    elif v["connector"]:
        vllm = f"{v['version']}; the connector imports (lmcache_platform.vllm)"
    else:
        vllm = f"{v['version'] or '?'}; does not import (see below)"
    lines.append(f"{'vllm':<{width}}{vllm}")
    if "error" in backends:
        lines.append(f"{'backends':<{width}}registry failed: {backends['error']}")
    else:
        rows = [
            (b["name"], b["distribution"] or "(manual)", b["version"] or "-", b) for b in backends["backends"]
        ]
        cols = [max((len(row[i]) for row in rows), default=0) for i in range(3)]
        for name, dist, version, b in rows:
            chosen = " (selected)" if b["selected"] else ""
            reason = f": {b['reason']}" if b["reason"] else ""
            lines.append(
                f"{'backend':<{width}}{name:<{cols[0]}}  {dist:<{cols[1]}}  {version:<{cols[2]}}  "
                f"{b['status']}{chosen}{reason}"
            )
        if not rows:
            lines.append(f"{'backends':<{width}}none installed")
        for store in backends.get("remote_stores", []):
            reason = f": {store['reason']}" if store["reason"] else ""
            lines.append(
                f"{'remote':<{width}}{store['scheme']}:// {store['distribution'] or '(manual)'} "
                f"{store['version'] or '-'}  {store['status']}{reason}"
            )
    lines += [f"{f['backend']:<{width}}{f['message']}" for f in infos]
    lines += [f"{h['level']:<{width}}{h['message']}" for h in r["hints"]]
    lines.append("ok" if r["ok"] else "problems found")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0 if report["ok"] else 1

"""``lmcache-platform check NAME``: run the conformance suite against an installed backend.

It runs ``pytest --pyargs lmcache_platform.conformance --lmcache-backend NAME`` in a
subprocess, isolated from any pytest configuration of the current directory (a
vendor's own ``addopts`` or plugins must not change the verdict), then prints a
summary. Exit status: 0 conformant; 1 a check failed, or the backend cannot serve
on this host so its device checks were skipped (``--allow-unavailable`` accepts
that, for a CI runner without the device); 2 no such backend is installed, or pytest
is missing (the ``lmcache-platform[check]`` extra installs it), so no verdict is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .._version import API_VERSION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", metavar="NAME", help="backend to check: its entry-point name (cpu, cuda, cpu.file, ...)"
    )
    parser.add_argument("-k", metavar="EXPR", dest="keyword", help="only checks matching EXPR (pytest -k)")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    parser.add_argument("--junitxml", metavar="PATH", help="also write a JUnit XML report (for CI)")
    parser.add_argument(
        "--allow-unavailable",
        action="store_true",
        help="exit 0 when the backend cannot serve here and only its device-free "
        "checks ran (a runner without the device)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the summary as JSON (pytest's output goes to stderr)"
    )


def pytest_command(name: str, workdir: Path, report: Path, args: argparse.Namespace) -> list[str]:
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        "lmcache_platform.conformance",
        "--lmcache-backend",
        name,
        "-c",
        str(ini),
        "--rootdir",
        str(workdir),
        "-p",
        "no:cacheprovider",
        "-p",
        "lmcache_platform.conformance._report",
        "--lmcache-report",
        str(report),
        "-q",
        "-rfEs",
    ]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        cmd += ["-p", "lmcache_platform.conformance.plugin"]  # it carries --lmcache-backend
    if args.keyword:
        cmd += ["-k", args.keyword]
    if args.exitfirst:
        cmd.append("-x")
    if args.junitxml:
        cmd += ["--junitxml", os.path.abspath(args.junitxml)]
    return cmd


#: What ``check`` needs beyond core, and the command that installs it.
INSTALL_CHECK = 'pip install "lmcache-platform[check]"'


def run(args: argparse.Namespace) -> int:
    from ..conformance._target import installed_names

    if importlib.util.find_spec("pytest") is None:  # the suite is pytest tests: no verdict without it
        print(
            f"lmcache-platform check: the conformance suite runs on pytest, which is not installed "
            f"in this environment ({sys.prefix}); install it with: {INSTALL_CHECK}",
            file=sys.stderr,
        )
        return 2
    installed = installed_names()
    if args.name not in installed:
        print(
            f"lmcache-platform check: no installed backend is named {args.name!r} "
            f"(installed: {', '.join(installed) or 'none'})",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmcache-check-") as tmp:
        workdir = Path(tmp)
        report_path = workdir / "report.json"
        cmd = pytest_command(args.name, workdir, report_path, args)
        out = sys.stderr if args.json else sys.stdout
        out.flush()
        proc = subprocess.run(cmd, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, check=False)
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    summary = summarize(
        args.name,
        proc.returncode,
        report,
        time.perf_counter() - started,
        allow_unavailable=args.allow_unavailable,
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0 if summary["ok"] else 1


def summarize(
    name: str, returncode: int, report: dict[str, Any] | None, seconds: float, *, allow_unavailable: bool
) -> dict[str, Any]:
    results = report["results"] if report else []
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for r in results:
        counts[r["outcome"]] += 1
    skipped = [r for r in results if r["outcome"] == "skipped"]
    backend = (report or {}).get("backend") or {"name": name}
    unavailable = backend.get("unavailable") or ""
    passed = returncode == 0 and counts["passed"] > 0
    return {
        "backend": backend,
        "api_version": API_VERSION,
        "ok": passed and (allow_unavailable or not unavailable),
        "verdict": "fail" if not passed else "not verified" if unavailable else "pass",
        "pytest_exit_status": returncode,
        "counts": counts,
        "seconds": round(seconds, 2),
        "results": [{"test": r["test"], "outcome": r["outcome"]} for r in results],
        "failures": [r for r in results if r["outcome"] in ("failed", "error")],
        "skips": sorted({r.get("detail", "").removeprefix("Skipped: ") for r in skipped}),
    }


def format_summary(s: dict[str, Any]) -> str:
    b, c = s["backend"], s["counts"]
    where = ""
    if "device_type" in b:
        where = f" ({b['distribution']} {b['version']}), device type {b['device_type']}"
    lines = [
        "",
        f"lmcache-platform check {b['name']}: {s['verdict'].upper()}"
        + (f" (it cannot serve on this host: {b['unavailable']})" if s["verdict"] == "not verified" else ""),
        f"  backend {b['name']}{where}; core backend API {s['api_version']}",
        f"  {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
        f"in {s['seconds']:.1f} s",
    ]
    for r in s["failures"]:
        detail = r["detail"].splitlines() or [""]
        first = next((ln for ln in detail if ln.startswith("E ")), detail[0])
        lines.append(f"  {r['outcome'].upper():6} {r['test']}: {first.removeprefix('E').strip()}")
    lines += [f"  SKIP   {reason}" for reason in s["skips"]]
    if s["verdict"] == "fail" and not s["failures"]:
        lines.append(f"  pytest exited with status {s['pytest_exit_status']} (see its output above)")
    return "\n".join(lines)

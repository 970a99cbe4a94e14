"""``lmcache-platform check NAME``: run the conformance suite against an installed backend.

``lmcache-platform check --remote URL`` runs the remote-store conformance suite
(``lmcache_platform.remote.conformance``) against a live store instead, the same way;
``--remote-stalled URL`` and ``--remote-refused URL`` name the broken instances its
timeout checks call (by default the URL's hosts are replaced by loopback ones). Where
those checks cannot run (a URL without hosts and no such flags), the verdict says
``PASS (timeouts not checked)``.

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
from ._remote import add_access_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        metavar="NAME",
        nargs="?",
        help="backend to check: its entry-point name (cpu, cuda, cpu.file, ...)",
    )
    remote = parser.add_argument_group("remote stores (instead of NAME)")
    remote.add_argument(
        "--remote", metavar="URL", help="check the remote store URL names (valkey://host:6379/0, ...)"
    )
    remote.add_argument(
        "--remote-option", metavar="KEY=VALUE", action="append", default=[], help="a store setting"
    )
    add_access_arguments(remote)
    for kind, what in _BROKEN.items():
        remote.add_argument(
            f"--remote-{kind}",
            metavar="URL",
            help=f"the store at a {what}, for the timeout checks (default: URL's hosts replaced by a "
            "loopback one; a URL without hosts needs this flag, else the timeouts are not checked)",
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


#: The broken instances the timeout checks call: ``--remote-KIND URL``, what each one is.
_BROKEN = {
    "stalled": "server (or backing file, mount, lock) that never answers",
    "refused": "server that refuses connections (or a backing that fails at once)",
}
#: The remote suite's checks that need the broken instances.
_TIMEOUT_CHECK = "test_timeouts_honoured"


def pytest_command(name: str, workdir: Path, report: Path, args: argparse.Namespace) -> list[str]:
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    remote = getattr(args, "remote", None)
    suite = ["lmcache_platform.remote.conformance", "--lmcache-remote", remote] if remote else None
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        *(suite or ["lmcache_platform.conformance", "--lmcache-backend", name]),
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
        "-rfE",  # no "s": pytest repeats a skip reason per test location; the summary counts them
    ]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        cmd += ["-p", "lmcache_platform.conformance.plugin"]  # it carries --lmcache-backend
        if remote:
            cmd += ["-p", "lmcache_platform.remote.conformance.plugin"]
    if remote:
        for item in args.remote_option:
            cmd += ["--lmcache-remote-option", item]
        if args.remote_password_env:
            cmd += ["--lmcache-remote-password-env", args.remote_password_env]
        for kind in _BROKEN:
            if getattr(args, f"remote_{kind}", None):
                cmd += [f"--lmcache-remote-{kind}", getattr(args, f"remote_{kind}")]
        for flag in ("password_file", "tls_ca", "tls_cert", "tls_key"):  # paths: pytest runs elsewhere
            path = getattr(args, f"remote_{flag}")
            if path:
                cmd += [f"--lmcache-remote-{flag.replace('_', '-')}", os.path.abspath(path)]
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
    if args.remote or not args.name:
        if bool(args.remote) == bool(args.name):
            print("lmcache-platform check: give a backend NAME or --remote URL", file=sys.stderr)
            return 2
        args.name = args.remote
    installed = installed_names()
    if not args.remote and args.name not in installed:
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
    if args.remote:
        from ..remote import REMOTE_API_VERSION

        summary["backend"]["kind"] = "remote store"
        summary["api_version"] = REMOTE_API_VERSION
        unchecked = [r for r in summary["results"] if r["test"].split("[")[0].endswith(_TIMEOUT_CHECK)]
        if summary["verdict"] == "pass" and any(r["outcome"] == "skipped" for r in unchecked):
            summary["unchecked"] = ["timeouts"]
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
    skips: dict[str, int] = {}
    for r in results:
        if r["outcome"] == "skipped":
            reason = r.get("detail", "").removeprefix("Skipped: ")
            skips[reason] = skips.get(reason, 0) + 1
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
        "skips": sorted(skips),
        "skip_counts": dict(sorted(skips.items())),
    }


def format_summary(s: dict[str, Any]) -> str:
    b, c = s["backend"], s["counts"]
    where = ""
    if "device_type" in b:
        where = f" ({b['distribution']} {b['version']}), device type {b['device_type']}"
    lines = [
        "",
        f"lmcache-platform check {b['name']}: {s['verdict'].upper()}"
        + (f" (it cannot serve on this host: {b['unavailable']})" if s["verdict"] == "not verified" else "")
        + (f" ({', '.join(s['unchecked'])} not checked)" if s.get("unchecked") else ""),
        f"  {b.get('kind', 'backend')} {b['name']}{where}; core "
        f"{'remote-store' if 'kind' in b else 'backend'} API {s['api_version']}",
        f"  {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
        f"in {s['seconds']:.1f} s",
    ]
    for r in s["failures"]:
        detail = r["detail"].splitlines() or [""]
        first = next((ln for ln in detail if ln.startswith("E ")), detail[0])
        lines.append(f"  {r['outcome'].upper():6} {r['test']}: {first.removeprefix('E').strip()}")
    for reason, count in s["skip_counts"].items():
        lines.append(f"  SKIP   {count} {'check' if count == 1 else 'checks'}: {reason}")
    if s.get("unchecked"):
        lines.append(
            "  the timeout checks need a stalled and a refusing instance of the store: "
            "--remote-stalled URL and --remote-refused URL (docs/remote-stores.md)"
        )
    if s["verdict"] == "fail" and not s["failures"]:
        lines.append(f"  pytest exited with status {s['pytest_exit_status']} (see its output above)")
    return "\n".join(lines)

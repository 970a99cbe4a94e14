"""The conformance suite run as a vendor runs it: ``lmcache-platform check`` or pytest, in a subprocess.

The child gets this environment without our selections (``LMCACHE_PLATFORM_*``) or
pytest's own variables (``PYTEST_*``), so it sees only the backends installed, plus
what a test adds (a site dir on ``PYTHONPATH``, a backend's fault switches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from lmcache_platform.testing import make_distribution


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_PLATFORM_", "PYTEST_"))}
    return {**env, **extra}


def check(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 900
) -> tuple[int, dict[str, Any], str]:
    """``lmcache-platform check ... --json``: exit status, summary (empty if none), stderr."""
    command = [sys.executable, "-m", "lmcache_platform._cli", "check", *args, "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr


def pytest_suite(
    backend: str, junit: Path, *, env: dict[str, str], cwd: Path, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``pytest --pyargs lmcache_platform.conformance --lmcache-backend BACKEND``, with a JUnit report."""
    args = ["--pyargs", "lmcache_platform.conformance", "--lmcache-backend", backend, *extra]
    command = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


def junit_outcomes(junit: Path) -> dict[str, str]:
    """Test name -> ``passed``, ``failure``, ``error`` or ``skipped``, from a JUnit report."""
    result: dict[str, str] = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        result[case.get("name", "")] = kind
    return result


def one_module_backend(site: Path, name: str, source: str) -> Path:
    """Install backend ``name`` (entry point ``name`` -> module ``<name>_backend``) into ``site``.

    The faulty backends of the conformance tests: one module each, as a real distribution
    ``<name>-backend`` in a site dir a child process gets on ``PYTHONPATH``.
    """
    module = name.rsplit(".", 1)[-1] + "_backend"
    make_distribution(
        site, module.replace("_", "-"), "0.0.1", entry_points={name: module}, files={f"{module}.py": source}
    )
    return site

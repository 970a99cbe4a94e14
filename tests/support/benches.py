"""The benchmarks of ``tests/bench`` run as a person runs them, for the suite's smoke runs.

``python -m bench.<name> ... --json`` with ``tests`` on ``PYTHONPATH`` (the Makefile's
``bench-*`` targets and ``docs/performance.md`` run them so), in a process of its own
with the interpreter given: ``.venv``'s, or the vLLM venv's for what needs vLLM. The
smoke tests check the document's shape, never a speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(name: str, *args: str, python: Path | str = sys.executable, timeout: float = 600) -> Any:
    """Run benchmark ``bench.<name>`` with ``args`` and ``--json``; its JSON document.

    Fails the calling test with the benchmark's output when it exits non-zero or prints
    anything but one JSON document on stdout.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [str(python), "-m", f"bench.{name}", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    where = (
        f"bench.{name} {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    assert proc.returncode == 0, where
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not one JSON document ({exc}): {where}") from None

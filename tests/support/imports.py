"""What a module imports, and what a fresh interpreter has imported, for the tests that keep imports light."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Mapping
from typing import NamedTuple


def non_stdlib_imports(source: str) -> list[str]:
    """Absolute modules ``source`` imports outside the standard library (relative imports skipped)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        out += [m for m in modules if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"]
    return out


class FreshRun(NamedTuple):
    """What :func:`fresh_run`'s interpreter printed, and the modules it had imported by the end."""

    stdout: str
    modules: frozenset[str]


def fresh_run(code: str, env: Mapping[str, str] | None = None) -> FreshRun:
    """Run ``code`` in a fresh interpreter (``env``: its whole environment).

    Fresh, because this process has long imported whatever the suite needed: only a new
    interpreter shows which modules ``code`` itself pulls in.
    """
    tail = "\nimport json as _json, sys as _sys\nprint(_json.dumps(sorted(_sys.modules)))\n"
    cmd = [sys.executable, "-c", code + tail]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    printed, _, modules = out.rstrip("\n").rpartition("\n")
    return FreshRun(printed, frozenset(json.loads(modules)))

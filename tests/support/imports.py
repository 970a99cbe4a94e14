"""What a module imports, for the tests that hold a backend to the public core API."""

from __future__ import annotations

import ast
import sys


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

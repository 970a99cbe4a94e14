"""The overview's code map names every module of core, so the map cannot go stale."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "core" / "src" / "lmcache_platform"


def mapped_patterns() -> list[str]:
    """Path patterns from the first column of the code map (``_cli/list.py``, ``doctor.py``...)."""
    text = (ROOT / "docs" / "overview.md").read_text()
    table = text.split("## Code map", 1)[1]
    patterns: list[str] = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in token:
                folder = token.rsplit("/", 1)[0] + "/"
                patterns.append(token + "__init__.py" if token.endswith("/") else token)
            else:
                patterns.append(folder + token)
    return patterns


def test_every_module_of_core_is_in_the_code_map() -> None:
    patterns = mapped_patterns()
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))
    missing = [m for m in modules if not any(fnmatch.fnmatch(m, p) for p in patterns)]
    assert missing == [], f"docs/overview.md's code map does not name: {missing}"
    stale = [p for p in patterns if not any(fnmatch.fnmatch(m, p) for m in modules)]
    assert stale == [], f"docs/overview.md's code map names modules that do not exist: {stale}"

"""The author guide's sealed-memfd backend, taken from the guide as printed, built and checked.

``docs/backend-authors.md`` shows a complete ``cpu.sealed`` backend inline (a store with a
structured handle). Its code blocks are the backend: each starts with a comment naming
its file. This test writes them into a distribution, checks that they use the public API
only and fit in 200 lines (the number the guide states, too), and runs the whole
conformance suite on the result.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache_platform.testing import make_distribution
from support.conformance import check, clean_env
from support.imports import non_stdlib_imports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "backend-authors.md"
PUBLIC = {"lmcache_platform", "lmcache_platform.hostmem"}
LIMIT = 200


def example() -> tuple[str, dict[str, str]]:
    """The section's prose and its blocks: path (from each block's first line) -> text."""
    text = GUIDE.read_text()
    section = text.split("### A structured handle: a sealed-memfd backend", 1)[1].split("**Other devices.**")[
        0
    ]
    blocks = re.findall(r"```(?:toml|python)\n(.*?)```", section, re.S)
    files = {}
    for block in blocks:
        first = block.splitlines()[0]
        assert first.startswith("# "), f"a block of the example does not name its file: {first!r}"
        files[first[2:].strip()] = block
    return section, files


def test_the_example_fits_in_200_lines_as_the_guide_says_and_uses_the_public_api_only() -> None:
    prose, files = example()
    assert set(files) == {
        "pyproject.toml",
        "src/lmcache_platform_cpu_sealed/_plugin.py",
        "src/lmcache_platform_cpu_sealed/_memory.py",
    }
    total = sum(len(block.splitlines()) for block in files.values())
    stated = re.search(r"and (\d+) lines in all", prose)
    assert stated and int(stated.group(1)) == total <= LIMIT, (total, stated)
    for path, source in files.items():
        if path.endswith(".py"):
            private = [m for m in non_stdlib_imports(source) if m not in PUBLIC]
            assert not private, f"{path} imports {private}, which is not public API"


def test_the_example_passes_the_whole_conformance_suite(tmp_path: Path) -> None:
    _, files = example()
    toml = files["pyproject.toml"]  # read by pattern: tomllib is 3.11+
    dist, version = (re.search(rf'^{key} = "([^"]+)"', toml, re.M).group(1) for key in ("name", "version"))  # type: ignore[union-attr]
    entry_points = toml.split('[project.entry-points."lmcache.platform"]\n', 1)[1]
    ((name, target),) = re.findall(r'^"([^"]+)" = "([^"]+)"$', entry_points, re.M)
    sources = {path.removeprefix("src/"): text for path, text in files.items() if path.endswith(".py")}
    sources[f"{target.split('.')[0]}/__init__.py"] = ""
    site = tmp_path / "site"
    make_distribution(site, dist, version, entry_points={name: target}, files=sources)
    code, summary, stderr = check(name, env=clean_env(PYTHONPATH=str(site)), cwd=tmp_path)
    assert code == 0 and summary.get("verdict") == "pass", stderr[-4000:]
    assert summary["backend"]["distribution"] == "lmcache-platform-cpu-sealed"
    counts = summary["counts"]
    assert counts["failed"] == counts["error"] == counts["skipped"] == 0, summary["skips"]
    assert any("test_hostmem.py" in r["test"] for r in summary["results"])

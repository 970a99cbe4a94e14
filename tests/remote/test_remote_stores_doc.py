"""docs/remote-stores.md's smoke test, run as printed, with the file store as "your store".

The page's ``smoke.py`` client and its ``console`` block are read from the page, not
copied here. Placed: the store's URL (``mystore:///tmp/smoke/store.db`` becomes a file
store in a temporary directory) and ``/tmp/smoke`` (a private temporary directory). The
block runs through ``bash -e`` (a failing line fails it) with this venv's ``bin`` first
on ``PATH``: two real ``serve`` processes, the second with empty memory, so the chunks
the second client gets came from the store.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "remote-stores.md"


def block(language: str, text: str) -> str:
    found = [
        b for b in re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.M | re.S) if text in b
    ]
    assert len(found) == 1, f"{DOC}: {len(found)} {language} blocks with {text!r}"
    return found[0]


def test_the_smoke_test_walks_chunks_through_serve_and_back_from_the_store(tmp_path: Path) -> None:
    smoke, store = tmp_path / "smoke", tmp_path / "store"
    (tmp_path / "smoke.py").write_text(block("python", "python smoke.py SOCKET put|get"))
    script = block("console", "python smoke.py").replace("mystore:///tmp/smoke/store.db", f"file://{store}")
    script = script.replace("/tmp/smoke", str(smoke))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("LMCACHE_PLATFORM_SOCKET", None)
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = "".join(p.read_text() for p in sorted(smoke.glob("*.log")))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    lines = done.stdout.splitlines()
    assert lines[:2] == ["stored 4 chunks", "got 4 chunks, bytes match"], done.stdout
    rows = dict(line.split(None, 1) for line in lines[2:])
    assert rows["remote.state"] == "healthy" and rows["remote.fetched"] == "4", rows
    assert len([p for p in store.iterdir() if p.name.startswith("e.")]) == 4  # the entries, on disk
    prose = " ".join(DOC.read_text().split())
    assert "prints `stored 4 chunks`" in prose and "`got 4 chunks, bytes match`" in prose

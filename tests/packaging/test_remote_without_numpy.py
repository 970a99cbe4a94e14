"""The remote tier in a venv without numpy (a dependency of nothing here), and in one without blake3.

Entries are encoded through a ``ctypes`` view of the tensor's bytes, never ``Tensor.numpy()``;
a tier that cannot encode (its checksum package missing) refuses to start, and ``serve``
says so in one line, rather than lose every chunk later.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.serve import private_dir
from support.venvs import make_venv

pytestmark = pytest.mark.slow

ROUND_TRIP = """
import importlib.util, sys, torch
from lmcache_platform.remote._tier import RemoteTier
assert importlib.util.find_spec("numpy") is None, "numpy is visible"
tier = RemoteTier.open("file://" + sys.argv[1], prefix="t")
assert tier.wait_ready(10), tier.stats()
chunk = [torch.arange(4096, dtype=torch.float32).reshape(8, 512), torch.ones(3, dtype=torch.bfloat16)]
assert tier.write_behind(b"ns", b"k" * 16, chunk) and tier.flush(10)
(got,) = tier.fetch(b"ns", [b"k" * 16])
assert got is not None and all(torch.equal(a, b) for a, b in zip(chunk, got.tensors))
s = tier.stats()
tier.close()
print(s["written"], s["write_errors"], s["fetched"], "numpy" in sys.modules)
"""


def run(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=120, check=False)


def test_entries_round_trip_without_numpy(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv", hide=["numpy"])
    out = run(python, "-c", ROUND_TRIP, str(tmp_path / "kv"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "1", "False"]


def test_a_tier_that_cannot_encode_stops_serve_with_one_line(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv", hide=["blake3"])
    sock = private_dir(tmp_path, "s") / "kv.sock"
    out = run(
        python, "-m", "lmcache_platform._cli", "serve", "--socket", str(sock),
        "--remote", f"file://{tmp_path / 'kv'}",
    )  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "cannot start: remote tier: remote file://" in lines[0]
    assert "cannot write remote entries (ModuleNotFoundError: No module named 'blake3')" in lines[0]
    assert "pip install torch blake3" in lines[0]

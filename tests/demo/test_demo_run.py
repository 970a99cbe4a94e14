"""``lmcache-platform demo``: it runs, checks every byte, reports, and leaves nothing behind.

Sizes are tiny to keep the suite fast; the default (32-layer) run is the README's
main job and is not repeated here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_platform._cli import demo as _demo
from lmcache_platform.server import ServerClient

SMALL = [
    "--layers",
    "3",
    "--kv-heads",
    "2",
    "--head-size",
    "16",
    "--block-size",
    "4",
    "--chunk-tokens",
    "16",
    "--chunks",
    "3",
]
SHM = Path("/dev/shm")


def segments_of(pid: int) -> set[str]:
    """Our backend's segment names embed the producer's pid: ``..._<pidns>_<pid>_<hex>``."""
    return {p.name for p in SHM.glob(f"lmcache_platform_*_{pid}_*")}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _demo.add_arguments(parser)
    return parser.parse_args(argv)


def expected_bytes(layers: int, heads: int, head: int, blocks: int, block: int, item: int) -> int:
    return layers * 2 * blocks * block * heads * head * item


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point mkdtemp here, so a leftover socket directory would show up."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path


def test_cli_json_run_in_a_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "lmcache_platform._cli", "demo", "--json", *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out)

    assert report["schema"] == 1 and report["ok"] is True and report["error"] is None
    assert report["backend"] == {
        "name": "cpu",
        "device_type": "cpu",
        "distribution": "lmcache-platform-cpu",
        "version": report["backend"]["version"],
    }
    assert report["backend"]["version"]
    assert report["server_backend"]["name"] == "cpu"
    cfg = report["config"]
    # The default is current vLLM's layout, in the CPU engine's physical order.
    assert cfg["num_blocks"] == 2 * 3 * (16 // 4) and cfg["format"] == "vllm"
    assert cfg["engine_layout"] == "LBHNC"
    kv = expected_bytes(3, 2, 16, cfg["num_blocks"], 4, 2)
    chunk = 3 * 2 * 16 * 2 * 16 * 2
    assert report["sizes"]["kv_cache_bytes"] == kv
    assert report["sizes"]["chunk_bytes"] == chunk and report["sizes"]["moved_bytes"] == 3 * chunk
    assert 0 < report["sizes"]["handoff_message_bytes"] < 4096
    assert report["verify"] == {
        "ok": True,
        "bytes_checked": kv,
        "mismatched_bytes": 0,
        "first_mismatch": None,
    }
    for step in ("server_start", "wrap", "handoff", "store", "retrieve", "verify"):
        t = report["timings"][step]
        assert set(t) == {"seconds", "bytes", "gb_per_s"} and t["seconds"] > 0
    assert report["timings"]["store"]["bytes"] == 3 * chunk

    assert not segments_of(proc.pid), "the demo left shared-memory segments behind"
    assert list(tmp_path.iterdir()) == [], "the demo left its socket directory behind"


def test_text_output_names_the_backend_and_every_step(
    capsys: pytest.CaptureFixture[str], private_tmp: Path
) -> None:
    before = segments_of(os.getpid())
    assert _demo.run(parse([*SMALL, "--format", "flash_attn_hnd", "--dtype", "float16"])) == 0
    out = capsys.readouterr().out
    assert "cpu (lmcache-platform-cpu" in out and "float16, flash_attn_hnd" in out
    for label in ("wrap", "hand-off", "store", "retrieve", "GB/s", " 0 mismatched: OK"):
        assert label in out
    assert segments_of(os.getpid()) <= before
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize(("fmt", "layout"), [("vllm", "BLHNC"), ("vllm", "LBNHC"), ("vllm_mla", "LBNHC")])
def test_current_vllm_layouts_round_trip(
    fmt: str, layout: str, capsys: pytest.CaptureFixture[str], private_tmp: Path
) -> None:
    argv = [*SMALL, "--format", fmt, "--engine-layout", layout, "--json"]
    if fmt == "vllm_mla":
        argv += ["--kv-heads", "1"]
    assert _demo.run(parse(argv)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["engine_layout"] == layout
    assert report["verify"]["ok"] and report["verify"]["mismatched_bytes"] == 0
    assert list(private_tmp.iterdir()) == []


def test_engine_layout_is_refused_for_the_older_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert _demo.run(parse([*SMALL, "--format", "flash_attn", "--engine-layout", "LBHNC", "--json"])) == 2
    assert "--engine-layout applies to the vllm formats" in json.loads(capsys.readouterr().out)["error"]


def test_mla_round_trips(capsys: pytest.CaptureFixture[str], private_tmp: Path) -> None:
    """The other formats are covered by the cpu backend's own tests; MLA has no head axis."""
    assert _demo.run(parse([*SMALL, "--format", "mla", "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verify"]["ok"] and report["verify"]["mismatched_bytes"] == 0
    assert report["sizes"]["kv_cache_bytes"] == 3 * 24 * 4 * 16 * 2  # layers x blocks x tokens x d
    assert list(private_tmp.iterdir()) == []


def test_misplaced_data_is_detected_and_exits_1(
    capsys: pytest.CaptureFixture[str], private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the engine asks for chunks 0 and 1 swapped. Verification must see it."""
    real_retrieve = ServerClient.retrieve

    def swapped(self: ServerClient, context: int, chunks: Any) -> int:
        chunks = list(chunks)
        (a, ida), (b, idb) = chunks[0], chunks[1]
        chunks[0], chunks[1] = (b, ida), (a, idb)
        return real_retrieve(self, context, chunks)

    monkeypatch.setattr(ServerClient, "retrieve", swapped)
    before = segments_of(os.getpid())
    assert _demo.run(parse([*SMALL, "--json"])) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["error"] is None
    assert report["verify"]["mismatched_bytes"] > 0
    assert report["verify"]["first_mismatch"].startswith("layer 0, block ")
    assert segments_of(os.getpid()) <= before
    assert list(private_tmp.iterdir()) == []


def test_a_failure_midway_exits_2_and_cleans_up(
    capsys: pytest.CaptureFixture[str], private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: ServerClient, context: int, chunks: Any) -> int:
        raise ConnectionResetError("injected: the link dropped")

    monkeypatch.setattr(ServerClient, "store", broken)
    before = segments_of(os.getpid())
    assert _demo.run(parse([*SMALL, "--json"])) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["error"] == "ConnectionResetError: injected: the link dropped"
    assert "wrap" in report["timings"] and "store" not in report["timings"]
    assert segments_of(os.getpid()) <= before
    assert list(private_tmp.iterdir()) == [], "the server's directory survived a failure"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--num-blocks", "10"], "--num-blocks 10 is too small: 3 chunks of 4 blocks need 24"),
        (["--chunk-tokens", "10"], "not a multiple of --block-size 4"),
    ],
)
def test_bad_sizes_are_explained(
    capsys: pytest.CaptureFixture[str], private_tmp: Path, argv: list[str], match: str
) -> None:
    assert _demo.run(parse([*SMALL, *argv, "--json"])) == 2
    assert match in json.loads(capsys.readouterr().out)["error"]


def test_non_positive_sizes_are_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        parse(["--layers", "0"])


def test_cuda_without_a_gpu_is_explained(capsys: pytest.CaptureFixture[str], private_tmp: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible; the cuda run belongs to the cuda-marked suite")
    assert _demo.run(parse([*SMALL, "--device", "cuda", "--json"])) == 2
    assert "torch sees no CUDA device" in json.loads(capsys.readouterr().out)["error"]


@pytest.mark.cuda
def test_cuda_round_trip(capsys: pytest.CaptureFixture[str], private_tmp: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    assert _demo.run(parse([*SMALL, "--device", "cuda", "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"]["device_type"] == "cuda" and report["verify"]["ok"]

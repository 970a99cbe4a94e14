"""The bench's KV sets and its separate engine process, on the host.

Two crashes of ``bench --device cuda`` had host-visible causes: the hand-off set wrote its
corner values through ``view(-1)``, which a layer view in GPU vLLM's ``LBNHC`` order (not
contiguous) refuses; and the transfer section reopened its own CUDA exports. The first is
checked here in every vLLM order; for the second, the section's separate engine process
(always used on CUDA) is run on the host, where both ways work and must agree in shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_platform import KVFormat
from lmcache_platform._bench.child import corner_values
from lmcache_platform._bench.kvsets import EXPECTED_CORNERS, LAYERS, KVSpec, kv_set
from lmcache_platform._bench.stats import Report
from lmcache_platform._bench.transfer import _one_format, _Server

ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


@pytest.mark.parametrize("order", ORDERS)
def test_corner_values_are_written_into_the_engine_memory_in_every_order(order: str) -> None:
    tensors = kv_set(2 << 20, "cpu", engine_layout=order)
    assert corner_values(tensors) == EXPECTED_CORNERS
    backing = torch.empty(0, dtype=torch.float16).set_(tensors[0].untyped_storage())
    for value in (-1, LAYERS, -LAYERS):  # in the memory itself, not in a copy (the rest is 1)
        assert int((backing == value).sum()) == 1


@pytest.mark.parametrize("with_server", [False, True], ids=["contexts", "contexts-and-server"])
def test_the_transfer_section_runs_against_a_separate_engine_process(with_server: bool) -> None:
    sync = lambda: None  # noqa: E731 - the host copies synchronously
    gen = torch.Generator().manual_seed(0)
    with _Server(1, Report()) as server:
        chunk_bytes, rows = _one_format(
            KVSpec(KVFormat.VLLM, "LBNHC", "cpu", num_blocks=16, heads=8, head_size=128),
            1,
            sync,
            gen,
            server if with_server else None,
            separate_engine=True,
        )
    assert chunk_bytes == 256 * LAYERS * 2 * 8 * 128 * 2
    cases = {"store_chunk", "retrieve_chunk", "store_chunk (blocks)", "copy_ (store-shaped)"}
    if with_server:
        cases |= {"server put", "server get (blocks)"}
    assert cases <= set(rows) and all(len(rows[c]) == 1 and rows[c][0] > 0 for c in cases)


def test_the_server_path_runs_on_the_host_and_checks_every_byte(tmp_path: Path) -> None:
    # `bench --section server`, which scripts/gpu-check runs with --device cuda, at the smallest
    # size: a real serve, two engine processes, a fresh, a prepared and an evicting server.
    out = tmp_path / "server.json"
    cmd = [sys.executable, "-m", "lmcache_platform._cli", "bench", "--section", "server"]
    proc = subprocess.run(
        [*cmd, "--chunks", "2", "--per-request", "1", "--save", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = json.loads(out.read_text())
    rows = [r for r in saved["results"] if r["section"] == "server"]
    assert sorted((r["params"]["scenario"], r["case"]) for r in rows) == sorted(
        (s, op) for s in ("fresh", "prepared", "evicting") for op in ("put", "get")
    )
    assert all(r["unit"] == "GB/s" and r["min"] > 0 and r["ratio"] > 0 for r in rows)
    assert {t["name"] for t in saved["targets"]} >= {"server put", "server get"}
    report = saved["meta"]["server"]
    assert [s["scenario"] for s in report["scenarios"]] == ["fresh", "prepared", "evicting"]
    assert report["model"]["chunk_format"] == "blocks"  # as the vLLM connector registers
    for s in report["scenarios"]:
        assert s["bytes_identical"] and s["check"] == {
            "mismatched_elements": 0,
            "spare_nonzero": 0,
            "checked_chunks": 2,
        }
        assert s["put_gb_s"]["requests"] == (4 if s["scenario"] == "evicting" else 2)
        assert s["get_gb_s"]["requests"] == 2 and s["copy_to_host_gb_s"] > 0
        assert len(s["put_gb_s"]["each"]) == s["put_gb_s"]["requests"]
        assert min(s["get_gb_s"]["each"]) == s["get_gb_s"]["min"]
        # timed once the server had mapped each engine's memory, and the wait reported
        assert set(s["engine_mapped_s"]) == {"A", "B"} and min(s["engine_mapped_s"].values()) >= 0
        # on the host nothing is registered with a device; the working set's memory came from the pool
        assert s["host"]["host_registered_bytes"] == 0 and s["host"]["host_register_failures"] == 0
        assert s["host"]["host_prepared_bytes"] + s["host"]["host_slow_takes"] > 0
        # on the host, also against copy_ with the server's one torch thread
        assert s["copy_from_host_server_threads_gb_s"] > 0
        assert (
            s["put_vs_copy_server_threads"] == s["put_gb_s"]["median"] / s["copy_to_host_server_threads_gb_s"]
        )
    evicting = report["scenarios"][2]
    assert evicting["working_set_bytes"] < evicting["max_host_bytes"] < 2 * evicting["working_set_bytes"]
    assert "== A real serve between two engine processes" in proc.stdout

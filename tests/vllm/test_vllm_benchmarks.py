"""Every benchmark of ``tests/bench`` that needs vLLM, run end to end at a tiny size.

Each runs as the Makefile's ``bench-*`` targets run it (``python -m bench.<name>`` with the
vLLM venv's Python, ``support.benches``): real engines, a real ``lmcache-platform serve``
(and ``valkey-server`` for the remote one), one prompt or a few chunks, ``--json``.
Checked: it finishes, its document has every figure, and the facts in it (tokens a hit
loaded, bytes identical after a round trip, chunks stored). Never a speed: the figures
are for people. The benchmarks that run without vLLM are ``tests/benchsmoke``'s.
"""

from __future__ import annotations

from typing import Any

import pytest

from support.benches import run_bench
from support.vllm_engines import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm-benchmarks")]

ONE_CHUNK_PROMPT = ("--prompts", "1", "--prompt-tokens", "300")  # 300 tokens: one chunk of 256 stored


def run(name: str, *args: str) -> Any:
    return run_bench(name, *args, python=vllm_python(), timeout=900)


def test_vllm_ttft_runs() -> None:
    result = run("vllm_ttft", *ONE_CHUNK_PROMPT)
    figures = {"ttft_recompute_s", "ttft_hit_s", "loaded_bytes", "load_gbps", "copy_gbps", "ttft_ratio"}
    assert figures <= set(result), result
    assert result["hit_cached_tokens"] == 256, result


def test_disk_ttft_runs() -> None:
    result = run("disk_ttft", *ONE_CHUNK_PROMPT, "--keep-page-cache")  # never drop the CI host's page cache
    figures = {"ttft_recompute_s", "ttft_disk_hit_s", "ttft_memory_hit_s", "loaded_bytes", "entries"}
    assert figures <= set(result), result
    assert result["cached_tokens_disk_hit"] == 256, result


def test_remote_ttft_runs() -> None:
    from support.valkey import binary

    result = run("remote_ttft", *ONE_CHUNK_PROMPT, "--valkey-server", binary())
    figures = {
        "ttft_recompute_s",
        "ttft_remote_hit_s",
        "ttft_local_hit_s",
        "loaded_bytes",
        "socket_copy_gbps",
    }
    assert figures <= set(result), result
    # Node B fetched A's chunk from Valkey for B1, then held it for B2; C recomputed.
    assert result["cached_tokens"] == {"remote": 256, "local": 256, "recompute": 0}, result
    assert result["node_b_remote"]["fetched"] >= 1 and result["node_b_remote"]["errors"] == 0, result
    assert result["loaded_bytes"] > 0 and result["fetch_entries"] >= 1 and result["fetch_bytes"] > 0, result


def test_vllm_tier_runs() -> None:
    # Two of the four tiers (each is two engine processes): ours through serve, and vLLM's own.
    args = ["--chunks", "4", "--chunk-mib", "0.25", "--settle-s", "0", "--tier", "serve", "--tier", "fs"]
    result = run("vllm_tier", *args)
    rows = {r["tier"]: r for r in result["rows"]}
    assert set(rows) == {"LMCachePlatformTier via serve", "vLLM fs"}, result
    for row in rows.values():
        # Engine B, another process, got back every chunk engine A stored, byte for byte.
        assert (row["identical"], row["wrong"]) == (4, 0), row
        assert row["store_gb_s"] > 0 and row["load_gb_s"] > 0 and row["max_call_ms"] >= row["p99_call_ms"], (
            row
        )


def test_vllm_connector_runs() -> None:
    """Workload 2 (no reuse) through two OpenAI servers: B with the connector, P without."""
    args = ["--sections", "no-reuse", "--pairs", "1", "--requests", "2", "--concurrency", "2"]
    result = run("vllm_connector", *args, "--no-reuse-tokens", "300", "--max-host-bytes", "256M")
    runs = {r["connector"]: r for r in result["no_reuse"]}
    assert set(runs) == {"on", "off"}, result
    for r in runs.values():
        assert r["requests"] == 2 and r["output_tokens"] == 2 * 8, r
    # Each 300-token prompt stores its one whole chunk through the connector; nothing fails.
    counters = runs["on"]["counters"]
    assert counters["stored_chunks"] >= 2 and counters["store_failures"] == 0, counters
    summary = result["summary"]["no_reuse"]
    assert len(summary["ratio_per_pair"]) == 1 and summary["ratio"] > 0, summary
    assert set(result["summary"]["goals"]) == {"no-reuse throughput on / off >= 0.95 (engines bound alike)"}
    assert result["server_final"]["chunks"] >= 2, result["server_final"]


def test_tier_io_vllm_fs_runs() -> None:
    """vLLM's own fs tier's I/O, the section ``make bench-tiers`` runs with the vLLM venv."""
    args = [
        "--section",
        "vllm-fs",
        "--entries",
        "2",
        "--entry-mib",
        "0.25",
        "--runs",
        "1",
        "--keep-page-cache",
    ]
    result = run("tier_io", *args)
    fs = result["vllm-fs"]
    assert fs["entries"] == 2 and fs["bytes"] == 2 * (1 << 20) // 4, fs
    assert isinstance(fs["o_direct"], bool), fs
    assert all(fs[k] > 0 for k in ("store_gbps", "load_warm_gbps", "load_cold_gbps")), fs

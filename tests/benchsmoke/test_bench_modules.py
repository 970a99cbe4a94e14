"""Every benchmark of ``tests/bench`` that runs without vLLM, run end to end at a tiny size.

Each runs as a person runs it (``python -m bench.<name> --json``, ``support.benches``) and
prints its JSON document; checked is the document's shape and what is a fact rather than
a speed (bytes moved, counts, modules imported). The ones that need vLLM are
``tests/vllm/test_vllm_benchmarks.py``'s.
"""

from __future__ import annotations

from pathlib import Path

from support.benches import run_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MiB = 1 << 20


def test_discovery_scaling(tmp_path: Path) -> None:
    plot = tmp_path / "discovery.png"
    args = ["--n", "6", "12", "--k", "1", "3", "--runs", "1", "--delay-ms", "1", "--plot", str(plot)]
    data = run_bench("discovery_scaling", *args, timeout=120)
    rows = {(r["approach"], r["n"], r["k"]): r for r in data["results"]}
    assert set(rows) == {(a, n, k) for a in ("lazy", "pluggy", "walk") for n in (6, 12) for k in (1, 3)}
    for (approach, _, k), r in rows.items():
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        # Laziness is a fact, not a timing: ours imports the one `cpu` backend, eager ones all K.
        assert r["modules_imported"] == (1 if approach == "lazy" else k), r
    assert {t["name"] for t in data["targets"]} == {
        f"discovery.{a}.n{n}" for a in ("lazy", "pluggy", "walk") for n in (6, 12)
    }
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_serve_ready() -> None:
    data = run_bench("serve_ready", "--max-host-bytes", "64M", "--rounds", "1", timeout=120)
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"default (eager)", "--host-memory ahead"}, data
    assert all(r["ready_s"] > 0 for r in rows.values()), data
    eager = rows["default (eager)"]
    # The default prepares all of --max-host-bytes; then it says when and at what CPU cost.
    assert "not_prepared_within_s" not in eager, data
    assert eager["prepared_bytes"] >= 64 * MiB, data
    assert eager["prepared_s"] >= eager["ready_s"], data
    assert eager["serve_cpu_s"] >= 0, data
    assert "prepared_s" not in rows["--host-memory ahead"], data


def test_server_put_get() -> None:
    # Two chunks of 256 tokens over 8 blocks of 128: 2 x 8 layers x 256 tokens x 2 x 8 x 64 x 2 bytes.
    args = ["--blocks", "8", "--chunks", "2", "--rounds", "2"]
    data = run_bench("server_put_get", *args, timeout=120)
    assert (data["format"], data["block_size"], data["dtype"]) == ("blocks", 128, "bfloat16"), data
    assert len(data["rounds"]) == 2, data
    for row in data["rounds"]:
        assert row["bytes"] == 2 * 8 * 256 * 2 * 8 * 64 * 2, row
        assert all(row[k] > 0 for k in ("put_s", "put_gbps", "get_s", "get_gbps", "copy_fresh_gbps")), row


def test_tier_io() -> None:
    """The checksum, the disk tier against plain files and the Valkey tier against raw SET/GET."""
    from support.valkey import binary

    binary()  # skips without valkey-server
    args = ["--entries", "2", "--entry-mib", "0.25", "--runs", "1", "--keep-page-cache"]
    data = run_bench("tier_io", *args, timeout=180)
    assert {"checksum", "disk", "valkey"} <= set(data), data
    checksum = data["checksum"]
    assert checksum["bytes"] == MiB // 4, checksum
    for v in (1, 2):
        assert all(checksum[f"v{v}_{k}_gbps"] > 0 for k in ("checksum", "encode", "decode")), checksum
    disk = data["disk"]
    assert disk["entries"] == 2 and disk["bytes"] > 2 * MiB // 4, disk  # each entry has a header
    assert disk["cold"] == "fadvise", disk  # --keep-page-cache: never the shared host's page cache
    for k in ("store", "plain_write", "fetch_warm", "fetch_placed_warm", "fetch_cold", "fetch_direct"):
        assert disk[f"{k}_gbps"] > 0, disk
    valkey = data["valkey"]
    assert valkey["bytes"] == disk["bytes"], data
    for k in ("store", "raw_set", "fetch", "raw_get"):
        assert valkey[f"{k}_gbps"] > 0, valkey

"""The CUDA benchmark's report renders every path and says whether the 2x host-link goal holds.

No GPU here: the report is built by hand in the shape ``_bench.run`` returns (the figures
are placeholders, not measurements), so the summary ``scripts/gpu-check`` prints cannot
break on a GPU host for want of a key.
"""

from __future__ import annotations

from typing import Any

from lmcache_platform_cuda._bench import PATHS, format_report


def timing(gb: float) -> dict[str, float]:
    return {"gb_per_s": gb, "us_per_chunk": 1.0, "host_us_per_chunk": 1.0}


def test_the_report_shows_each_path_against_copy_and_the_host_link() -> None:
    paths: dict[str, Any] = {
        f"{cf}/{path}": {"ran": path, "reason": None, "store": timing(200.0), "retrieve": timing(90.0)}
        for cf, path in PATHS
    }
    paths["blocks/triton"] = {
        "ran": "torch",
        "reason": "triton is not installed",
        "store": timing(20.0),
        "retrieve": timing(20.0),
    }
    report = {
        "device": "a GPU",
        "torch": "x",
        "model": {
            "layers": 32,
            "kv_heads": 8,
            "head_size": 128,
            "block_size": 16,
            "chunk_tokens": 256,
            "dtype": "bfloat16",
            "iterations": 20,
        },
        "handoff": {},
        "formats": {
            "vllm": {
                "ok": True,
                "chunk_bytes": 32 << 20,
                "copy_": timing(1000.0),
                "d2h": timing(50.0),
                "h2d": timing(50.0),
                "paths": paths,
            },
            "mla": {"ok": False, "error": "LayoutError: no"},
        },
    }
    text = format_report(report)
    rows = [line for line in text.splitlines() if "tokens/triton" in line]
    assert len(rows) == 1 and rows[0].split()[-1] == "NO"  # retrieve 90 < 2 x 50
    assert "4.0x" in rows[0] and "1.8x" in rows[0]
    assert "blocks/triton (ran torch)" in text and "why: triton is not installed" in text
    assert "mla             FAILED: LayoutError: no" in text

"""The time-to-first-token benchmarks of ``tests/bench`` run end to end, at tiny sizes.

Each runs as ``make bench-vllm`` and ``make bench-disk`` run it (the vLLM venv's Python,
real engines through ``support.vllm_driver``, a real ``lmcache-platform serve``), with
one prompt of one chunk and ``--json``. Checked: it finishes, its document has every
figure, and the hit loaded the chunk. Never a speed: the figures are for people.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from support.vllm_engines import ROOT, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def run(script: str, *extra: str) -> dict[str, object]:
    command = [str(vllm_python()), str(ROOT / "tests" / "bench" / script), *extra]
    proc = subprocess.run(
        [*command, "--prompts", "1", "--prompt-tokens", "300", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return dict(json.loads(proc.stdout))


def test_vllm_ttft_runs() -> None:
    result = run("vllm_ttft.py")
    figures = {"ttft_recompute_s", "ttft_hit_s", "loaded_bytes", "load_gbps", "copy_gbps", "ttft_ratio"}
    assert figures <= set(result), result
    assert result["hit_cached_tokens"] == 256, result


def test_disk_ttft_runs() -> None:
    result = run("disk_ttft.py", "--keep-page-cache")  # never drop the CI host's page cache
    figures = {"ttft_recompute_s", "ttft_disk_hit_s", "ttft_memory_hit_s", "loaded_bytes", "entries"}
    assert figures <= set(result), result
    assert result["cached_tokens_disk_hit"] == 256, result

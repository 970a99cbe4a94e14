"""``copy_geometry``: a kernel group's chunk as one strided copy, checked without any kernel.

A reference gather written only from the geometry (``as_strided`` over each unit, the
two address formulas of ``lmcache_platform._kv.geometry``) must produce exactly the bytes
``store_chunk`` puts in staging, for every layout and both chunk formats. What a native
kernel computes is then only a faster way of doing the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmcache_platform import CopyGeometry, EngineGroupInfo, EngineType, KVFormat, LayoutHints, copy_geometry
from support.cache import engine_kv
from support.layouts import BS, NB, ORDERS, D, H, L, fill, host_context, planes


def layers_of(fmt: KVFormat, order: str | None = None, d: int = D) -> list[Any]:
    layers = engine_kv(fmt, L, NB, BS, H, d, order=order)
    fill(layers, seed=5)
    return layers


CASES: dict[str, tuple[KVFormat, str | None, dict[str, Any]]] = {
    **{f"vllm-{o}": (KVFormat.VLLM, o, {}) for o in ORDERS},
    "vllm_mla": (KVFormat.VLLM_MLA, "LBNHC", {"layout_hints": LayoutHints(head_size=D)}),
    **{
        f.value: (f, None, {"layout_hints": LayoutHints(kv_format=f)})
        for f in (
            KVFormat.FLASH_ATTN,
            KVFormat.FLASH_ATTN_HND,
            KVFormat.FLASHINFER,
            KVFormat.FLASHINFER_HND,
            KVFormat.MLA,
        )
    },
    "sglang": (
        KVFormat.SGLANG,
        None,
        {"engine_group_infos": (EngineGroupInfo(layer_indices=range(L), block_size=BS),)},
    ),
    "sglang_mla": (
        KVFormat.SGLANG_MLA,
        None,
        {"engine_type": EngineType.SGLANG, "layout_hints": LayoutHints(block_size=BS)},
    ),
}


def gather(geo: CopyGeometry, tensors: list[torch.Tensor], ids: list[int], out: torch.Tensor) -> None:
    """Every unit's rows of blocks ``ids`` into the dense buffer ``out``, from the geometry alone."""
    flat_out = out.reshape(-1)
    for u in geo.units:
        t = tensors[u.tensor]
        whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
        pages = whole.as_strided(
            (NB, geo.rows_per_block, geo.outer, geo.inner),
            (geo.block_stride, geo.row_stride, geo.outer_stride, geo.inner_stride),
            t.storage_offset() + u.paged_offset,
        )
        rows = pages[ids].reshape(-1)
        flat_out[u.staged_offset : u.staged_offset + rows.numel()] = rows


@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_gather_by_the_geometry_is_what_store_chunk_stages(case: str, chunk_format: str) -> None:
    fmt, order, config = CASES[case]
    layers = layers_of(fmt, order, d=D)
    with host_context(layers, chunk_format=chunk_format, **config) as ctx:
        (kg,) = ctx.kv_layer_groups_manager.kernel_groups
        per_layer = planes(layers)
        geo = copy_geometry(kg, per_layer, chunk_format)
        assert geo is not None
        assert len(geo.units) >= L and geo.tokens_per_row * geo.rows_per_block == BS
        ctx.store_chunk([[6, 3]])
        want = ctx.get_temp_kernel_group_buffer(0, 0).clone()
        got = torch.full_like(want, 0)
        gather(geo, [t for e in per_layer for t in e], [6, 3], got)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_contiguous_dims_of_a_row_merge() -> None:
    # LBNHC: a token's heads are 2D apart (K and V interleave), so a row stays [heads, D];
    # LBHNC's K rows are [heads, D] with heads N * 2D apart; the older NHD formats merge to one run.
    (kg_lbnhc, lbnhc), (kg_fa, fa) = (
        _group(layers_of(KVFormat.VLLM, "LBNHC"), {}),
        _group(layers_of(KVFormat.FLASH_ATTN), {"layout_hints": LayoutHints(kv_format=KVFormat.FLASH_ATTN)}),
    )
    geo = copy_geometry(kg_lbnhc, lbnhc, "tokens")
    assert geo is not None and (geo.outer, geo.outer_stride, geo.inner, geo.inner_stride) == (H, 2 * D, D, 1)
    geo = copy_geometry(kg_fa, fa, "tokens")
    assert geo is not None and (geo.outer, geo.inner, geo.inner_stride) == (1, H * D, 1)
    blocks = copy_geometry(kg_lbnhc, lbnhc, "blocks")
    assert blocks is not None and (blocks.outer, blocks.inner, blocks.rows_per_block) == (
        1,
        BS * H * 2 * D,
        1,
    )


def test_a_pair_whose_strides_differ_has_no_single_geometry() -> None:
    k = torch.zeros(NB * BS, H, D)
    v = torch.zeros(NB * BS, D, H).transpose(1, 2)  # same shape, other strides
    kg, _ = _group([(k, v)], {"layout_hints": LayoutHints(block_size=BS, kv_format=KVFormat.SGLANG)})
    assert copy_geometry(kg, [(k, v)], "tokens") is None
    with pytest.raises(ValueError, match="unknown chunk format 'pages'"):
        copy_geometry(kg, [(k, k)], "pages")


def _group(layers: list[Any], config: dict[str, Any]) -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
    with host_context(layers, **config) as ctx:
        (kg,) = ctx.kv_layer_groups_manager.kernel_groups
    return kg, planes(layers)

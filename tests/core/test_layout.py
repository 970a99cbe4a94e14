"""KV layout discovery: every format with and without hints, and each ambiguity's error."""

from __future__ import annotations

import pytest
import torch

from lmcache_platform import KVFormat, LayoutError, LayoutHints
from lmcache_platform._kv.layout import discover_layout, discover_layouts, plane_views
from support.cache import layer_shape, make_layers, token_rows

NB, BS, H, D = 6, 4, 2, 8
FIVE_D = [KVFormat.FLASH_ATTN, KVFormat.FLASH_ATTN_HND, KVFormat.FLASHINFER, KVFormat.FLASHINFER_HND]


def t(fmt: KVFormat, nb: int = NB, bs: int = BS, h: int = H, d: int = D) -> torch.Tensor:
    return torch.zeros(layer_shape(fmt, nb, bs, h, d), dtype=torch.bfloat16)


BLOCK_FORMATS = [f for f in KVFormat if f not in (KVFormat.SGLANG, KVFormat.SGLANG_MLA)]
ONE_HEAD = (KVFormat.MLA, KVFormat.VLLM_MLA, KVFormat.SGLANG_MLA)


def check(lay, fmt, nb=NB, bs=BS, h=H, d=D):
    assert (lay.kv_format, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_size) == (
        fmt,
        nb,
        bs,
        1 if fmt in ONE_HEAD else h,
        d,
    )
    assert lay.dtype == torch.bfloat16
    assert lay.kv_size == (1 if fmt in ONE_HEAD else 2)


@pytest.mark.parametrize("fmt", list(KVFormat))
def test_format_hint_is_obeyed(fmt):
    x = t(fmt)
    layer = (x, x.clone()) if fmt is KVFormat.SGLANG else x
    slots = fmt in (KVFormat.SGLANG, KVFormat.SGLANG_MLA)
    check(discover_layout(layer, layer=0, kv_format=fmt, block_size=BS if slots else None), fmt)


@pytest.mark.parametrize("fmt", FIVE_D)
def test_block_size_alone_decides_every_5d_format(fmt):
    check(discover_layout(t(fmt), layer=0, block_size=BS), fmt)


@pytest.mark.parametrize("fmt", FIVE_D)
def test_num_kv_heads_alone_decides_every_5d_format(fmt):
    check(discover_layout(t(fmt), layer=0, num_kv_heads=H), fmt)


def test_mla_needs_no_hint():
    check(discover_layout(t(KVFormat.MLA), layer=0), KVFormat.MLA)


@pytest.mark.parametrize("fmt", FIVE_D)
def test_dense_5d_without_hints_names_the_hints_that_decide(fmt):
    with pytest.raises(LayoutError) as err:
        discover_layout(t(fmt), layer=3)
    msg = str(err.value)
    assert "layer 3" in msg and "ambiguous" in msg
    fam = "FLASH_ATTN" if fmt in (KVFormat.FLASH_ATTN, KVFormat.FLASH_ATTN_HND) else "FLASHINFER"
    assert f"KVFormat.{fam} or KVFormat.{fam}_HND" in msg
    assert "block_size" in msg


def test_num_blocks_of_two_is_ambiguous_and_the_format_hint_fixes_it():
    x = torch.zeros(2, 2, BS, H, D)
    with pytest.raises(LayoutError, match="num_blocks may be 2") as err:
        discover_layout(x, layer=0, block_size=BS)
    assert "LayoutHints(kv_format=KVFormat.FLASH_ATTN or KVFormat.FLASHINFER)" in str(err.value)
    lay = discover_layout(x, layer=0, kv_format=KVFormat.FLASHINFER)
    assert lay.kv_format is KVFormat.FLASHINFER and lay.num_blocks == 2


def test_heads_equal_to_block_size_needs_the_format():
    x = torch.zeros(2, NB, 4, 4, D)
    with pytest.raises(LayoutError, match="dims 2 and 3 are both 4") as err:
        discover_layout(x, layer=0, block_size=4, num_kv_heads=4)
    assert "KVFormat.FLASH_ATTN or KVFormat.FLASH_ATTN_HND" in str(err.value)
    lay = discover_layout(x, layer=0, kv_format=KVFormat.FLASH_ATTN_HND)
    assert lay.kv_format is KVFormat.FLASH_ATTN_HND


@pytest.mark.parametrize(
    ("physical", "perm", "fmt"),
    [
        # vLLM's kv_cache_stride_order: HND memory shown through an NHD logical view.
        (KVFormat.FLASH_ATTN_HND, (0, 1, 3, 2, 4), KVFormat.FLASH_ATTN),
        (KVFormat.FLASHINFER_HND, (0, 1, 3, 2, 4), KVFormat.FLASHINFER),
    ],
)
def test_permuted_view_of_hnd_memory_reads_as_logical_nhd(physical, perm, fmt):
    view = t(physical).permute(perm)
    assert not view.is_contiguous()
    lay = discover_layout(view, layer=0)
    check(lay, fmt)
    assert lay.stride == tuple(view.stride())


def test_hint_contradicting_the_shape_is_refused():
    with pytest.raises(LayoutError, match="needs a 3-D tensor"):
        discover_layout(t(KVFormat.FLASH_ATTN), layer=0, kv_format=KVFormat.MLA)
    with pytest.raises(LayoutError, match="needs size 2 at dim 1"):
        discover_layout(t(KVFormat.FLASH_ATTN), layer=0, kv_format=KVFormat.FLASHINFER)
    with pytest.raises(LayoutError, match=r"block size is 4, but .* say 8"):
        discover_layout(t(KVFormat.FLASH_ATTN), layer=0, kv_format=KVFormat.FLASH_ATTN, block_size=8)
    with pytest.raises(LayoutError, match="2 KV heads, but the hints say 3"):
        discover_layout(
            t(KVFormat.MLA).new_zeros(2, NB, BS, H, D), layer=0, kv_format=KVFormat.FLASH_ATTN, num_kv_heads=3
        )
    with pytest.raises(LayoutError, match="block size is 4, but"):
        discover_layout(t(KVFormat.MLA), layer=0, block_size=16)


def test_block_size_or_heads_matching_no_dim_is_refused():
    with pytest.raises(LayoutError, match=r"block size 16 .* matches neither dim 2 \(4\) nor dim 3 \(2\)"):
        discover_layout(t(KVFormat.FLASH_ATTN), layer=0, block_size=16)
    with pytest.raises(LayoutError, match=r"KV head count 5 .* matches neither"):
        discover_layout(t(KVFormat.FLASH_ATTN), layer=0, num_kv_heads=5)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (8,), (3, 3, 4, 2, 8), (2, 4, 4, 2, 8, 1)])
def test_unknown_shapes_list_the_supported_ones(shape):
    with pytest.raises(LayoutError, match="supported per-layer shapes"):
        discover_layout(torch.zeros(shape), layer=5)


def test_empty_dimension_is_refused():
    with pytest.raises(LayoutError, match="empty dimension"):
        discover_layout(torch.zeros(0, 4, 8), layer=0)


def test_discover_layouts_uses_group_block_size_then_hints():
    xs = [t(KVFormat.FLASH_ATTN), t(KVFormat.FLASH_ATTN_HND), t(KVFormat.MLA)]
    lays = discover_layouts(xs, LayoutHints(block_size=BS), {})
    assert [x.kv_format for x in lays] == [KVFormat.FLASH_ATTN, KVFormat.FLASH_ATTN_HND, KVFormat.MLA]
    lays = discover_layouts(xs, None, {0: BS, 1: BS})
    assert [x.kv_format for x in lays][:2] == [KVFormat.FLASH_ATTN, KVFormat.FLASH_ATTN_HND]


def test_per_layer_hint_overrides_the_global_one():
    xs = [t(KVFormat.FLASH_ATTN), t(KVFormat.FLASHINFER_HND)]
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, per_layer={1: KVFormat.FLASHINFER_HND})
    lays = discover_layouts(xs, hints, {})
    assert [x.kv_format for x in lays] == [KVFormat.FLASH_ATTN, KVFormat.FLASHINFER_HND]


def test_bad_per_layer_index_and_contradicting_block_sizes():
    xs = [t(KVFormat.FLASH_ATTN)]
    with pytest.raises(LayoutError, match="names layer 4, but there are 1"):
        discover_layouts(xs, LayoutHints(per_layer={4: KVFormat.MLA}), {})
    with pytest.raises(LayoutError, match="block_size=8 contradicts its engine group's block_size=4"):
        discover_layouts(xs, LayoutHints(block_size=8), {0: 4})


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_plane_views_put_tokens_of_a_block_in_order(fmt):
    (x,) = make_layers(fmt, 1, nb=NB, bs=BS, h=H, d=D)
    lay = discover_layout(x, layer=0, kv_format=fmt)
    planes = plane_views(x, lay)
    kv = 1 if fmt in ONE_HEAD else 2
    assert len(planes) == kv
    for p in planes:
        assert p.shape == (NB, BS, 1 if fmt in ONE_HEAD else H, D)
        assert p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    for block in (0, NB - 1):
        got = torch.stack([p[block].reshape(BS, -1) for p in planes])
        assert torch.equal(got.view(torch.uint8), token_rows(x, fmt, block, 0, BS).view(torch.uint8))


def test_kv_cache_shape_gives_each_format_its_engine_shape():
    from lmcache_platform import kv_cache_shape

    dims = {"num_blocks": 7, "block_size": 16, "num_kv_heads": 4, "head_size": 64}
    assert {f: kv_cache_shape(f, **dims) for f in KVFormat} == {
        KVFormat.FLASH_ATTN: (2, 7, 16, 4, 64),
        KVFormat.FLASH_ATTN_HND: (2, 7, 4, 16, 64),
        KVFormat.FLASHINFER: (7, 2, 16, 4, 64),
        KVFormat.FLASHINFER_HND: (7, 2, 4, 16, 64),
        KVFormat.MLA: (7, 16, 64),
        KVFormat.VLLM: (7, 4, 16, 128),
        KVFormat.VLLM_MLA: (7, 1, 16, 64),
        KVFormat.SGLANG: (112, 4, 64),
        KVFormat.SGLANG_MLA: (112, 1, 64),
    }

"""Engine groups -> kernel groups -> object groups, sliding-window trimming, staging layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache_platform import EngineGroupInfo, KVFormat, LayoutError
from lmcache_platform._kv.groups import KVLayerGroupsManager, resolve_engine_groups
from lmcache_platform._kv.layout import LayerLayout
from lmcache_platform._kv.staging import STAGING_ALIGN, StagingLayout
from lmcache_platform._kv.transfer import _segments


def lay(fmt=KVFormat.FLASH_ATTN, dtype=torch.float16, nb=8, bs=4, h=2, d=8) -> LayerLayout:
    shape = (1, nb, bs, d) if fmt is KVFormat.MLA else (2, nb, bs, h, d)
    stride = tuple(torch.empty(shape).stride())
    return LayerLayout(fmt, nb, bs, 1 if fmt is KVFormat.MLA else h, d, dtype, shape, stride)


def manager(layouts, infos=(), *, chunk=16, separate=True, full=False):
    groups = resolve_engine_groups(tuple(infos), len(layouts))
    return KVLayerGroupsManager(
        layouts, groups, tokens_per_chunk=chunk, separate_object_groups=separate, full_sw_kv=full
    )


def info(layers, bs=4, sw=None):
    return EngineGroupInfo(layer_indices=layers, block_size=bs, sliding_window=sw)


@pytest.mark.parametrize(
    ("infos", "match"),
    [
        ([info([])], "engine group 0 has no layers"),
        ([info([0, 1]), info([1, 2])], "layer 1 is in engine groups 0 and 1"),
        ([info([0, 1, 2, 5])], "names layer 5, but there are 3 layers"),
        ([info([0, 1])], r"layers \[2\] are in no engine group"),
        ([info([0, 1, 2], bs=0)], "block_size must be positive"),
        ([info([0, 1, 2], sw=0)], "sliding_window must be positive"),
    ],
)
def test_engine_group_validation(infos, match):
    with pytest.raises(LayoutError, match=match):
        resolve_engine_groups(infos, 3)


def test_one_implicit_engine_group_when_none_given():
    m = manager([lay(), lay(), lay()])
    assert m.num_engine_groups == m.num_kernel_groups == m.num_object_groups == 1
    assert m.kernel_groups[0].layer_indices == (0, 1, 2)
    assert m.kernel_groups[0].tokens_per_slot == 16


def test_implicit_group_refuses_mixed_block_sizes():
    with pytest.raises(LayoutError, match=r"different block sizes \[4, 8\]; pass engine_group_infos"):
        manager([lay(bs=4), lay(bs=8)])


def test_group_block_size_must_match_the_layer_and_divide_the_chunk():
    with pytest.raises(LayoutError, match="layer 0 has block size 4 but engine group 0 says 8"):
        manager([lay()], [info([0], bs=8)])
    with pytest.raises(LayoutError, match="tokens_per_chunk 16 is not a multiple of its block size 6"):
        manager([lay(bs=6)], [info([0], bs=6)])


def test_kernel_groups_split_on_format_shape_and_dtype_and_order_by_itemsize():
    layouts = [lay(), lay(dtype=torch.float32), lay(KVFormat.MLA), lay(), lay(h=4)]
    m = manager(layouts)
    groups = [(kg.layer_indices, kg.dtype, kg.kv_format) for kg in m.kernel_groups]
    # One object group; float32 first (widest), then float16 groups by first layer.
    assert groups == [
        ((1,), torch.float32, KVFormat.FLASH_ATTN),
        ((0, 3), torch.float16, KVFormat.FLASH_ATTN),
        ((2,), torch.float16, KVFormat.MLA),
        ((4,), torch.float16, KVFormat.FLASH_ATTN),
    ]
    assert m.object_groups[0].kernel_group_indices == (0, 1, 2, 3)
    assert m.kernel_groups[2].kv_size == 1 and m.kernel_groups[3].hidden_dim == 32


def test_same_shape_in_two_engine_groups_stays_in_two_kernel_groups():
    m = manager([lay()] * 4, [info([0, 2]), info([1, 3])])
    assert [kg.layer_indices for kg in m.kernel_groups] == [(0, 2), (1, 3)]
    assert [kg.engine_group_idx for kg in m.kernel_groups] == [0, 1]


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("full", [True, False])
def test_sliding_window_object_groups_and_trimming(separate, full):
    # Layers 1 and 3 use a 6-token window; 0 and 2 attend to everything.
    m = manager(
        [lay()] * 5, [info([1, 3], sw=6), info([0, 2]), info([4], sw=40)], separate=separate, full=full
    )
    by_layers = {kg.layer_indices: kg for kg in m.kernel_groups}
    sw, full_attn, wide = by_layers[(1, 3)], by_layers[(0, 2)], by_layers[(4,)]
    assert full_attn.tokens_per_slot == 16
    assert sw.tokens_per_slot == (16 if full else 6)
    assert wide.tokens_per_slot == 16  # a window wider than the chunk keeps the chunk
    if separate:
        # One object group per window size, numbered by first layer.
        assert [og.sliding_window for og in m.object_groups] == [None, 6, 40]
        assert [full_attn.object_group_idx, sw.object_group_idx, wide.object_group_idx] == [0, 1, 2]
    else:
        assert m.num_object_groups == 1
        assert m.object_groups[0].kernel_group_indices == (0, 1, 2)
    assert m.kept_range(16, sw.index) == ((0, 16) if full else (10, 6))
    assert m.kept_range(5, sw.index) == (0, 5)
    assert m.kept_tokens(40, sw.index) == (40 if full else 6 + 6 + 6)
    assert m.kept_tokens(40, full_attn.index) == 40
    assert m.blocks_for(13, sw.index) == 4


def test_staging_layout_packs_kernel_groups_inside_aligned_object_groups():
    layouts = [lay(), lay(dtype=torch.float32), lay(KVFormat.MLA, d=6), lay(dtype=torch.int8)]
    m = manager(layouts, [info([0, 1]), info([2, 3], sw=3)])
    s = StagingLayout.build(m, num_slots=3)
    assert s.slot_nbytes % STAGING_ALIGN == 0 and s.total_nbytes == 3 * s.slot_nbytes
    for og, (og_off, og_bytes) in zip(m.object_groups, s.object_group_spans, strict=True):
        assert og_off % STAGING_ALIGN == 0
        spans = [s.kernel_group_spans[k] for k in og.kernel_group_indices]
        assert spans[0][0] == og_off
        for (off, n), nxt in zip(spans, [*spans[1:], (og_off + og_bytes, 0)], strict=True):
            assert off + n == nxt[0]  # back to back, no gap
        for k in og.kernel_group_indices:
            kg = m.kernel_groups[k]
            off, n = s.kernel_group_spans[k]
            assert off % kg.itemsize == 0
            assert n == kg.kv_size * kg.num_layers * kg.tokens_per_slot * kg.hidden_dim * kg.itemsize
    assert s.object_group_spans[-1][0] + s.object_group_spans[-1][1] <= s.slot_nbytes


@given(first=st.integers(0, 40), count=st.integers(0, 40), bs=st.integers(1, 9))
def test_segments_cover_the_range_once_in_order(first, count, bs):
    pieces = _segments(first, count, bs)
    pos = first
    for blk, n, off, length in pieces:
        assert (first // bs + blk) * bs + off == pos
        if n > 1 or (off == 0 and length == bs * n):
            assert off == 0 and length == n * bs
        else:
            assert n == 1 and 0 < length <= bs - off
        pos += length
    assert pos == first + count
    assert sum(1 for _, n, off, length in pieces if length < n * bs) <= 2

"""GroupMover's block-wise scatter (stacked views): id runs, plane splits, edge blocks, bit-exact."""

from __future__ import annotations

import pytest
import torch

from lmcache_platform import KVFormat
from lmcache_platform._kv.layout import LayerLayout, plane_views
from lmcache_platform._kv.transfer import GroupMover, GroupTransfer, _block_runs
from support.cache import engine_views

NB, BS, H, D, L, SLOT_TOKENS = 12, 4, 2, 8, 3, 16
ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def test_block_runs_merge_consecutive_ids_in_chunk_order() -> None:
    assert _block_runs([5, 6, 7, 2, 9, 10, 4]) == [(0, 5, 3), (3, 2, 1), (4, 9, 2), (6, 4, 1)]
    assert _block_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]


def _mover(order: str) -> tuple[GroupMover, list[list[torch.Tensor]], torch.Tensor]:
    layers = engine_views(L, NB, BS, H, D, torch.float8_e4m3fn, order=order)
    gen = torch.Generator().manual_seed(3)
    backing = torch.empty(0, dtype=torch.uint8).set_(layers[0].untyped_storage())
    backing.copy_(torch.randint(0, 256, backing.shape, dtype=torch.uint8, generator=gen))
    t = layers[0]
    lay = LayerLayout(
        kv_format=KVFormat.VLLM,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=H,
        head_size=D,
        dtype=t.dtype,
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
    )
    planes = [plane_views(x, lay) for x in layers]
    staging = torch.randint(0, 256, (2, 2 * L * SLOT_TOKENS * H * D), dtype=torch.uint8, generator=gen)
    slots = [s.view(torch.float8_e4m3fn).view(2, L, SLOT_TOKENS, H * D) for s in staging]
    return GroupMover(planes, slots, block_size=BS, num_kv_heads=H), planes, staging


def _part(ids: list[int], first: int, count: int) -> GroupTransfer:
    return GroupTransfer(0, first, count, torch.tensor(ids), tuple(ids), torch.empty(0))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("first", "count"), [(0, 16), (0, 14), (2, 13)])
def test_scatter_and_gather_match_a_per_token_reference(order: str, first: int, count: int) -> None:
    mover, planes, staging = _mover(order)
    assert mover.stacked
    ids = [4, 5, 6, 1][first // BS : -(-(first + count) // BS)]  # a run of three, then a lone block
    slot = staging[1].view(torch.float8_e4m3fn).view(2, L, SLOT_TOKENS, H, D)
    want = [[p.view(torch.uint8).clone() for p in layer] for layer in planes]
    for i in range(count):
        pos = first + i
        blk, off = ids[pos // BS - first // BS], pos % BS
        for layer, views in enumerate(want):
            for kv, view in enumerate(views):
                view[blk, off] = slot[kv, layer, i].view(torch.uint8)
    mover.scatter(1, _part(ids, first, count))
    for layer, views in enumerate(planes):
        for kv, view in enumerate(views):
            assert torch.equal(view.view(torch.uint8), want[layer][kv])
    staging[0].zero_()
    mover.gather(0, _part(ids, first, count))
    assert torch.equal(
        staging[0].view(2, L, SLOT_TOKENS, -1)[:, :, :count],
        staging[1].view(2, L, SLOT_TOKENS, -1)[:, :, :count],
    )

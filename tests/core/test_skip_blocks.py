"""Block id -1 in a retrieve: "skip these positions" (vLLM's null blocks); refused in a store.

Real host tensors, two engine groups (full attention, and a 6-token sliding window that
is trimmed): a retrieve writes exactly the kept positions whose block id is not -1,
byte for byte, and leaves every other byte of every layer alone.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_platform import KVFormat, TransferError
from support.cache import hybrid as support_hybrid
from support.cache import token_rows

CHUNK, BS, NB, WINDOW = 16, 4, 12, 6
FMTS = [KVFormat.FLASH_ATTN, KVFormat.FLASHINFER_HND] * 2
SRC = [[0, 1, 2, 3], [4, 5, 6, 7]]
SKIP = -1


def hybrid():
    return support_hybrid(nb=NB, bs=BS, window=WINDOW, seed=3, separate_object_groups=True)


def rows(x, fmt, block, pos):
    return token_rows(x, fmt, block, pos % BS, pos % BS + 1).contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "dst",
    [
        [[8, 9, 10, 11], [SKIP, SKIP, SKIP, 11]],  # the window's partial head block skipped
        [[8, 9, 10, 11], [SKIP, SKIP, 10, SKIP]],  # its tail skipped
        [[SKIP, 9, SKIP, 11], [SKIP, SKIP, SKIP, SKIP]],  # runs of whole blocks; nothing in the window
        [[8, 9, 10, 11], [8, 9, 10, 11]],  # no skip: the ordinary retrieve
    ],
    ids=["sw-head", "sw-tail", "fa-runs", "none"],
)
def test_a_retrieve_writes_exactly_the_positions_of_real_blocks(dst):
    ctx, layers = hybrid()
    with ctx:
        kept = {0: range(CHUNK), 1: range(CHUNK - WINDOW, CHUNK)}  # the trimmed window keeps the last 6
        want = {
            i: {p: rows(x, FMTS[i], SRC[i % 2][p // BS], p) for p in kept[i % 2]}
            for i, x in enumerate(layers)
        }
        ctx.store_chunk(SRC, slot=1)
        before = [x.clone() for x in layers]
        ctx.retrieve_chunk(dst, slot=1)
        for i, x in enumerate(layers):
            g = i % 2
            written = {(dst[g][p // BS], p % BS): p for p in kept[g] if dst[g][p // BS] != SKIP}
            for block in range(NB):
                for off in range(BS):
                    got = rows(x, FMTS[i], block, off)
                    if (block, off) in written:
                        assert torch.equal(got, want[i][written[block, off]]), (i, block, off)
                    else:  # skipped positions, other blocks: untouched
                        assert torch.equal(got, rows(before[i], FMTS[i], block, off)), (i, block, off)


def test_a_store_refuses_skip_naming_the_group():
    ctx, _ = hybrid()
    with ctx:
        snap = ctx._staging.clone()
        with pytest.raises(TransferError, match=r"engine group 1: block id -1 \(skip\) at position 0"):
            ctx.store_chunk([[0, 1, 2, 3], [SKIP, SKIP, 6, 7]])
        with pytest.raises(TransferError, match="engine group 0: block id -1"):
            ctx.validate_transfer([[SKIP, 1, 2, 3], [4, 5, 6, 7]])
        assert torch.equal(ctx._staging, snap)


def test_skips_repeat_freely_but_real_blocks_must_be_distinct():
    ctx, layers = hybrid()
    with ctx:
        ctx.store_chunk(SRC)
        ctx.validate_transfer([[SKIP, SKIP, SKIP, 11], [SKIP, SKIP, SKIP, 9]], retrieve=True)
        before = [x.clone() for x in layers]
        with pytest.raises(TransferError, match="some repeat"):
            ctx.retrieve_chunk([[SKIP, 9, SKIP, 9], [SKIP, SKIP, 10, 11]])
        with pytest.raises(TransferError, match="out of range"):
            ctx.retrieve_chunk([[-2, 9, 10, 11], [SKIP, SKIP, 10, 11]])
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(layers, before, strict=True)
        )

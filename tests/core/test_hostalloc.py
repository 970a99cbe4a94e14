"""Host memory for chunk payloads: mappings are reused only once nothing can reach them."""

from __future__ import annotations

import torch

from lmcache_platform import KVFormat, LayoutHints
from lmcache_platform._kv.hostalloc import HUGE_PAGE_BYTES, POOL, HostBufferPool, host_empty
from support.cache import context, make_layers

MiB = 1 << 20


def test_a_mapping_is_reused_once_no_tensor_or_view_uses_it() -> None:
    pool = HostBufferPool()
    first = pool.take(4 * MiB)
    address = first.data_ptr()
    view = first[100:200].view(torch.int16)  # a derived view keeps the mapping busy
    del first
    second = pool.take(4 * MiB)
    assert second.data_ptr() != address and pool.stats() == {"mappings": 2, "idle": 0, "bytes": 8 * MiB}
    del view
    assert pool.stats()["idle"] == 1
    third = pool.take(4 * MiB)
    assert third.data_ptr() == address and pool.stats()["idle"] == 0


def test_a_fresh_mapping_of_another_size_unmaps_the_idle_ones() -> None:
    pool = HostBufferPool()
    small = [pool.take(4 * MiB) for _ in range(3)]
    kept = small.pop()
    del small
    assert pool.stats() == {"mappings": 3, "idle": 2, "bytes": 12 * MiB}
    big = pool.take(8 * MiB)
    assert pool.stats() == {"mappings": 2, "idle": 0, "bytes": 12 * MiB}  # the busy one stays
    assert kept.numel() == 4 * MiB and big.numel() == 8 * MiB


def test_small_and_pinned_buffers_do_not_come_from_the_pool() -> None:
    before = POOL.stats()["mappings"]
    small = host_empty(HUGE_PAGE_BYTES - 1)
    assert small.dtype == torch.uint8 and small.numel() == HUGE_PAGE_BYTES - 1
    assert POOL.stats()["mappings"] == before


def test_chunks_reuse_the_memory_of_chunks_nobody_holds() -> None:
    layers = make_layers(KVFormat.FLASH_ATTN, 4, nb=64, bs=16, h=8, d=128, shared=True)
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=16)
    with context(layers, lmcache_tokens_per_chunk=256, layout_hints=hints) as ctx:
        assert ctx.chunk_nbytes[0] >= HUGE_PAGE_BYTES
        chunk = ctx.allocate_chunk()
        address = chunk[0].data_ptr()
        other = ctx.allocate_chunk()  # the first is still held: fresh memory
        assert other[0].data_ptr() != address
        del chunk
        assert ctx.allocate_chunk()[0].data_ptr() == address

"""Host memory for chunk payloads: mappings are reused only once nothing can reach them."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from lmcache_platform import KVFormat, LayoutHints
from lmcache_platform._kv.hostalloc import HUGE_PAGE_BYTES, POOL, HostBufferPool, host_empty
from support.cache import context, make_layers
from support.waits import wait_until

MiB = 1 << 20


def shape(pool: HostBufferPool) -> dict[str, int]:
    stats = pool.stats()
    return {k: stats[k] for k in ("mappings", "idle", "bytes")}


def test_a_mapping_is_reused_once_no_tensor_or_view_uses_it() -> None:
    pool = HostBufferPool()
    first = pool.take(4 * MiB)
    address = first.data_ptr()
    view = first[100:200].view(torch.int16)  # a derived view keeps the mapping busy
    del first
    second = pool.take(4 * MiB)
    assert second.data_ptr() != address and shape(pool) == {"mappings": 2, "idle": 0, "bytes": 8 * MiB}
    del view
    assert pool.stats()["idle"] == 1
    third = pool.take(4 * MiB)
    assert third.data_ptr() == address and pool.stats()["idle"] == 0


def test_a_fresh_mapping_of_another_size_unmaps_the_idle_ones() -> None:
    pool = HostBufferPool()
    small = [pool.take(4 * MiB) for _ in range(3)]
    kept = small.pop()
    del small
    assert shape(pool) == {"mappings": 3, "idle": 2, "bytes": 12 * MiB}
    big = pool.take(8 * MiB)
    assert shape(pool) == {"mappings": 2, "idle": 0, "bytes": 12 * MiB}  # the busy one stays
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


def test_memory_is_prepared_ahead_of_use_and_a_take_uses_it() -> None:
    pool = HostBufferPool()
    pool.prepare(4 * MiB, limit=64 * MiB, ahead=12 * MiB)
    wait_until(
        lambda: pool.stats()["idle"] == 3, "3 buffers ready", 20
    )  # 12 MiB ahead, mapped and faulted in off our path
    assert pool.stats()["prepared_bytes"] == 12 * MiB
    taken = [pool.take(4 * MiB) for _ in range(3)]
    assert pool.stats()["slow_takes"] == 0  # every take found prepared memory
    wait_until(lambda: pool.stats()["idle"] == 3, "3 buffers ready", 20)  # topped up again behind the takes
    assert len(taken) == 3 and pool.stats()["bytes"] == 24 * MiB


def test_eager_preparation_fills_the_bound_and_never_passes_it() -> None:
    pool = HostBufferPool()
    pool.prepare(4 * MiB, limit=20 * MiB, eager=True)
    wait_until(lambda: pool.stats()["bytes"] == 20 * MiB, "20 MiB mapped", 20)
    time.sleep(0.2)
    assert pool.stats()["bytes"] == 20 * MiB and pool.stats()["mappings"] == 5
    held = [pool.take(4 * MiB) for _ in range(6)]  # one more than the bound: mapped on the path, counted
    assert pool.stats()["slow_takes"] == 1 and len(held) == 6


def test_a_take_before_memory_is_ready_is_correct_and_counted() -> None:
    pool = HostBufferPool()
    buffer = pool.take(4 * MiB)  # nothing prepared: a fresh mapping on the caller's path
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * 4 * MiB and pool.stats()["slow_takes"] == 1


def test_device_registration_happens_once_per_mapping_and_is_undone_before_unmapping() -> None:
    pool = HostBufferPool()
    calls: list[tuple[str, int, int]] = []

    def register(address: int, nbytes: int) -> Callable[[], None]:
        calls.append(("register", address, nbytes))
        return lambda: calls.append(("unregister", address, nbytes))

    first = pool.take(4 * MiB)
    pool.register_once(first[1024:], register)
    pool.register_once(first, register)  # the same mapping: registered already
    assert calls == [("register", first.data_ptr(), 4 * MiB)]
    assert pool.stats()["registered_bytes"] == 4 * MiB
    address = first.data_ptr()
    del first
    other = pool.take(8 * MiB)  # a fresh mapping of another size unmaps the idle one: undo first
    assert calls[-1] == ("unregister", address, 4 * MiB) and other.numel() == 8 * MiB


def test_a_refused_registration_is_counted_once_and_a_failed_unregistration_keeps_the_mapping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = HostBufferPool()
    tries: list[int] = []

    def refuse(address: int, nbytes: int) -> Callable[[], None]:
        tries.append(nbytes)
        raise OSError("CUDA_ERROR_OUT_OF_MEMORY: the locked-memory limit")

    refused = pool.take(4 * MiB)
    pool.register_once(refused, refuse)
    pool.register_once(refused, refuse)  # not asked again: the mapping stays pageable
    stats = pool.stats()
    assert tries == [4 * MiB] and stats["register_failures"] == 1 and stats["registered_bytes"] == 0
    assert "stays unregistered" in caplog.text and "locked-memory" in caplog.text
    refused.fill_(3)  # still usable memory
    assert int(refused[-1]) == 3

    def stuck(address: int, nbytes: int) -> Callable[[], None]:
        def undo() -> None:
            raise OSError("CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")

        return undo

    held = pool.take(4 * MiB)
    pool.register_once(held, stuck)
    held.fill_(9)
    del held, refused
    pool.take(8 * MiB)  # unmaps the idle 4 MiB mappings: the stuck one is kept instead
    stats = pool.stats()
    assert stats["kept_mapped"] == 1 and "it stays mapped" in caplog.text
    (kept,) = pool._kept  # still mapped (a closed mmap raises on reading), never handed out again
    assert kept[0] == 9 and kept[len(kept) - 1] == 9
    assert stats["mappings"] == 1 and stats["bytes"] == 12 * MiB  # the kept one still counts


def test_a_device_context_registers_its_chunk_memory_through_its_hook() -> None:
    layers = make_layers(KVFormat.FLASH_ATTN, 4, nb=64, bs=16, h=8, d=128, shared=True)
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=16)
    registered: list[int] = []
    with context(layers, lmcache_tokens_per_chunk=256, layout_hints=hints) as ctx:
        ctx.register_host_memory = lambda address, nbytes: registered.append(nbytes)  # type: ignore[method-assign]
        ctx._device = torch.device("meta")  # stands in for a device: its chunks are registered
        chunks = [ctx.allocate_chunk() for _ in range(2)]
        assert len(registered) == 2 and all(n >= ctx.chunk_nbytes[0] for n in registered)
        ctx._device = torch.device("cpu")
        del chunks

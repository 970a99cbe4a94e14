"""Host memory for chunk payloads: slabs prepared ahead, buffers reused only once nothing can reach them."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from lmcache_platform import KVFormat, LayoutHints
from lmcache_platform._kv import context as context_module
from lmcache_platform._kv import hostalloc
from lmcache_platform._kv.hostalloc import HUGE_PAGE_BYTES, POOL, HostBufferPool, host_empty
from support.cache import context, make_layers
from support.waits import wait_until

MiB = 1 << 20


@pytest.fixture(autouse=True)
def small_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 MiB slabs: the same mechanism as 256 MiB ones, at test sizes."""
    monkeypatch.setattr(hostalloc, "SLAB_BYTES", 8 * MiB)


def shape(pool: HostBufferPool) -> dict[str, int]:
    stats = pool.stats()
    return {k: stats[k] for k in ("mappings", "idle", "bytes")}


def test_a_buffer_is_reused_once_no_tensor_or_view_uses_it() -> None:
    pool = HostBufferPool()
    first = pool.take(4 * MiB)
    address = first.data_ptr()
    view = first[100:200].view(torch.int16)  # a derived view keeps the buffer busy
    del first
    second = pool.take(4 * MiB)
    assert second.data_ptr() != address and shape(pool) == {"mappings": 2, "idle": 0, "bytes": 8 * MiB}
    del view
    assert pool.stats()["idle"] == 1
    third = pool.take(4 * MiB)
    assert third.data_ptr() == address and pool.stats()["idle"] == 0


def test_the_idle_buffers_of_another_size_give_their_space_back() -> None:
    pool = HostBufferPool()
    pool.prepare(limit=16 * MiB, eager=True)
    wait_until(lambda: pool.stats()["bytes"] == 16 * MiB, "16 MiB prepared", 20)
    small = [pool.take(4 * MiB) for _ in range(4)]  # two 8 MiB slabs, carved in four
    base = small[0].data_ptr()
    kept = small.pop(2)
    del small
    assert shape(pool) == {"mappings": 4, "idle": 3, "bytes": 16 * MiB}
    big = pool.take(8 * MiB)  # no room left: the idle 4 MiB buffers give theirs back, two make one
    assert big.data_ptr() == base and pool.stats()["slow_takes"] == 0
    assert shape(pool) == {"mappings": 2, "idle": 0, "bytes": 16 * MiB}
    assert pool.stats()["ready_bytes"] == 4 * MiB  # the last idle one's space, free again
    assert kept.numel() == 4 * MiB and big.numel() == 8 * MiB


def test_buffers_are_page_aligned_and_do_not_overlap() -> None:
    pool = HostBufferPool()
    pool.prepare(limit=8 * MiB, eager=True)
    wait_until(lambda: pool.stats()["bytes"] == 8 * MiB, "8 MiB prepared", 20)
    odd = [pool.take(2 * MiB + 100) for _ in range(3)]
    starts = sorted(b.data_ptr() for b in odd)
    assert all(s % 4096 == 0 for s in starts)
    assert all(b - a >= 2 * MiB + 100 for a, b in itertools.pairwise(starts))
    for i, b in enumerate(odd):
        b.fill_(i)
    assert [int(b[-1]) for b in odd] == [0, 1, 2]


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
        other = ctx.allocate_chunk()  # the first is still held: other memory
        assert other[0].data_ptr() != address
        del chunk
        assert ctx.allocate_chunk()[0].data_ptr() == address


def test_memory_is_prepared_ahead_of_use_without_a_chunk_size_and_a_take_uses_it() -> None:
    pool = HostBufferPool()
    pool.prepare(limit=64 * MiB, ahead=12 * MiB)  # what a server asks at its start
    wait_until(lambda: pool.stats()["ready_bytes"] >= 12 * MiB, "12 MiB ready", 20)
    assert pool.stats()["prepared_bytes"] == 16 * MiB  # two slabs, mapped and faulted in off our path
    taken = [pool.take(4 * MiB) for _ in range(3)]
    assert pool.stats()["slow_takes"] == 0  # every take found prepared memory
    wait_until(lambda: pool.stats()["ready_bytes"] >= 12 * MiB, "topped up again behind the takes", 20)
    assert len(taken) == 3 and pool.stats()["bytes"] == 24 * MiB


def test_eager_preparation_fills_the_bound_and_never_passes_it() -> None:
    pool = HostBufferPool()
    pool.prepare(limit=20 * MiB, eager=True)
    wait_until(lambda: pool.stats()["bytes"] == 20 * MiB, "20 MiB mapped", 20)
    time.sleep(0.2)
    stats = pool.stats()
    assert stats["bytes"] == stats["prepared_bytes"] == stats["target_bytes"] == 20 * MiB  # 8 + 8 + 4
    held = [pool.take(4 * MiB) for _ in range(6)]  # one more than the bound: mapped on the path, counted
    assert pool.stats()["slow_takes"] == 1 and len(held) == 6


def test_a_chunk_larger_than_a_slab_makes_the_later_slabs_hold_it() -> None:
    pool = HostBufferPool()
    pool.prepare(12 * MiB, limit=36 * MiB, eager=True)  # a context's chunks: 12 MiB, slabs of 8
    wait_until(lambda: pool.stats()["bytes"] == 36 * MiB, "36 MiB prepared", 20)
    held = [pool.take(12 * MiB) for _ in range(3)]
    assert pool.stats()["slow_takes"] == 0 and len(held) == 3  # three slabs of 12 MiB


def test_preparing_stops_short_of_the_hosts_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_platform import _headroom

    free = [20 * MiB]  # what the host has left, a slab's worth less per slab prepared
    monkeypatch.setattr(hostalloc, "HEADROOM_RESERVE_BYTES", 4 * MiB)
    monkeypatch.setattr(_headroom, "memory_headroom", lambda: _headroom.Headroom(free[0], "the test's host"))
    pool = HostBufferPool()
    real_new_slab = hostalloc._new_slab

    def counted(nbytes: int, *, extra: bool) -> hostalloc._Slab:
        free[0] -= nbytes
        return real_new_slab(nbytes, extra=extra)

    monkeypatch.setattr(hostalloc, "_new_slab", counted)
    pool.prepare(limit=64 * MiB, eager=True)
    wait_until(lambda: pool.stats()["bytes"] == 16 * MiB, "two slabs", 20)
    time.sleep(0.3)
    assert pool.stats()["bytes"] == 16 * MiB  # a third would leave 4 MiB - 8 MiB: below the reserve


def test_a_take_before_memory_is_ready_is_correct_and_counted() -> None:
    pool = HostBufferPool()
    buffer = pool.take(4 * MiB)  # nothing prepared: a fresh mapping on the caller's path
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * 4 * MiB and pool.stats()["slow_takes"] == 1


@pytest.fixture
def registrations() -> Iterator[
    tuple[list[tuple[str, int, int, str]], Callable[[int, int], Callable[[], None]]]
]:
    calls: list[tuple[str, int, int, str]] = []

    def register(address: int, nbytes: int) -> Callable[[], None]:
        calls.append(("register", address, nbytes, threading.current_thread().name))
        return lambda: calls.append(("unregister", address, nbytes, threading.current_thread().name))

    yield calls, register


def test_slabs_are_registered_as_prepared_once_each_and_unregistered_before_unmapping(
    registrations: tuple[list[tuple[str, int, int, str]], Callable[[int, int], Callable[[], None]]],
) -> None:
    calls, register = registrations
    pool = HostBufferPool()
    pool.prepare(limit=16 * MiB, eager=True)
    wait_until(lambda: pool.stats()["bytes"] == 16 * MiB, "16 MiB prepared", 20)
    pool.use_device(register)  # slabs mapped before the device was known are registered too
    pool.use_device(lambda a, n: pytest.fail("a second device's hook is not needed"))
    assert pool.wait_registered(20)
    assert sorted(n for _, _, n, _ in calls) == [8 * MiB, 8 * MiB]
    assert {thread for *_, thread in calls} == {"lmcache-host-arena"}  # never a take's thread
    assert pool.stats()["registered_bytes"] == 16 * MiB
    held = [pool.take(8 * MiB) for _ in range(2)]
    assert len(calls) == 2  # takes register nothing
    extra = pool.take(6 * MiB)  # past the bound: a slab of its own, registered in the background
    assert pool.wait_registered(20) and calls[-1][:3] == ("register", extra.data_ptr(), 6 * MiB)
    address = extra.data_ptr()
    del extra
    pool.take(2 * MiB)  # the idle extra slab goes back: its registration ends first
    assert ("unregister", address, 6 * MiB) in [c[:3] for c in calls]
    assert len(held) == 2


def test_registration_runs_without_the_pools_lock() -> None:
    pool = HostBufferPool()
    pool.prepare(limit=8 * MiB, eager=True)
    wait_until(lambda: pool.stats()["bytes"] == 8 * MiB, "8 MiB prepared", 20)
    seen: list[dict[str, int]] = []
    pool.use_device(lambda address, nbytes: seen.append(pool.stats()))  # takes the lock: no deadlock
    assert pool.wait_registered(20) and len(seen) == 1


def test_a_refused_registration_is_counted_once_and_a_failed_unregistration_keeps_the_slab(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = HostBufferPool()
    tries: list[int] = []

    def refuse(address: int, nbytes: int) -> Callable[[], None]:
        tries.append(nbytes)
        raise OSError("CUDA_ERROR_OUT_OF_MEMORY: the locked-memory limit")

    refused = pool.take(4 * MiB)
    pool.use_device(refuse)
    assert pool.wait_registered(20)
    pool.take(4 * MiB)  # a second slab: refused too, once
    assert pool.wait_registered(20)
    stats = pool.stats()
    assert tries == [4 * MiB, 4 * MiB] and stats["register_failures"] == 2 and stats["registered_bytes"] == 0
    assert "stays unregistered" in caplog.text and "locked-memory" in caplog.text
    refused.fill_(3)  # still usable memory
    assert int(refused[-1]) == 3

    def undo() -> None:
        raise OSError("CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")

    stuck = HostBufferPool()
    stuck.use_device(lambda address, nbytes: undo)
    held = stuck.take(4 * MiB)
    assert stuck.wait_registered(20)
    held.fill_(9)
    del held
    stuck.take(8 * MiB)  # the idle 4 MiB extra slab goes: its registration does not end, it is kept
    stats = stuck.stats()
    assert stats["kept_mapped"] == 1 and "it stays mapped" in caplog.text
    (kept,) = stuck._kept  # still mapped (a closed mmap raises on reading), never handed out again
    assert kept.region[0] == 9 and kept.region[len(kept.region) - 1] == 9
    assert stats["mappings"] == 1 and stats["bytes"] == 12 * MiB  # the kept one still counts


def test_a_device_context_hands_its_hook_to_the_pool_and_allocates_without_registering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = HostBufferPool()
    monkeypatch.setattr(context_module, "POOL", pool)
    monkeypatch.setattr(hostalloc, "POOL", pool)
    layers = make_layers(KVFormat.FLASH_ATTN, 4, nb=64, bs=16, h=8, d=128, shared=True)
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=16)
    registered: list[tuple[int, str]] = []
    with context(layers, lmcache_tokens_per_chunk=256, layout_hints=hints) as ctx:
        ctx.register_host_memory = lambda address, nbytes: registered.append(  # type: ignore[method-assign]
            (nbytes, threading.current_thread().name)
        )
        ctx._device = torch.device("meta")  # stands in for a device: its chunk memory is registered
        ctx.prepare_host_memory(32 * MiB, eager=True)
        wait_until(lambda: pool.stats()["bytes"] == 32 * MiB, "32 MiB prepared", 20)
        assert pool.wait_registered(20)
        chunks = [ctx.allocate_chunk() for _ in range(2)]
        assert sum(n for n, _ in registered) == 32 * MiB and {t for _, t in registered} == {
            "lmcache-host-arena"
        }
        ctx._device = torch.device("cpu")
        del chunks

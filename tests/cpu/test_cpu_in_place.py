"""Wrapping an existing allocation in place: the memfd is mapped over the engine's own pages.

Large blocks of torch's CPU allocator (glibc mmaps them) own whole pages, so the kit
maps the export over them (``lmcache_platform.hostmem._remap``): nothing moves, every tensor
and view the engine holds keeps its address and sees the shared bytes. Small blocks
share their pages with other heap data and are copied as before. Peak memory is a
benchmark figure (``bench --section migration``), not asserted here.
"""

from __future__ import annotations

import mmap

import numpy
import pytest
import torch

import lmcache_platform
from lmcache_platform import wire
from lmcache_platform.hostmem import _remap
from lmcache_platform_cpu import CpuMemfdIPCWrapper, CpuShmIPCWrapper, _memfd
from lmcache_platform_cpu._memfd import MemfdCapacityError

MiB = 1 << 20


def backing(address: int) -> str:
    """What /proc/self/maps says backs ``address``: a path, or "" for anonymous memory."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


#: Above glibc's largest mmap threshold (32 MiB; it rises up to that as blocks are freed),
#: so the block always gets pages of its own, as a KV cache of GiBs does.
BIG = 40 * MiB


def engine_cache(nbytes: int = BIG) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM's allocation: one flat buffer, a view per layer; a pattern in every page."""
    flat = torch.arange(nbytes // 4, dtype=torch.int32)
    return flat, [flat[i * (nbytes // 16) : (i + 1) * (nbytes // 16)].view(-1, 64) for i in range(4)]


def test_a_large_allocation_is_shared_where_it_lies() -> None:
    flat, layers = engine_cache()
    address, expected = flat.data_ptr(), flat.clone()
    derived = flat[1000:2000]  # a view the engine cut itself: never passed to wrap
    assert _remap.exclusive_pages(flat.untyped_storage()) is not None
    wrappers = lmcache_platform.wrap_kv_caches(layers)
    try:
        name = wrappers[0].fields()["memfd_name"]
        assert flat.data_ptr() == address and layers[2].data_ptr() == address + BIG // 2
        assert backing(address).startswith(f"/memfd:{name}")  # type: ignore[str-bytes-safe]
        assert torch.equal(flat, expected)  # every byte moved with its page
        assert len({w.fields()["memfd_ino"] for w in wrappers}) == 1
        server = wire.decode(wire.encode(wrappers))
        views = [w.to_tensor() for w in server]
        derived.fill_(-5)  # through the engine's own view, and through the flat buffer
        flat[-1] = -9
        assert torch.equal(views[0].reshape(-1)[1000:2000], torch.full((1000,), -5, dtype=torch.int32))
        assert views[3].reshape(-1)[-1].item() == -9
        views[1].fill_(3)  # and the server's writes reach every engine tensor
        assert layers[1].eq(3).all() and flat[flat.numel() // 4].item() == 3
        for w in server:
            w.close()
        del views
    finally:
        for w in wrappers:
            w.close()


def test_wrapping_again_names_the_same_memory_without_copying() -> None:
    flat, layers = engine_cache()
    first = CpuMemfdIPCWrapper.wrap(layers[0])
    fds = _memfd.owned()
    again = [CpuMemfdIPCWrapper.wrap(t) for t in (layers[0], layers[3], flat)]
    assert _memfd.owned() == fds and again[0] == first
    assert {w.memfd_ino for w in again} == {first.memfd_ino}
    # The storage starts inside its first page: the offset is in the descriptor, in elements.
    offset = (flat.data_ptr() % mmap.PAGESIZE) // 4
    assert again[2].storage_offset == offset and again[1].storage_offset == offset + 3 * flat.numel() // 4
    for w in [first, *again]:
        w.close()
    assert not (_memfd.owned() - fds)


def test_small_and_foreign_storages_are_copied_instead() -> None:
    small = torch.arange(1024, dtype=torch.float32)  # heap memory: its pages hold other data too
    array = torch.from_numpy(numpy.arange(2 * MiB, dtype="uint8"))  # numpy's memory
    for t in (small, array):
        assert _remap.exclusive_pages(t.untyped_storage()) is None
        before, expected = t.data_ptr(), t.clone()
        w = CpuMemfdIPCWrapper.wrap(t)
        assert t.data_ptr() != before and torch.equal(t, expected)  # re-pointed at the copy
        w.close()


def test_the_exclusive_page_check_refuses_what_it_cannot_prove() -> None:
    whole = torch.empty(BIG, dtype=torch.uint8)
    found = _remap.exclusive_pages(whole.untyped_storage())
    assert found is not None
    address, length = found
    assert address % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
    assert address < whole.data_ptr() < address + mmap.PAGESIZE
    assert whole.data_ptr() + BIG <= address + length < whole.data_ptr() + BIG + 2 * mmap.PAGESIZE
    shared = torch.frombuffer(mmap.mmap(-1, 4 * MiB), dtype=torch.uint8)  # not torch's allocator
    assert _remap.exclusive_pages(shared.untyped_storage()) is None


def test_a_full_store_midway_leaves_the_tensor_intact_and_nothing_exported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flat, layers = engine_cache(3 * _remap.SLICE // 2)  # two slices
    expected, address = flat.clone(), flat.data_ptr()
    calls: list[int] = []
    reserve = _memfd.MemfdStore.reserve

    def second_fails(self: _memfd.MemfdStore, fd: int, offset: int, nbytes: int) -> None:
        calls.append(offset)
        if offset:
            raise MemfdCapacityError(nbytes, _memfd.Headroom(0, "a test's limit"))  # type: ignore[attr-defined]
        reserve(self, fd, offset, nbytes)

    monkeypatch.setattr(_memfd.MemfdStore, "reserve", second_fails)
    fds = _memfd.owned()
    with pytest.raises(lmcache_platform.WrapError, match="a test's limit") as info:
        lmcache_platform.wrap_kv_caches(layers)
    assert isinstance(info.value.__cause__, MemfdCapacityError) and calls == [0, _remap.SLICE]
    assert _memfd.owned() == fds  # no export left behind
    assert flat.data_ptr() == address and torch.equal(flat, expected)
    monkeypatch.undo()
    wrappers = lmcache_platform.wrap_kv_caches(layers)  # half-shared pages: copied this time
    assert torch.equal(torch.cat([t.reshape(-1) for t in layers]), expected)
    for w in wrappers:
        w.close()


def test_the_export_goes_when_the_engine_frees_its_tensor() -> None:
    """torch tells no one when a storage dies; the next wrap finds out and releases its memfd."""
    flat, layers = engine_cache()
    wrapper = CpuMemfdIPCWrapper.wrap(layers[0])

    def exported_inodes() -> set[int]:
        return set(_memfd._owned.values())

    assert wrapper.memfd_ino in exported_inodes()
    del flat, layers
    assert wrapper.memfd_ino in exported_inodes()
    other = CpuMemfdIPCWrapper.wrap(torch.zeros(2 * MiB, dtype=torch.uint8))
    assert wrapper.memfd_ino not in exported_inodes()
    wrapper.close()  # after its memory went: harmless
    other.close()


def test_named_segments_are_mapped_in_place_too() -> None:
    flat, layers = engine_cache()
    address, expected = flat.data_ptr(), flat.clone()
    wrapper = CpuShmIPCWrapper.wrap(layers[1])
    try:
        assert flat.data_ptr() == address and torch.equal(flat, expected)
        assert backing(address) == f"/dev/shm/{wrapper.shm_name}"
        view = CpuShmIPCWrapper.from_fields(wrapper.fields())
        flat[flat.numel() // 4] = -3  # the first element of layer 1, through the flat buffer
        assert view.to_tensor()[0, 0].item() == -3
        view.close()
    finally:
        wrapper.close()

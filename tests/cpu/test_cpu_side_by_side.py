"""Reopening separate exports side by side: ``HostMemoryIPCWrapper.to_tensors``.

Older engines allocate each layer's KV cache apart, so each layer is an export of its
own. A cache context reopens them with one ``to_tensors`` call, which maps them at
equal steps in one reserved address range: one storage, where the layers stack and
move with one op per group. Real memfds and /dev/shm segments, reopened through the
wire as a server does.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import (
    DescriptorError,
    KVFormat,
    LayoutHints,
    create_cache_context,
    wire,
)
from lmcache_platform.hostmem import HostMemoryIPCWrapper, SideBySideStore
from lmcache_platform_cpu import CpuMemfdIPCWrapper, CpuShmIPCWrapper, _memfd, _shm
from support.cache import engine_kv, slot_rows, token_rows

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 4, 32, 16, 2, 64
SHAPE = (2, BLOCKS, BLOCK, HEADS, HEAD)  # flash-attention, one allocation per layer


def engine_layers() -> list[torch.Tensor]:
    """Per-layer KV caches with a distinct pattern in every layer and element."""
    n = 2 * BLOCKS * BLOCK * HEADS * HEAD
    return [
        (torch.arange(n, dtype=torch.int32) + layer * n).to(torch.float32).view(SHAPE)
        for layer in range(LAYERS)
    ]


def mapped_files(pid: int | str = "self") -> list[str]:
    """Our memory's mappings here, once pending garbage (an earlier test's cycles) is freed."""
    gc.collect()
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(maxsplit=5)[5].strip() for line in f if "lmcache_platform_" in line]


def open_fds() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def received(wrappers: list[Any]) -> list[Any]:
    """The wrappers as a server gets them: through the wire."""
    return wire.decode(wire.encode(wrappers))


@contextmanager
def exported(tensors: list[torch.Tensor]) -> Iterator[tuple[list[Any], list[Any]]]:
    """The engine's wrappers of ``tensors`` and the server's, all closed afterwards."""
    wrappers = lp.wrap_kv_caches(tensors)
    server = received(wrappers)
    try:
        yield wrappers, server
    finally:
        for w in [*server, *wrappers]:
            w.close()


def test_separate_exports_reopen_as_one_storage_at_equal_steps(kind: str) -> None:
    layers = engine_layers()
    with exported(layers) as (_, server):
        assert len({tuple(w.export_fields().items()) for w in server}) == LAYERS  # four exports
        before = len(mapped_files())
        tensors = type(server[0]).to_tensors(server)
        assert len(mapped_files()) == before + LAYERS  # one mapping per export, in one range
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        steps = {b.storage_offset() - a.storage_offset() for a, b in itertools.pairwise(tensors)}
        assert len(steps) == 1 and steps.pop() > 0
        for engine, reopened in zip(layers, tensors, strict=True):
            assert torch.equal(reopened, engine)
        layers[2][1, 5] = -1.0  # the engine writes; the server sees it
        tensors[3][0, 7] = -2.0  # the server writes; the engine sees it
        assert torch.equal(tensors[2], layers[2]) and torch.equal(tensors[3], layers[3])
        assert all(torch.equal(w.to_tensor(), t) for w, t in zip(server, tensors, strict=True))


def test_the_range_lives_while_a_tensor_does_and_then_goes_with_its_fds(kind: str) -> None:
    layers = engine_layers()
    with exported(layers) as (_, server):
        gc.collect()
        maps, fds = len(mapped_files()), open_fds()
        tensors = type(server[0]).to_tensors(server)
        for w in server:
            w.close()
        last = tensors.pop()
        del tensors
        gc.collect()
        assert len(mapped_files()) == maps + LAYERS  # one tensor keeps the whole range
        assert torch.equal(last, layers[-1])
        del last
        gc.collect()
        assert (len(mapped_files()), open_fds()) == (maps, fds)


def test_views_of_one_record_share_their_place(kind: str) -> None:
    """vLLM's layers are views of one allocation; a second allocation sits beside it."""
    whole = torch.arange(4 * 4096, dtype=torch.float32).view(4, 4096)
    other = torch.full((4096,), 3.0)
    engine = [*whole.unbind(0), other]  # the memory lives while the engine's tensors do
    with exported(engine) as (_, server):
        tensors = type(server[0]).to_tensors(server)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        assert [t.storage_offset() - tensors[0].storage_offset() for t in tensors[:4]] == [
            0,
            4096,
            8192,
            12288,
        ]
        assert all(torch.equal(t, e) for t, e in zip(tensors, engine, strict=True))


def test_an_export_that_fails_its_checks_leaves_nothing_mapped_or_open(kind: str) -> None:
    layers = engine_layers()
    with exported(layers) as (wrappers, server):
        gone = wrappers[2]
        gone.close()  # its producer releases the third export: unlinked, or its fd closed
        del layers[2]
        gc.collect()
        maps, fds = mapped_files(), open_fds()
        name = gone.fields()["shm_name" if kind == "shm" else "memfd_name"]
        with pytest.raises(DescriptorError, match=name):
            type(server[0]).to_tensors(server)
        gc.collect()
        assert (mapped_files(), open_fds()) == (maps, fds)  # the two exports opened before it are shut
        assert not any(w._opened() for w in server)


def test_memory_shrunk_under_the_range_is_refused_before_a_transfer() -> None:
    """A named segment can be truncated by any process of its user; verify() says so."""
    layers = [torch.full((1 << 16,), float(i)) for i in range(3)]
    wrappers = [CpuShmIPCWrapper.wrap(t) for t in layers]
    server = received(wrappers)
    try:
        tensors = CpuShmIPCWrapper.to_tensors(server)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        fd = _shm._posixshmem.shm_open("/" + wrappers[1].shm_name, os.O_RDWR, 0)  # type: ignore[attr-defined]
        try:
            os.ftruncate(fd, 4096)
        finally:
            os.close(fd)
        server[0].verify()
        with pytest.raises(DescriptorError, match="shrank to 4096"):
            server[1].verify()
        del tensors
    finally:
        for w in [*server, *wrappers]:
            w.close()


class RequiredMembersOnly:
    """The memfd store's six required members and nothing else: not a ``SideBySideStore``."""

    handle_fields = _memfd.STORE.handle_fields
    check_handle = _memfd.STORE.check_handle
    check_capacity = _memfd.STORE.check_capacity
    create = _memfd.STORE.create
    open_existing = _memfd.STORE.open_existing
    release = _memfd.STORE.release


class _MemfdWithoutOpenFd(HostMemoryIPCWrapper):
    wire_tag: ClassVar[str] = "test.memfd-without-open-fd/1"
    store = RequiredMembersOnly()
    nbytes_field: ClassVar[str] = CpuMemfdIPCWrapper.nbytes_field


def test_a_store_that_is_not_a_side_by_side_store_maps_each_export_on_its_own() -> None:
    assert not isinstance(_MemfdWithoutOpenFd.store, SideBySideStore)
    assert isinstance(CpuMemfdIPCWrapper.store, SideBySideStore)
    layers = engine_layers()
    wrappers = [_MemfdWithoutOpenFd.wrap(t) for t in layers]
    try:
        tensors = _MemfdWithoutOpenFd.to_tensors(wrappers)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == LAYERS
        assert all(torch.equal(t, e) for t, e in zip(tensors, layers, strict=True))
    finally:
        for w in wrappers:
            w.close()


def rows(entry: Any, fmt: KVFormat, block: int) -> torch.Tensor:
    """Every token of ``block`` in one layer, indexed by hand (``support.cache``)."""
    if isinstance(entry, tuple):
        return slot_rows(entry, BLOCK, block, 0, BLOCK)
    return token_rows(entry, fmt, block, 0, BLOCK)


@pytest.mark.parametrize("fmt", [KVFormat.FLASH_ATTN, KVFormat.FLASH_ATTN_HND, KVFormat.MLA, KVFormat.SGLANG])
def test_a_server_context_stacks_per_layer_exports_and_moves_exact_bytes(kind: str, fmt: KVFormat) -> None:
    first = engine_kv(fmt, 1, BLOCKS, BLOCK, HEADS, HEAD)[0]
    gen = torch.Generator().manual_seed(7)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen).to(t.dtype)

    layers = [
        tuple(fresh(t) for t in first) if isinstance(first, tuple) else fresh(first) for _ in range(LAYERS)
    ]
    wrapped = lp.wrap_kv_caches(layers)  # type: ignore[arg-type]
    flat = [w for e in wrapped for w in (e if isinstance(e, tuple) else (e,))]
    decoded = iter(received(flat))
    server = [(next(decoded), next(decoded)) if isinstance(e, tuple) else next(decoded) for e in wrapped]
    hints = LayoutHints(kv_format=fmt, block_size=BLOCK, num_kv_heads=None if fmt is KVFormat.MLA else HEADS)
    try:
        with create_cache_context(server, BLOCK * 2, layout_hints=hints) as ctx:
            assert [kg["stacked"] for kg in ctx.report_status()["kernel_groups"]] == [True]
            sources = [torch.cat([rows(e, fmt, 3), rows(e, fmt, 9)], 1) for e in layers]
            untouched = [rows(e, fmt, 0).clone() for e in layers]
            ctx.store_chunk([[3, 9]], slot=0)
            ctx.retrieve_chunk([[12, 5]], slot=0)  # into other blocks, in the other order
            for e, source, kept in zip(layers, sources, untouched, strict=True):
                assert torch.equal(torch.cat([rows(e, fmt, 12), rows(e, fmt, 5)], 1), source)
                assert torch.equal(rows(e, fmt, 0), kept)
    finally:
        for w in flat:
            w.close()


def test_wrapping_a_tensor_of_the_range_again_names_its_export(kind: str) -> None:
    """A server that re-exports what it reopened shares the engine's memory, not a copy."""
    layers = engine_layers()
    with exported(layers) as (wrappers, server):
        tensors = type(server[0]).to_tensors(server)
        again = type(wrappers[0]).wrap(tensors[2][1])  # a view of one layer
        try:
            assert again.export_fields() == wrappers[2].export_fields()
            assert again.storage_offset == wrappers[2].storage_offset + layers[2][1].storage_offset()
            reopened = type(again).from_fields(again.fields())
            try:
                layers[2][1, 0] = 42.0
                assert torch.equal(reopened.to_tensor(), layers[2][1])
            finally:
                reopened.close()
        finally:
            again.close()


def test_views_of_two_allocations_in_turn_map_each_allocation_once(kind: str) -> None:
    """K and V pools cut into per-layer views, registered K0, V0, K1, V1, ...: two exports."""
    keys, values = (torch.arange(LAYERS * 8192, dtype=torch.float32).view(LAYERS, 8192) + i for i in (0, 1e6))
    engine = [t for layer in zip(keys.unbind(0), values.unbind(0), strict=True) for t in layer]
    with exported(engine) as (_, server):
        before = len(mapped_files())
        tensors = type(server[0]).to_tensors(server)
        assert len(mapped_files()) == before + 2
        assert all(torch.equal(t, e) for t, e in zip(tensors, engine, strict=True))
        k_steps = {b.storage_offset() - a.storage_offset() for a, b in itertools.pairwise(tensors[0::2])}
        assert k_steps == {8192}


def test_a_closed_wrapper_is_refused_before_anything_is_mapped(kind: str) -> None:
    layers = engine_layers()
    with exported(layers) as (_, server):
        server[1].close()
        maps, fds = mapped_files(), open_fds()
        with pytest.raises(DescriptorError, match="is closed"):
            type(server[0]).to_tensors(server)
        assert (mapped_files(), open_fds()) == (maps, fds)

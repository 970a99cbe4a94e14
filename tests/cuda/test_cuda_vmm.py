"""The VMM kind: export of CUDA virtual memory as fds, import, lifetime, refusals, selection.

No GPU here: libcuda is ``FakeVmmLib`` (support.cuda_fakes) under the real ``CudaDriver``
binding. Its "device memory" is host memory in memfds, mapped into reserved ranges with
``MAP_FIXED`` and no access until ``cuMemSetAccess``; exported handles are real fds, and
an import maps the same pages at another address, so a "server" tensor really aliases the
"engine" one. Host tensors count as on cuda:0 (``fake_vmm`` fixture). The real driver is
exercised by ``test_cuda_vmm_gpu.py``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import socket
import threading
from typing import Any

import pytest
import torch

from lmcache_platform import DescriptorError, DeviceIPCWrapper, WireFormatError, wire
from lmcache_platform._plugins.registry import wire_classes_for
from lmcache_platform_cuda import (
    IPC_ENV,
    CudaAutoIPCWrapper,
    CudaIPCWrapper,
    CudaVmmIPCWrapper,
    NotVmmMemoryError,
    RawCudaIPCWrapper,
    VmmMemoryError,
    VmmNotExportableError,
    VmmUnsupportedError,
    _plugin,
    _torch_ipc,
    _vmm_ipc,
    is_vmm_memory,
    selected_ipc_kind,
)
from lmcache_platform_cuda._vmm_ipc import EXPORTS
from support import cuda_vmm
from support.cuda_fakes import GRANULE, UUIDS, FakeDevices, FakeVmmLib, HostCudaDriver, open_fds

ALLOWED = {CudaVmmIPCWrapper.wire_tag: CudaVmmIPCWrapper}


def fill(t: torch.Tensor, seed: int) -> None:
    t.copy_((torch.arange(t.numel(), dtype=torch.int64) * 7 + seed).to(torch.uint8).view(t.shape))


def cache(lib: FakeVmmLib, chunks: list[int], **kw: Any) -> torch.Tensor:
    """vLLM's extensible layout; the committed bytes as one flat uint8 tensor, filled."""
    flat = lib.host_tensor(lib.extensible(chunks, **kw), sum(chunks))
    fill(flat, 1)
    return flat


def ship(wrappers: list[DeviceIPCWrapper]) -> list[DeviceIPCWrapper]:
    """Engine to server in this process: the message and dups of its fds, as SCM_RIGHTS delivers."""
    data, fds = wire.encode_with_fds(wrappers)
    return wire.decode(data, fds=[os.dup(fd) for fd in fds], allowed=ALLOWED)


# -- export ------------------------------------------------------------------------------


def test_one_allocation(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [4 * GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    assert (w.segment_offsets, w.segment_sizes, w.storage_start, w.storage_offset) == (
        (0,),
        (4 * GRANULE,),
        0,
        0,
    )
    assert os.fstat(w.segment_fds[0]).st_size == 4 * GRANULE  # a real fd of the allocation
    w.close()


def test_several_allocations_become_one_span(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE, 2 * GRANULE, GRANULE])
    before = open_fds()
    w = CudaVmmIPCWrapper.wrap(flat[3:])
    assert w.segment_offsets == (0, GRANULE, 3 * GRANULE)
    assert w.segment_sizes == (GRANULE, 2 * GRANULE, GRANULE)
    assert (w.storage_start, w.storage_offset) == (0, 3)
    assert open_fds() == before + 3
    (got,) = ship([w])
    assert torch.equal(got.to_tensor(), flat[3:])
    got.close()
    w.close()
    gc.collect()
    assert open_fds() == before


def test_a_view_in_the_middle_exports_its_storage_and_replays_the_view(fake_vmm: FakeVmmLib) -> None:
    """A strided window inside the second allocation: the export is still the whole storage."""
    flat = cache(fake_vmm, [GRANULE, 2 * GRANULE, GRANULE])
    grid = flat.view(torch.int16).view(-1, 512)  # rows of 1 KiB
    view = grid[2100:2300, 7:300:3]  # starts in the second allocation
    w = CudaVmmIPCWrapper.wrap(view)
    assert len(w.segment_fds) == 3 and w.storage_start == 0
    assert (w.shape, w.stride, w.storage_offset) == (
        tuple(view.shape),
        tuple(view.stride()),
        view.storage_offset(),
    )
    (got,) = ship([w])
    seen = got.to_tensor()
    assert seen.dtype == torch.int16 and torch.equal(seen, view)
    seen.fill_(-1)  # the server writes: the engine sees it there, and only there
    assert bool((view == -1).all())
    outside = torch.ones_like(grid, dtype=torch.bool)
    outside[2100:2300, 7:300:3] = False
    expected = torch.empty_like(flat)
    fill(expected, 1)
    assert torch.equal(grid[outside], expected.view(torch.int16).view(-1, 512)[outside])
    got.close()
    w.close()


def test_a_storage_that_is_part_of_the_memory_exports_only_its_allocations(fake_vmm: FakeVmmLib) -> None:
    """vLLM's per-layer storages (``segment_view``): each covers its own allocations."""
    base = cache(fake_vmm, [GRANULE, 2 * GRANULE, GRANULE]).data_ptr()
    middle = fake_vmm.host_tensor(base + GRANULE + 4096, 2 * GRANULE - 4096)  # inside allocation 2
    w = CudaVmmIPCWrapper.wrap(middle)
    assert (w.segment_sizes, w.storage_start) == ((2 * GRANULE,), 4096)
    (got,) = ship([w])
    assert torch.equal(got.to_tensor(), middle)
    got.close()
    w.close()


def test_a_view_of_a_reservation_counts_from_the_mapped_span(fake_vmm: FakeVmmLib) -> None:
    """vLLM's ``full_view()``: the storage spans the whole reservation, mostly unmapped."""
    base = fake_vmm.reserve(8 * GRANULE)
    for offset in (0, 4 * GRANULE):  # two mapped islands, a hole between them
        handle = fake_vmm.create(GRANULE)
        fake_vmm.map(base + offset, GRANULE, handle)
        fake_vmm.release(handle)
        fake_vmm.set_access(base + offset, GRANULE)
    full = fake_vmm.host_tensor(base, 8 * GRANULE)  # never touched where unmapped
    island = full[4 * GRANULE : 5 * GRANULE]
    fill(island, 3)
    view = full[4 * GRANULE + 100 : 4 * GRANULE + 4000]
    w = CudaVmmIPCWrapper.wrap(view)
    assert (w.segment_sizes, w.storage_start, w.storage_offset) == ((GRANULE,), 0, 100)
    (got,) = ship([w])
    assert torch.equal(got.to_tensor(), view)
    got.close()
    w.close()
    with pytest.raises(DescriptorError, match="unmapped memory before the VMM kind can export"):
        CudaVmmIPCWrapper.wrap(full[GRANULE - 10 : GRANULE + 10])  # runs into the hole


def test_per_layer_views_share_one_export_and_one_import(fake_vmm: FakeVmmLib) -> None:
    """vLLM's block-outermost layout: every layer is a view of one storage."""
    flat = cache(fake_vmm, [2 * GRANULE, 2 * GRANULE])
    base = flat.data_ptr()
    layers = list(flat.view(torch.bfloat16).view(128, 8, 4096).unbind(1))  # [blocks, layer, bytes]
    before = open_fds()
    wrapped = [CudaVmmIPCWrapper.wrap(t) for t in layers]
    assert open_fds() == before + 2  # each allocation exported once, whatever the layers
    assert all(w.export_fields() == wrapped[0].export_fields() for w in wrapped)
    key = (0, base, 2 * GRANULE, next(iter(fake_vmm.allocations)))
    assert EXPORTS.refs(key) == 8
    data, fds = wire.encode_with_fds(wrapped)
    assert len(fds) == 2 and data.count(b"cuda.vmm/1") == 1  # one record, the fds once
    decoded = wire.decode(data, fds=[os.dup(fd) for fd in fds], allowed=ALLOWED)
    mappings = len(fake_vmm.mappings)
    tensors = [w.to_tensor() for w in decoded]
    assert len(fake_vmm.mappings) == mappings + 2  # one import for all eight views
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one storage here too
    assert all(torch.equal(a, b) for a, b in zip(tensors, layers, strict=True))
    for w in decoded[:-1]:
        w.close()
    assert tensors[0].sum() is not None  # the last holder keeps the mapping
    decoded[-1].close()
    del tensors
    gc.collect()
    assert len(fake_vmm.mappings) == mappings
    for w in wrapped[:-1]:
        w.close()
    assert EXPORTS.refs(key) == 1 and open_fds() == before + 2
    wrapped[-1].close()
    assert EXPORTS.refs(key) == 0 and open_fds() == before


def test_an_empty_tensor_needs_no_export(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat[5:5])
    assert w.segment_fds == () and w.nbytes == 0
    assert wire.encode_with_fds([w])[1] == []
    assert not [call for call in fake_vmm.calls if call.startswith("cuMem")]


# -- import and lifetime -------------------------------------------------------------


def test_close_releases_everything_once_the_tensors_are_gone(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE, GRANULE])
    counts = (len(fake_vmm.mappings), len(fake_vmm.reservations), len(fake_vmm.allocations))
    baseline = open_fds()
    w = CudaVmmIPCWrapper.wrap(flat)
    (got,) = ship([w])
    view = got.to_tensor()[10:]
    assert got.to_tensor().data_ptr() == view.data_ptr() - 10  # a second to_tensor maps nothing new
    assert len(fake_vmm.mappings) == counts[0] + 2 and len(fake_vmm.reservations) == counts[1] + 1
    got.close()
    got.close()  # idempotent
    gc.collect()
    assert len(fake_vmm.mappings) == counts[0] + 2  # a live tensor keeps the mapping
    view[0] = 9
    assert int(flat[10]) == 9
    del view
    gc.collect()
    assert (len(fake_vmm.mappings), len(fake_vmm.reservations), len(fake_vmm.allocations)) == counts
    w.close()
    assert open_fds() == baseline  # the server's fds and the engine's exports
    with pytest.raises(DescriptorError, match="is closed; decode the descriptor again"):
        got.to_tensor()


def test_an_undecoded_import_closes_its_fds_when_collected(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    baseline = open_fds()
    (got,) = ship([w])
    assert open_fds() == baseline + 1
    del got  # never closed
    gc.collect()
    assert open_fds() == baseline
    w.close()


def test_the_engine_can_open_its_own_export(fake_vmm: FakeVmmLib) -> None:
    """A wrapper made by wrap() borrows the exported fds; closing it closes them once."""
    flat = cache(fake_vmm, [GRANULE])
    baseline = open_fds()
    w = CudaVmmIPCWrapper.wrap(flat)
    t = w.to_tensor()
    assert torch.equal(t, flat) and t.data_ptr() != flat.data_ptr()
    w.close()
    del t
    gc.collect()
    assert open_fds() == baseline and len(fake_vmm.reservations) == 1


@pytest.mark.parametrize(
    "call, after",
    [
        ("cuMemImportFromShareableHandle", 1),
        ("cuMemMap", 1),
        ("cuMemMap", 2),
        ("cuMemSetAccess", 0),
        ("cuMemAddressReserve", 0),
    ],
)
def test_a_failure_in_the_middle_of_an_import_leaves_nothing(
    fake_vmm: FakeVmmLib, call: str, after: int
) -> None:
    flat = cache(fake_vmm, [GRANULE, GRANULE, GRANULE])
    counts = (len(fake_vmm.mappings), len(fake_vmm.reservations), len(fake_vmm.allocations))
    baseline = open_fds()
    w = CudaVmmIPCWrapper.wrap(flat)
    (got,) = ship([w])
    fake_vmm.fail(call, after=after)
    with pytest.raises(DescriptorError, match=f"{call} failed: CUDA_ERROR_OUT_OF_MEMORY"):
        got.to_tensor()
    assert (len(fake_vmm.mappings), len(fake_vmm.reservations), len(fake_vmm.allocations)) == counts
    assert torch.equal(got.to_tensor(), flat)  # nothing half-done: a retry maps it whole
    got.close()
    w.close()
    gc.collect()
    assert open_fds() == baseline
    assert (len(fake_vmm.mappings), len(fake_vmm.reservations), len(fake_vmm.allocations)) == counts


def test_a_failed_export_leaves_no_fd(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE, GRANULE, GRANULE])
    base = flat.data_ptr()
    baseline = open_fds()
    fake_vmm.fail("cuMemExportToShareableHandle", after=2)
    with pytest.raises(DescriptorError, match="cuMemExportToShareableHandle failed"):
        CudaVmmIPCWrapper.wrap(flat)
    assert open_fds() == baseline and not any(EXPORTS.refs(k) for k in _keys(fake_vmm, base))


def _keys(lib: FakeVmmLib, base: int) -> list[tuple[int, int, int, int]]:
    return [(0, p, s, a.handle) for p, (s, a) in lib.mappings.items() if p >= base]


def test_every_driver_call_runs_in_the_primary_context(fake_vmm: FakeVmmLib) -> None:
    """The fake asserts a pushed context on each call; afterwards the stack is empty again."""
    flat = cache(fake_vmm, [GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    (got,) = ship([w])
    got.to_tensor()
    assert fake_vmm.stack == []
    assert {
        "cuMemRetainAllocationHandle",
        "cuMemExportToShareableHandle",
        "cuMemMap",
        "cuMemSetAccess",
    } <= set(fake_vmm.calls)
    got.close()
    w.close()


# -- typed refusals ------------------------------------------------------------------


def test_allocator_memory_is_not_vmm_memory(fake_vmm: FakeVmmLib) -> None:
    t = fake_vmm.host_tensor(fake_vmm.allocator_memory(4096), 4096)
    assert not is_vmm_memory(t)
    with pytest.raises(NotVmmMemoryError, match="LMCACHE_PLATFORM_CUDA_IPC=auto"):
        CudaVmmIPCWrapper.wrap(t)


def test_memory_without_exportable_handles_names_the_fix(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE], handle_types=0)
    baseline = open_fds()
    with pytest.raises(VmmNotExportableError) as info:
        CudaVmmIPCWrapper.wrap(flat)
    for words in (
        "KVCacheAccess.EXPORTS_FD",
        "enable_extensible_kv_cache=False",
        "LMCACHE_PLATFORM_CUDA_IPC",
    ):
        assert words in str(info.value)
    assert open_fds() == baseline


@pytest.mark.parametrize("missing", ["vmm_supported", "posix_fd_supported"])
def test_a_device_without_vmm_or_fd_handles_refuses_before_mapping(
    fake_vmm: FakeVmmLib, missing: str
) -> None:
    flat = cache(fake_vmm, [GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    (got,) = ship([w])
    setattr(fake_vmm, missing, 0)
    mappings = len(fake_vmm.mappings)
    with pytest.raises(VmmUnsupportedError, match="does not support"):
        got.to_tensor()
    assert len(fake_vmm.mappings) == mappings and "cuMemAddressReserve" not in fake_vmm.calls
    got.close()
    w.close()


def test_a_granularity_mismatch_is_refused_before_mapping(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE, GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    (got,) = ship([w])
    fake_vmm.granularity = 4 * GRANULE  # a server GPU with larger pages
    with pytest.raises(VmmUnsupportedError, match="VMM granularity of 8388608 bytes"):
        got.to_tensor()
    assert "cuMemAddressReserve" not in fake_vmm.calls
    fake_vmm.granularity = GRANULE
    got.close()
    w.close()


def test_a_driver_without_the_vmm_api(monkeypatch: pytest.MonkeyPatch, fake_devices: FakeDevices) -> None:
    fake_devices.set(UUIDS[:1])
    lib = FakeVmmLib(vmm=False)
    driver = HostCudaDriver(lib)  # type: ignore[arg-type]  # loads: raw IPC still works
    monkeypatch.setattr(_vmm_ipc, "get_runtime", lambda: driver)
    monkeypatch.setattr(_vmm_ipc, "cuda_ordinal", lambda tensor: 0)
    t = torch.zeros(16, dtype=torch.uint8)
    assert not is_vmm_memory(t)  # no VMM API, no VMM memory
    with pytest.raises(VmmUnsupportedError, match="no virtual memory management API"):
        CudaVmmIPCWrapper.wrap(t)


def test_plain_encode_refuses_fd_fields(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    with pytest.raises(WireFormatError, match="encode_with_fds"):
        wire.encode([w])
    w.close()


def test_the_legacy_kinds_name_the_vmm_kind(fake_vmm: FakeVmmLib, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw: the driver's export. Torch: ``_share_cuda_`` fails (here: no CUDA), then the memory
    is found to be virtual memory (the fake), so the refusal names the VMM kind."""
    flat = cache(fake_vmm, [GRANULE])
    base = flat.data_ptr()
    driver = _vmm_ipc.get_runtime()
    assert isinstance(driver, HostCudaDriver)
    with pytest.raises(VmmMemoryError, match="LMCACHE_PLATFORM_CUDA_IPC=auto") as info:
        driver.export(base, 0)
    assert "expandable_segments" in str(info.value)
    monkeypatch.setattr(_torch_ipc, "require_cuda", lambda cls, tensor: 0)
    with pytest.raises(VmmMemoryError, match="share it with the VMM kind"):
        CudaIPCWrapper.wrap(flat)
    plain = torch.zeros(8)
    monkeypatch.setattr(_vmm_ipc, "cuda_ordinal", lambda tensor: None)  # not CUDA memory at all
    with pytest.raises(DescriptorError, match="torch cannot share this CUDA storage") as other:
        CudaIPCWrapper.wrap(plain)
    assert not isinstance(other.value, VmmMemoryError)


# -- selection -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", CudaAutoIPCWrapper),
        ("auto", CudaAutoIPCWrapper),
        ("torch", CudaIPCWrapper),
        ("raw", RawCudaIPCWrapper),
        (" VMM ", CudaVmmIPCWrapper),
    ],
)
def test_the_variable_selects_the_kind(value: str, expected: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IPC_ENV, value)
    assert _plugin.lmcache_platform_ipc_wrapper_class(device_type="cuda") is expected
    assert selected_ipc_kind() == (value.strip().lower() or "auto")


def test_auto_picks_per_tensor(fake_vmm: FakeVmmLib, monkeypatch: pytest.MonkeyPatch) -> None:
    flat = cache(fake_vmm, [GRANULE])
    allocator = fake_vmm.host_tensor(fake_vmm.allocator_memory(4096), 4096)
    assert CudaAutoIPCWrapper.wrapper_class_for(flat[8:]) is CudaVmmIPCWrapper
    assert CudaAutoIPCWrapper.wrapper_class_for(allocator) is CudaIPCWrapper
    assert CudaAutoIPCWrapper.wrapper_class_for(flat[:0]) is CudaIPCWrapper  # nothing to share
    w = CudaAutoIPCWrapper.wrap(flat)  # the bare factory delegates too
    assert type(w) is CudaVmmIPCWrapper
    w.close()
    shared: list[torch.Tensor] = []

    def torch_kind(cls: type, t: torch.Tensor) -> str:
        shared.append(t)
        return "torch-kind"

    monkeypatch.setattr(CudaIPCWrapper, "wrap", classmethod(torch_kind))
    assert CudaAutoIPCWrapper.wrap(allocator) == "torch-kind" and shared == [allocator]


@pytest.mark.parametrize("kind", ["auto", "torch", "raw", "vmm"])
def test_the_receiver_accepts_every_kind_whatever_it_exports(
    kind: str, fake_vmm: FakeVmmLib, lmcache_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default allow-list (the resolved backend's wire classes). Probe faked available."""
    from lmcache_platform_cuda import _probe

    monkeypatch.setattr(_probe, "probe", lambda: _probe.Availability.yes())  # type: ignore[attr-defined]
    monkeypatch.setenv(IPC_ENV, kind)
    lmcache_registry.install("cuda", _plugin, distribution="lmcache-platform-cuda")
    assert set(wire_classes_for("cuda")) == {"cuda.torch/1", "cuda.raw/1", "cuda.vmm/1"}
    flat = cache(fake_vmm, [GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    data, fds = wire.encode_with_fds([w])
    (got,) = wire.decode(data, fds=[os.dup(fd) for fd in fds])
    assert type(got) is CudaVmmIPCWrapper
    assert {**got.fields(), "segment_fds": []} == {**w.fields(), "segment_fds": []}  # the fds are its own
    got.close()
    w.close()


# -- a real second process -----------------------------------------------------------


def test_round_trip_through_a_socket_to_another_process(fake_vmm: FakeVmmLib) -> None:
    """The fds cross a real UNIX socket (SCM_RIGHTS) to a spawned process with a fake driver
    of its own; it imports, reads, writes and closes, and says what it has left open."""
    flat = cache(fake_vmm, [GRANULE, 2 * GRANULE])
    layers = list(flat.view(16, 3, -1).unbind(1))
    for seed, layer in enumerate(layers):
        fill(layer, 11 * seed + 5)
    expected = [cuda_vmm.digest(t) for t in layers]
    wrapped = [CudaVmmIPCWrapper.wrap(t) for t in layers]
    data, fds = wire.encode_with_fds(wrapped)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=cuda_vmm.fake_server_main, args=(theirs,), daemon=True)
    child.start()
    theirs.close()
    try:
        socket.send_fds(ours, [data], fds)
        report = cuda_vmm.recv_json(ours)
        assert report["digests"] == expected and len(set(expected)) == 3
        assert report["one_storage"] and report["leaked"] == {"fds": 0, "mappings": 0, "reservations": 0}
        assert torch.equal(layers[1], torch.full_like(layers[1], 0xAB))  # its write, seen here
        assert [cuda_vmm.digest(t) for t in (layers[0], layers[2])] == [expected[0], expected[2]]
    finally:
        child.join(60)
        ours.close()
    assert child.exitcode == 0
    for w in wrapped:
        w.close()


def test_a_view_over_more_allocations_than_an_export_may_have(
    fake_vmm: FakeVmmLib, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_vmm_ipc, "MAX_SEGMENTS", 3)
    flat = cache(fake_vmm, [GRANULE] * 4)
    baseline = open_fds()
    with pytest.raises(DescriptorError, match="reaches more allocations than the VMM kind can export"):
        CudaVmmIPCWrapper.wrap(flat)
    w = CudaVmmIPCWrapper.wrap(flat[: 3 * GRANULE])  # its storage is all four; the view needs three
    assert len(w.segment_fds) == 3
    w.close()
    assert open_fds() == baseline


# -- file descriptors and unmapping (issue 42) -------------------------------------------


def test_received_fds_are_closed_once_mapped(fake_vmm: FakeVmmLib) -> None:
    # vLLM 0.34 exports one allocation per layer: kept fds would count against RLIMIT_NOFILE.
    flat = cache(fake_vmm, [GRANULE, GRANULE, GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    baseline = open_fds()
    (got,) = ship([w])
    assert isinstance(got, CudaVmmIPCWrapper)
    received = got.segment_fds
    assert open_fds() == baseline + 3
    tensor = got.to_tensor()
    for fd in received:  # the mapping holds the memory (the fake driver's own fds stand for it)
        with pytest.raises(OSError):
            os.fstat(fd)
    assert torch.equal(tensor, flat)
    assert torch.equal(got.to_tensor(), flat)  # mapped already: no fd is needed again
    got.close()
    del tensor
    gc.collect()
    assert open_fds() == baseline
    w.close()


def test_exported_fds_are_close_on_exec(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE, GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    assert len(w.segment_fds) == 2
    assert not any(os.get_inheritable(fd) for fd in w.segment_fds)  # the driver's were inheritable
    w.close()


def test_unmapping_undoes_every_segment_it_can_then_raises(fake_vmm: FakeVmmLib) -> None:
    flat = cache(fake_vmm, [GRANULE, GRANULE, GRANULE])
    w = CudaVmmIPCWrapper.wrap(flat)
    fds = [os.dup(fd) for fd in w.segment_fds]
    offsets, sizes = [0, GRANULE, 2 * GRANULE], [GRANULE] * 3
    driver = _vmm_ipc.get_runtime()
    mappings, reservations = len(fake_vmm.mappings), len(fake_vmm.reservations)
    ptr = driver.vmm_import(fds, offsets, sizes, 0)
    assert len(fake_vmm.mappings) == mappings + 3
    fake_vmm.fail("cuMemUnmap", after=1)  # the middle segment's unmap fails
    with pytest.raises(DescriptorError, match=rf"cuMemUnmap of {GRANULE} bytes at {ptr + GRANULE:#x} failed"):
        driver.vmm_unmap(ptr, offsets, sizes, 0)
    assert len(fake_vmm.mappings) == mappings + 1  # the first and the last went back
    assert ptr + GRANULE in fake_vmm.mappings
    assert len(fake_vmm.reservations) == reservations + 1  # a range still mapped is not freed
    with driver._on(0):  # type: ignore[attr-defined]  # what is left, by hand
        assert fake_vmm.cuMemUnmap(ptr + GRANULE, GRANULE) == 0
        assert fake_vmm.cuMemAddressFree(ptr, 3 * GRANULE) == 0
    for fd in fds:
        os.close(fd)
    w.close()


def test_the_drivers_lock_can_be_taken_again_on_the_thread_holding_it(fake_vmm: FakeVmmLib) -> None:
    # A finalizer (a mapping's unmap) may run on a thread inside a driver call's lock.
    driver = _vmm_ipc.get_runtime()
    done: list[int] = []

    def reenter() -> None:
        with driver._lock:  # type: ignore[attr-defined]
            done.append(driver.vmm_granularity(0))

    thread = threading.Thread(target=reenter, daemon=True)
    thread.start()
    thread.join(20)
    assert done == [GRANULE], "the driver's lock deadlocked on re-entry"

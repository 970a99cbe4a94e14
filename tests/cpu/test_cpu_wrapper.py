"""Both export kinds in one process: migration, aliasing, lifetimes, refusals.

``CpuMemfdIPCWrapper`` (sealed memfds) and ``CpuShmIPCWrapper`` (named segments) share
the host-memory kit, so what they have in common is tested once, over both kinds (the
``kind`` fixture). What only one kind has: ``test_cpu_memfd.py`` (sealing, the checks
through /proc, the cgroup limit) and the end of this file (named segments: their
refusals, the room in /dev/shm, truncation).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import lmcache_platform
from lmcache_platform import DescriptorError, DeviceIPCWrapper, WrapError
from lmcache_platform.hostmem import Headroom, HostMemoryIPCWrapper
from lmcache_platform_cpu import (
    CpuMemfdIPCWrapper,
    CpuShmIPCWrapper,
    MemfdCapacityError,
    ShmCapacityError,
    _memfd,
    _shm,
)
from support.shm import segments_of


@dataclass(frozen=True)
class Kind:
    """One export kind, as these tests see it: its wrapper, its exports, its limit."""

    name: str
    cls: type[HostMemoryIPCWrapper]
    #: the memory's name in a handle (it is in /proc/self/maps too)
    name_field: str
    #: what a consumer's refusal says once the producer released the memory
    gone: str
    #: this process's live exports (memfd fds, segment names)
    owned: Callable[[], frozenset[Any]]
    #: make the store's capacity check see ``free`` bytes of room
    limit: Callable[[pytest.MonkeyPatch, int], None]

    def memory(self, w: HostMemoryIPCWrapper) -> str:
        return str(w.handle[self.name_field])

    def exported(self, w: HostMemoryIPCWrapper) -> bool:
        """Whether ``w``'s memory is still exported: the memfd's fd open, the segment's name linked."""
        if self.name == "shm":
            return w.handle["shm_name"] in _shm.owned() and exists(w.handle["shm_name"])
        try:
            link = os.readlink(f"/proc/self/fd/{w.handle['memfd_fd']}")  # type: ignore[str-bytes-safe]
        except FileNotFoundError:
            return False
        return link == f"/memfd:{w.handle['memfd_name']} (deleted)" and w.handle["memfd_fd"] in _memfd.owned()  # type: ignore[str-bytes-safe]

    def maps(self, w: HostMemoryIPCWrapper) -> int:
        """Mappings of ``w``'s memory in this process."""
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if self.memory(w) in line)


def _memfd_limit(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(_memfd, "memory_headroom", lambda: Headroom(free, "a test limit"))


def _shm_limit(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(_shm, "free_bytes", lambda: free)


KINDS = {
    "memfd": Kind(
        "memfd",
        CpuMemfdIPCWrapper,
        "memfd_name",
        r"fails the (fd|memfd|name) check",
        _memfd.owned,
        _memfd_limit,
    ),
    "shm": Kind("shm", CpuShmIPCWrapper, "shm_name", "does not exist", _shm.owned, _shm_limit),
}


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Kind]:
    """Each export kind in turn, also selected for the facade (``LMCACHE_PLATFORM_CPU_IPC``)."""
    monkeypatch.setenv("LMCACHE_PLATFORM_CPU_IPC", request.param)
    lmcache_platform.refresh()
    yield KINDS[request.param]
    monkeypatch.delenv("LMCACHE_PLATFORM_CPU_IPC")
    lmcache_platform.refresh()


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(_shm.SHM_DIR, name))


def footprint() -> tuple[int, int, list[str]]:
    """(open fds, mappings of our memory, our segments) of this process, pending garbage freed first."""
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "lmcache_platform_" in line)
    return len(os.listdir("/proc/self/fd")), maps, segments_of({os.getpid()})


def reopen(kind: Kind, wrapper: DeviceIPCWrapper) -> HostMemoryIPCWrapper:
    """A consumer-side copy, rebuilt from primitives as a decoder would."""
    return kind.cls.from_fields(wrapper.fields())


def pattern(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


# -- both kinds ----------------------------------------------------------------------------------


def test_wrap_moves_the_same_tensor_object_into_shared_memory_and_keeps_its_contents(kind: Kind) -> None:
    t = pattern(4, 8, dtype=torch.bfloat16)
    expected, old_address = t.clone(), t.data_ptr()
    w = kind.cls.wrap(t)
    assert t.data_ptr() != old_address and torch.equal(t, expected)
    assert kind.exported(w) and kind.maps(w) == 1
    assert w.memory_nbytes == t.untyped_storage().nbytes() == 64
    assert (w.dtype, w.shape, w.stride, w.storage_offset, w.device_uuid) == (
        torch.bfloat16,
        (4, 8),
        (8, 1),
        0,
        "cpu",
    )
    assert type(w).device_type == "cpu" and type(w).wire_tag == f"cpu.{kind.name}/1"
    w.close()
    assert not kind.exported(w)


def test_reopened_view_is_zero_copy_both_ways(kind: Kind) -> None:
    t = pattern(16, 4)
    w = kind.cls.wrap(t)
    view = reopen(kind, w).to_tensor()
    assert torch.equal(view, t) and view.data_ptr() != t.data_ptr()
    t[3, 1] = -1.0
    assert view[3, 1].item() == -1.0
    view[0].fill_(42.0)
    assert torch.equal(t[0], torch.full((4,), 42.0))
    del view
    w.close()


def test_an_empty_tensor_needs_no_memory(kind: Kind) -> None:
    before = footprint()
    t = torch.empty(0, 3, dtype=torch.float16)
    w = kind.cls.wrap(t)
    assert footprint() == before and w.memory_nbytes == 0
    assert set(w.handle) == set(kind.cls.store.handle_fields) and not any(w.handle.values())
    back = reopen(kind, w).to_tensor()
    assert (back.shape, back.stride(), back.dtype) == (t.shape, t.stride(), t.dtype)
    assert footprint() == before


def test_wrap_is_idempotent_per_tensor_and_per_storage(kind: Kind) -> None:
    t = pattern(8, 8)
    w1 = kind.cls.wrap(t)
    address, exports = t.data_ptr(), kind.owned()
    w2 = kind.cls.wrap(t)
    assert w1 == w2 and hash(w1) == hash(w2)
    assert t.data_ptr() == address  # no second migration
    view = t[2:5, 1::2]  # a view of a migrated tensor is already in shared memory
    w3 = kind.cls.wrap(view)
    assert w3.handle == w1.handle and w3.storage_offset == 17
    assert kind.owned() == exports
    for w in (w1, w2, w3):
        w.close()


def test_per_layer_views_of_one_buffer_get_one_export(kind: Kind) -> None:
    """vLLM's allocation: every layer a view of one flat buffer; one export for all of them."""
    flat = torch.arange(8 * 1024, dtype=torch.int32)
    layers = [flat[i * 1024 : (i + 1) * 1024].view(4, 256) for i in range(8)]
    expected = [t.clone() for t in layers]
    exports = kind.owned()
    wrappers = lmcache_platform.wrap_kv_caches(layers)
    assert len(kind.owned() - exports) == 1
    assert len({w.fields()[kind.name_field] for w in wrappers}) == 1
    assert all(torch.equal(t, e) for t, e in zip(layers, expected, strict=True))
    again = kind.cls.wrap(layers[3])  # idempotent: no second export
    assert again == wrappers[3] and len(kind.owned() - exports) == 1
    layers[2][0, 0] = -7
    assert reopen(kind, wrappers[2]).to_tensor()[0, 0].item() == -7
    for w in [*wrappers, again]:
        w.close()


def test_views_of_one_allocation_keep_aliasing_after_each_is_wrapped(kind: Kind) -> None:
    # vLLM hands hybrid models one raw allocation viewed by several layers.
    raw = torch.zeros(4096, dtype=torch.int8)
    k = raw.view(torch.float16)[:1024].view(4, 16, 16)
    v = raw.view(torch.float16)[512:1536].view(4, 16, 16)  # overlaps k's second half
    wk = kind.cls.wrap(k)
    wv = kind.cls.wrap(v)
    assert wk.handle == wv.handle and wk.memory_nbytes == 4096
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    k[2:].fill_(3.0)  # the overlap: visible through v, and through the consumer
    assert torch.equal(v[:2], torch.full((2, 16, 16), 3.0, dtype=torch.float16))
    assert torch.equal(reopen(kind, wv).to_tensor()[:2], v[:2])
    wk.close()
    wv.close()


def test_wrapping_a_reopened_view_names_its_memory_and_keeps_aliasing(kind: Kind) -> None:
    """A server that re-exports what it reopened must not copy it away from the engine."""
    t = pattern(64)
    w = kind.cls.wrap(t)
    consumer = reopen(kind, w)
    view = consumer.to_tensor()[8:]
    exports = kind.owned()
    again = kind.cls.wrap(view)
    assert again.handle == w.handle and again.storage_offset == 8 and kind.owned() == exports
    view[0] = -5.0
    assert t[8].item() == -5.0  # still the engine's memory
    again.close()  # not this wrapper's memory to release
    assert kind.exported(w)
    consumer.close()
    w.close()


def test_stride_and_offset_replay_exactly(kind: Kind) -> None:
    base = pattern(2, 3, 4, 5)
    odd = base.permute(0, 2, 1, 3)[:, 1:, :, ::2]
    assert not odd.is_contiguous() and odd.storage_offset() == 5
    expected = odd.clone()
    w = kind.cls.wrap(odd)
    assert torch.equal(odd, expected)
    back = reopen(kind, w).to_tensor()
    assert (back.shape, back.stride(), back.storage_offset()) == (
        odd.shape,
        odd.stride(),
        odd.storage_offset(),
    )
    assert torch.equal(back, expected)
    back[1, 2, 0, 1] = 1000.0  # lands on the same element of the producer's view
    assert odd[1, 2, 0, 1].item() == 1000.0
    # ``base`` shared the old storage: wrapping it re-points it at the same memory.
    wb = kind.cls.wrap(base)
    assert wb.handle == w.handle and base[1, 0, 3, 2].item() == 1000.0
    del back
    w.close()
    wb.close()


def test_dtypes_and_inference_and_grad_tensors_migrate(kind: Kind) -> None:
    with torch.inference_mode():
        inference = torch.ones(8, dtype=torch.float16)
    leaf = torch.ones(8, requires_grad=True)
    wrappers = []
    for t in (inference, leaf, torch.ones(8, dtype=torch.float8_e4m3fn), torch.ones(8, dtype=torch.bool)):
        expected = t.detach().clone()
        wrappers.append(kind.cls.wrap(t))
        assert torch.equal(t.detach().view(torch.uint8), expected.view(torch.uint8))
        reopened = reopen(kind, wrappers[-1]).to_tensor()
        assert torch.equal(reopened.view(torch.uint8), expected.view(torch.uint8))
    for w in wrappers:
        w.close()


def test_the_tensor_dying_releases_its_memory(kind: Kind) -> None:
    t = pattern(32)
    w = kind.cls.wrap(t)
    view = reopen(kind, w).to_tensor()
    del t
    assert not kind.exported(w) and kind.maps(w) == 1  # the consumer keeps its mapping
    with pytest.raises(DescriptorError, match=kind.gone):
        reopen(kind, w).to_tensor()
    assert view[5].item() == 5.0  # an existing mapping outlives the export
    del view
    assert kind.maps(w) == 0  # the memory is gone with its last holder
    w.close()  # after the tensor died: harmless


def test_a_view_keeps_the_memory_of_its_dead_base(kind: Kind) -> None:
    t = pattern(32)
    w = kind.cls.wrap(t)
    tail = t[16:]
    del t
    assert kind.exported(w)  # the storage is alive through ``tail``
    assert torch.equal(reopen(kind, w).to_tensor()[16:], tail)
    del tail
    assert not kind.exported(w)
    w.close()


def test_consumer_mapping_is_released_when_the_last_view_dies(kind: Kind) -> None:
    t = pattern(1024)
    w = kind.cls.wrap(t)
    producer_maps = kind.maps(w)
    consumer = reopen(kind, w)
    a = consumer.to_tensor()
    b = consumer.to_tensor()[10:20]  # one mapping per wrapper, however many views
    assert kind.maps(w) == producer_maps + 1
    consumer.close()  # drops the wrapper's own reference; views still work
    assert b[0].item() == 10.0
    del a
    assert kind.maps(w) == producer_maps + 1  # b still needs it
    del b
    assert kind.maps(w) == producer_maps
    with pytest.raises(DescriptorError, match="closed"):
        consumer.to_tensor()
    w.close()


def test_closing_the_last_export_releases_it_but_keeps_the_tensor(kind: Kind) -> None:
    t = pattern(64)
    w1, w2 = kind.cls.wrap(t), kind.cls.wrap(t)
    view = reopen(kind, w1).to_tensor()
    w1.close()
    w1.close()  # idempotent: one reference dropped once
    assert kind.exported(w2)
    w2.close()
    assert not kind.exported(w2)
    t += 1  # the engine's tensor, and the consumer's mapping, keep the memory
    assert t[63].item() == 64.0 and view[63].item() == 64.0
    with pytest.raises(DescriptorError, match=kind.gone):
        reopen(kind, w1).to_tensor()  # a new consumer cannot find it any more
    w3 = kind.cls.wrap(t)  # exporting again needs, and gets, new memory
    assert kind.memory(w3) != kind.memory(w1) and torch.equal(reopen(kind, w3).to_tensor(), t)
    w3.close()


def test_a_new_tensor_at_a_reused_address_gets_its_own_memory(kind: Kind) -> None:
    # After migration the old storage is freed and the allocator soon hands its address
    # to a new tensor. Bookkeeping keyed by that address (or by a reused ``id``) must
    # not mistake the newcomer for the migrated tensor.
    for _ in range(200):
        t = torch.full((1024,), 7, dtype=torch.int32)
        old_address, old_id = t.data_ptr(), id(t)
        w = kind.cls.wrap(t)
        u = torch.full((1024,), 9, dtype=torch.int32)
        if u.data_ptr() == old_address or id(u) == old_id:
            break
        w.close()
    else:
        pytest.skip("the allocator never reused an address; nothing to check")
    wu = kind.cls.wrap(u)
    assert kind.memory(wu) != kind.memory(w)
    assert torch.equal(u, torch.full((1024,), 9, dtype=torch.int32))
    assert torch.equal(t, torch.full((1024,), 7, dtype=torch.int32))
    assert torch.equal(reopen(kind, wu).to_tensor(), u)
    w.close()
    wu.close()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: torch.empty(4, device="meta"), "needs a CPU tensor, got one on meta"),
        (lambda: torch.zeros(4, dtype=torch.complex64), "not supported for IPC"),
        (lambda: torch.zeros(4, 4).to_sparse(), "needs a strided tensor"),
        (lambda: [1.0, 2.0], "expects a torch.Tensor, got list"),
    ],
)
def test_unsupported_tensors_are_refused_before_anything_is_created(
    kind: Kind, make: Callable[[], Any], match: str
) -> None:
    before = footprint()
    with pytest.raises(DescriptorError, match=match):
        kind.cls.wrap(make())
    assert footprint() == before


def test_preflight_checks_a_whole_batch_before_creating_anything(
    kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = [pattern(256) for _ in range(4)]  # 1 KiB each
    shared = torch.zeros(512, dtype=torch.int8)
    layers += [shared[:256], shared[256:]]  # one storage, counted once: 512 bytes
    done = kind.cls.wrap(layers[0])  # already exported: counts nothing
    kind.limit(monkeypatch, 3 * 1024 + 512 - 1)
    before = footprint()
    with pytest.raises((MemfdCapacityError, ShmCapacityError)) as info:
        kind.cls.preflight(layers)
    assert info.value.needed == 3 * 1024 + 512  # type: ignore[attr-defined]
    assert footprint() == before
    kind.limit(monkeypatch, 3 * 1024 + 512)
    kind.cls.preflight(layers)
    done.close()


def test_failed_batch_through_the_facade_leaves_no_export_behind(kind: Kind) -> None:
    good = [pattern(8, 8) for _ in range(3)]
    expected = [t.clone() for t in good]
    exports, before = kind.owned(), footprint()
    with pytest.raises(WrapError) as info:
        lmcache_platform.wrap_kv_caches([*good, torch.zeros(4, dtype=torch.complex64)])
    assert info.value.layer == 3 and isinstance(info.value.__cause__, DescriptorError)
    # The engine keeps its tensors, contents intact, but nothing stays exported.
    assert kind.owned() == exports and footprint()[2] == before[2]
    assert all(torch.equal(t, e) for t, e in zip(good, expected, strict=True))
    wrappers = lmcache_platform.wrap_kv_caches(good)  # a retry works
    assert all(type(w) is kind.cls for w in wrappers)
    assert all(torch.equal(reopen(kind, w).to_tensor(), e) for w, e in zip(wrappers, expected, strict=True))
    for w in wrappers:
        w.close()


def test_a_forked_child_never_releases_its_parents_memory(kind: Kind) -> None:
    t = pattern(128)
    w = kind.cls.wrap(t)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: every release path a child could take
        status = 1
        try:
            os.close(r)
            inherited = kind.owned()
            w.close()  # the child's copy of the parent's export
            # The child exports into memory of its own; re-pointing ``t`` drops the
            # child's last use of the parent's memory, so its finalizer runs here.
            own = kind.cls.wrap(t)
            os.write(wfd, f"{len(inherited)} {kind.memory(own)}".encode())
            own.close()
            _shm._unlink_all_owned()  # what the child's atexit would run
            status = 0
        finally:
            os._exit(status)
    os.close(wfd)
    child = os.read(r, 200).decode().split()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child[0] == "0" and child[1] != kind.memory(w)  # it owned nothing of its parent's
    if kind.name == "shm":
        assert not exists(child[1])  # the child's atexit unlinked its own segment
    assert kind.exported(w)
    assert torch.equal(reopen(kind, w).to_tensor(), pattern(128))
    w.close()


# -- named segments only -------------------------------------------------------------------------


def good_fields() -> dict[str, object]:
    return {
        "dtype": "float32",
        "shape": [4, 4],
        "stride": [4, 1],
        "storage_offset": 0,
        "device_uuid": "cpu",
        "shm_name": _shm.new_name(),
        "shm_nbytes": 64,
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"shm_name": "../../etc/passwd"}, "not a segment of this project"),
        ({"shm_name": "lmcache_platform_1_1_" + "a" * 32 + "/x"}, "not a segment"),
        ({"shm_name": "other_prefix_1_1_" + "a" * 32}, "not a segment"),
        ({"shm_name": "x" * 200}, "exceeds the limit"),
        ({"shm_nbytes": 63}, "spans 64 bytes but the memory holds only 63"),
        ({"storage_offset": 1}, "spans 68 bytes"),
        ({"shm_name": "", "shm_nbytes": 64}, "shm_nbytes is 64 but no memory is named"),
        ({"shm_name": ""}, "no memory is named"),
        ({"shm_nbytes": 0, "shape": [0, 4]}, "memory is named but shm_nbytes is 0"),
        ({"device_uuid": "GPU-1234"}, "device_uuid must be 'cpu'"),
        ({"shm_nbytes": -1}, "below the minimum"),
    ],
)
def test_malformed_segment_descriptors_are_refused_before_mapping(
    change: dict[str, object], match: str
) -> None:
    fields = {**good_fields(), **change}
    with pytest.raises(DescriptorError, match=match):
        CpuShmIPCWrapper.from_fields(fields)


def test_a_descriptor_whose_size_disagrees_with_the_segment_is_refused() -> None:
    t = pattern(16)
    w = CpuShmIPCWrapper.wrap(t)
    bigger = {**w.fields(), "shm_nbytes": 4096}
    with pytest.raises(DescriptorError, match="holds 64 bytes but the descriptor says 4096"):
        CpuShmIPCWrapper.from_fields(bigger).to_tensor()
    smaller = {**w.fields(), "shape": [4], "shm_nbytes": 16}  # fits the view, not the segment
    with pytest.raises(DescriptorError, match="holds 64 bytes but the descriptor says 16"):
        CpuShmIPCWrapper.from_fields(smaller).to_tensor()
    # A segment shrunk behind our back is refused too, instead of a SIGBUS on access.
    os.truncate(os.path.join(_shm.SHM_DIR, w.shm_name), 32)
    with pytest.raises(DescriptorError, match="holds 32 bytes but the descriptor says 64"):
        CpuShmIPCWrapper.from_fields(w.fields()).to_tensor()
    w.close()
    del t


def test_a_full_dev_shm_wraps_nothing_and_says_by_how_much(monkeypatch: pytest.MonkeyPatch) -> None:
    _shm_limit(monkeypatch, 1000)
    t = pattern(1024)
    address, before = t.data_ptr(), footprint()
    with pytest.raises(ShmCapacityError, match=r"1000 B free .* 4\.0 KiB .*short by 3\.0 KiB"):
        CpuShmIPCWrapper.wrap(t)
    assert t.data_ptr() == address and footprint() == before


def test_a_segment_shrunk_after_mapping_is_refused_before_a_transfer_touches_it() -> None:
    """The residual risk of named segments, narrowed: checked before each transfer (one fstat)."""
    layer = torch.arange(2 * 8 * 4 * 2 * 8, dtype=torch.float32).view(2, 8, 4, 2, 8)  # FLASH_ATTN
    w = CpuShmIPCWrapper.wrap(layer)
    consumer = CpuShmIPCWrapper.from_fields(w.fields())
    hints = lmcache_platform.LayoutHints(
        kv_format=lmcache_platform.KVFormat.FLASH_ATTN, block_size=4, num_kv_heads=2
    )
    ctx = lmcache_platform.create_cache_context([consumer], 8, layout_hints=hints)
    ctx.store_chunk([[0, 1]])
    consumer.verify()  # whole: nothing to say
    os.truncate(os.path.join(_shm.SHM_DIR, w.shm_name), 1024)  # any process of this user may
    with pytest.raises(DescriptorError, match=r"shrank to 1024 of its 4096 bytes after it was mapped"):
        consumer.verify()
    for transfer in (ctx.store_chunk, ctx.retrieve_chunk):
        with pytest.raises(DescriptorError, match="refusing to touch it"):
            transfer([[0, 1]])
    ctx.close()
    consumer.verify()  # closed: nothing mapped by it any more, nothing to check
    w.close()
    del layer

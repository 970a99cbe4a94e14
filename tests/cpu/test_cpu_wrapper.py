"""``CpuShmIPCWrapper`` (named segments) in one process: migration, aliasing, lifetimes, refusals.

The memfd kind has the same tests in ``test_cpu_memfd.py``, plus its own refusals.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import lmcache_platform
from lmcache_platform import DescriptorError, DeviceIPCWrapper, WrapError
from lmcache_platform_cpu import CpuShmIPCWrapper, ShmCapacityError, _shm
from support.shm import segments_of


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(_shm.SHM_DIR, name))


def mappings_of(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("/" + name))


def reopen(wrapper: DeviceIPCWrapper) -> CpuShmIPCWrapper:
    """A consumer-side copy, rebuilt from primitives as a decoder would."""
    return CpuShmIPCWrapper.from_fields(wrapper.fields())


def pattern(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


def test_wrap_moves_the_same_tensor_object_into_shm_and_keeps_its_contents() -> None:
    t = pattern(4, 8, dtype=torch.bfloat16)
    expected, old_address = t.clone(), t.data_ptr()
    w = CpuShmIPCWrapper.wrap(t)
    assert t.data_ptr() != old_address
    assert torch.equal(t, expected)
    assert w.shm_name in _shm.owned() and exists(w.shm_name)
    assert w.shm_nbytes == t.untyped_storage().nbytes() == 64
    assert (w.dtype, w.shape, w.stride, w.storage_offset, w.device_uuid) == (
        torch.bfloat16,
        (4, 8),
        (8, 1),
        0,
        "cpu",
    )
    assert type(w).device_type == "cpu" and type(w).wire_tag == "cpu.shm/1"
    w.close()


def test_reopened_view_is_zero_copy_both_ways() -> None:
    t = pattern(16, 4)
    w = CpuShmIPCWrapper.wrap(t)
    view = reopen(w).to_tensor()
    assert torch.equal(view, t) and view.data_ptr() != t.data_ptr()
    t[3, 1] = -1.0
    assert view[3, 1].item() == -1.0
    view[0].fill_(42.0)
    assert torch.equal(t[0], torch.full((4,), 42.0))
    del view
    w.close()


def test_empty_tensor_needs_no_segment() -> None:
    before = set(segments_of({os.getpid()}))
    t = torch.empty(0, 3, dtype=torch.float16)
    w = CpuShmIPCWrapper.wrap(t)
    assert (w.shm_name, w.shm_nbytes) == ("", 0)
    assert set(segments_of({os.getpid()})) == before
    back = reopen(w).to_tensor()
    assert (back.shape, back.stride(), back.dtype) == (t.shape, t.stride(), t.dtype)


def test_wrap_is_idempotent_per_tensor_and_per_storage() -> None:
    t = pattern(8, 8)
    w1 = CpuShmIPCWrapper.wrap(t)
    address = t.data_ptr()
    w2 = CpuShmIPCWrapper.wrap(t)
    assert w1 == w2 and hash(w1) == hash(w2)
    assert t.data_ptr() == address  # no second migration
    view = t[2:5, 1::2]  # a view of a migrated tensor is already in shared memory
    w3 = CpuShmIPCWrapper.wrap(view)
    assert w3.shm_name == w1.shm_name and w3.storage_offset == 17
    assert len([n for n in _shm.owned() if n == w1.shm_name]) == 1
    for w in (w1, w2, w3):
        w.close()


def test_views_of_one_allocation_keep_aliasing_after_each_is_wrapped() -> None:
    # vLLM hands hybrid models one raw allocation viewed by several layers.
    raw = torch.zeros(4096, dtype=torch.int8)
    k = raw.view(torch.float16)[:1024].view(4, 16, 16)
    v = raw.view(torch.float16)[512:1536].view(4, 16, 16)  # overlaps k's second half
    wk = CpuShmIPCWrapper.wrap(k)
    wv = CpuShmIPCWrapper.wrap(v)
    assert wk.shm_name == wv.shm_name and wk.shm_nbytes == 4096
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    k[2:].fill_(3.0)  # the overlap: visible through v, and through the consumer
    assert torch.equal(v[:2], torch.full((2, 16, 16), 3.0, dtype=torch.float16))
    assert torch.equal(reopen(wv).to_tensor()[:2], v[:2])
    wk.close()
    wv.close()


def test_wrapping_a_reopened_view_names_its_segment_and_keeps_aliasing() -> None:
    # A server that re-exports what it reopened must not copy it away from the engine.
    t = pattern(64)
    w = CpuShmIPCWrapper.wrap(t)
    consumer = reopen(w)
    view = consumer.to_tensor()[8:]
    again = CpuShmIPCWrapper.wrap(view)
    assert again.shm_name == w.shm_name and again.storage_offset == 8
    view[0] = -5.0
    assert t[8].item() == -5.0  # still the engine's memory
    again.close()  # not this process's segment to unlink
    assert exists(w.shm_name)
    consumer.close()
    w.close()


def test_stride_and_offset_replay_exactly() -> None:
    base = pattern(2, 3, 4, 5)
    odd = base.permute(0, 2, 1, 3)[:, 1:, :, ::2]
    assert not odd.is_contiguous() and odd.storage_offset() == 5
    expected = odd.clone()
    w = CpuShmIPCWrapper.wrap(odd)
    assert torch.equal(odd, expected)
    back = reopen(w).to_tensor()
    assert (back.shape, back.stride(), back.storage_offset()) == (
        odd.shape,
        odd.stride(),
        odd.storage_offset(),
    )
    assert torch.equal(back, expected)
    back[1, 2, 0, 1] = 1000.0  # lands on the same element of the producer's view
    assert odd[1, 2, 0, 1].item() == 1000.0
    # ``base`` shared the old storage: wrapping it re-points it at the same segment.
    wb = CpuShmIPCWrapper.wrap(base)
    assert wb.shm_name == w.shm_name and base[1, 0, 3, 2].item() == 1000.0
    del back
    w.close()
    wb.close()


def test_dtypes_and_inference_and_grad_tensors_migrate() -> None:
    with torch.inference_mode():
        inference = torch.ones(8, dtype=torch.float16)
    leaf = torch.ones(8, requires_grad=True)
    wrappers = []
    for t in (inference, leaf, torch.ones(8, dtype=torch.float8_e4m3fn), torch.ones(8, dtype=torch.bool)):
        expected = t.detach().clone()
        wrappers.append(CpuShmIPCWrapper.wrap(t))
        assert torch.equal(t.detach().view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(reopen(wrappers[-1]).to_tensor().view(torch.uint8), expected.view(torch.uint8))
    for w in wrappers:
        w.close()


def test_gc_of_the_tensor_unlinks_its_segment() -> None:
    t = pattern(32)
    w = CpuShmIPCWrapper.wrap(t)
    consumer = reopen(w)
    view = consumer.to_tensor()
    name = w.shm_name
    del t
    assert not exists(name) and name not in _shm.owned()
    with pytest.raises(DescriptorError, match="does not exist"):
        reopen(w).to_tensor()
    assert view[5].item() == 5.0  # an existing mapping outlives the name (POSIX)
    w.close()  # after the tensor died: harmless


def test_a_view_keeps_the_segment_of_its_dead_base() -> None:
    t = pattern(32)
    w = CpuShmIPCWrapper.wrap(t)
    tail = t[16:]
    del t
    assert exists(w.shm_name)  # the storage is alive through ``tail``
    assert torch.equal(reopen(w).to_tensor()[16:], tail)
    name = w.shm_name
    del tail
    assert not exists(name)
    w.close()


def test_consumer_mapping_is_released_when_the_last_view_dies() -> None:
    t = pattern(1024)
    w = CpuShmIPCWrapper.wrap(t)
    producer_maps = mappings_of(w.shm_name)
    consumer = reopen(w)
    a = consumer.to_tensor()
    b = consumer.to_tensor()[10:20]  # one mapping per wrapper, however many views
    assert mappings_of(w.shm_name) == producer_maps + 1
    consumer.close()  # drops the wrapper's own reference; views still work
    assert b[0].item() == 10.0
    del a
    assert mappings_of(w.shm_name) == producer_maps + 1  # b still needs it
    del b
    assert mappings_of(w.shm_name) == producer_maps
    with pytest.raises(DescriptorError, match="closed"):
        consumer.to_tensor()
    w.close()


def test_closing_the_last_producer_wrapper_unlinks_but_keeps_the_tensor() -> None:
    t = pattern(64)
    w1, w2 = CpuShmIPCWrapper.wrap(t), CpuShmIPCWrapper.wrap(t)
    name = w1.shm_name
    w1.close()
    w1.close()  # idempotent: one reference dropped once
    assert exists(name)
    w2.close()
    assert not exists(name) and name not in _shm.owned()
    t += 1  # the engine's tensor is unaffected
    assert t[63].item() == 64.0
    w3 = CpuShmIPCWrapper.wrap(t)  # exporting again needs, and gets, a new segment
    assert w3.shm_name != name and torch.equal(reopen(w3).to_tensor(), t)
    w3.close()


def test_a_new_tensor_at_a_reused_address_gets_its_own_segment() -> None:
    # After migration the old storage is freed and the allocator soon hands its address
    # to a new tensor. Bookkeeping keyed by that address (or by a reused ``id``) must
    # not mistake the newcomer for the migrated tensor.
    for _ in range(200):
        t = torch.full((1024,), 7, dtype=torch.int32)
        old_address, old_id = t.data_ptr(), id(t)
        w = CpuShmIPCWrapper.wrap(t)
        u = torch.full((1024,), 9, dtype=torch.int32)
        if u.data_ptr() == old_address or id(u) == old_id:
            break
        w.close()
    else:
        pytest.skip("the allocator never reused an address; nothing to check")
    wu = CpuShmIPCWrapper.wrap(u)
    assert wu.shm_name != w.shm_name
    assert torch.equal(u, torch.full((1024,), 9, dtype=torch.int32))
    assert torch.equal(t, torch.full((1024,), 7, dtype=torch.int32))
    assert torch.equal(reopen(wu).to_tensor(), u)
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
    make: Callable[[], Any], match: str
) -> None:
    before = set(segments_of({os.getpid()}))
    with pytest.raises(DescriptorError, match=match):
        CpuShmIPCWrapper.wrap(make())
    assert set(segments_of({os.getpid()})) == before


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
def test_malformed_descriptors_are_refused_before_mapping(change: dict[str, object], match: str) -> None:
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
        reopen(w).to_tensor()
    w.close()
    del t


def test_capacity_shortfall_wraps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_shm, "free_bytes", lambda: 1000)
    t = pattern(1024)
    address, before = t.data_ptr(), set(segments_of({os.getpid()}))
    with pytest.raises(ShmCapacityError, match=r"1000 B free .* 4\.0 KiB .*short by 3\.0 KiB"):
        CpuShmIPCWrapper.wrap(t)
    assert t.data_ptr() == address and set(segments_of({os.getpid()})) == before


def test_preflight_checks_a_whole_batch_before_creating_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = [pattern(256) for _ in range(4)]  # 1 KiB each
    shared = torch.zeros(512, dtype=torch.int8)
    layers += [shared[:256], shared[256:]]  # one storage, counted once: 512 bytes
    done = CpuShmIPCWrapper.wrap(layers[0])  # already in a segment: counts nothing
    monkeypatch.setattr(_shm, "free_bytes", lambda: 3 * 1024 + 512 - 1)
    before = set(segments_of({os.getpid()}))
    with pytest.raises(ShmCapacityError) as info:
        CpuShmIPCWrapper.preflight(layers)
    assert info.value.needed == 3 * 1024 + 512
    assert set(segments_of({os.getpid()})) == before
    monkeypatch.setattr(_shm, "free_bytes", lambda: 3 * 1024 + 512)
    CpuShmIPCWrapper.preflight(layers)
    done.close()


def test_failed_batch_through_the_facade_leaves_no_segment_behind(ipc_kind: str) -> None:
    good = [pattern(8, 8) for _ in range(3)]
    expected = [t.clone() for t in good]
    before = set(segments_of({os.getpid()}))
    bad = torch.zeros(4, dtype=torch.complex64)
    with pytest.raises(WrapError) as info:
        lmcache_platform.wrap_kv_caches([*good, bad])
    assert info.value.layer == 3 and isinstance(info.value.__cause__, DescriptorError)
    # The engine keeps its tensors, contents intact, but no name stays exported.
    assert set(segments_of({os.getpid()})) == before
    assert all(torch.equal(t, e) for t, e in zip(good, expected, strict=True))
    wrappers = lmcache_platform.wrap_kv_caches(good)  # a retry works
    assert all(torch.equal(reopen(w).to_tensor(), e) for w, e in zip(wrappers, expected, strict=True))
    for w in wrappers:
        w.close()


def test_a_forked_child_never_unlinks_its_parents_segments() -> None:
    t = pattern(128)
    w = CpuShmIPCWrapper.wrap(t)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: every cleanup path a child could take
        status = 1
        try:
            os.close(r)
            w.close()  # the child's copy of the parent's export
            # The child exports into a segment of its own; re-pointing ``t`` drops the
            # child's last use of the parent's segment, so its finalizer runs here.
            own = CpuShmIPCWrapper.wrap(t)
            os.write(wfd, own.shm_name.encode())
            own.close()
            _shm._unlink_all_owned()  # what the child's atexit would run
            status = 0
        finally:
            os._exit(status)
    os.close(wfd)
    child_name = os.read(r, 200).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_name and child_name != w.shm_name and not exists(child_name)
    assert exists(w.shm_name) and w.shm_name in _shm.owned()
    assert torch.equal(reopen(w).to_tensor(), pattern(128))
    w.close()


def test_a_segment_shrunk_after_mapping_is_refused_before_a_transfer_touches_it() -> None:
    """The residual risk of named segments, narrowed: checked before each transfer (one fstat)."""
    layer = torch.arange(2 * 8 * 4 * 2 * 8, dtype=torch.float32).view(2, 8, 4, 2, 8)  # FLASH_ATTN
    w = CpuShmIPCWrapper.wrap(layer)
    consumer = reopen(w)
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

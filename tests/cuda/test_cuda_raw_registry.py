"""Raw CUDA IPC: the process-wide, refcounted mapping table and view replay.

No GPU here: the CUDA driver is replaced by ``FakeRuntime`` (support.cuda_fakes), whose
"device memory" is host memory, and device enumeration by ``FakeDevices``. What
is tested is ours: one open per allocation per process, refcounted idempotent
``close()``, unmapping only once no wrapper and no tensor uses a mapping, offsets
and strides replayed exactly, bounds checked against the mapped size.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

from lmcache_platform import DescriptorError
from lmcache_platform_cuda import RawCudaIPCWrapper
from lmcache_platform_cuda._raw_ipc import MAPPINGS
from support.cuda_fakes import UUIDS, FakeDevices, FakeRuntime


@pytest.fixture(autouse=True)
def _one_device(fake_devices: FakeDevices) -> None:
    fake_devices.set(UUIDS[:1])


def descriptor(handle: bytes, **over: Any) -> RawCudaIPCWrapper:
    fields: dict[str, Any] = {
        "dtype": "float32",
        "shape": [4, 8],
        "stride": [8, 1],
        "storage_offset": 0,
        "device_uuid": UUIDS[0],
        "ipc_handle": handle,
        "alloc_offset": 0,
        "storage_nbytes": 4 * 8 * 4,
    }
    fields.update(over)
    return RawCudaIPCWrapper.from_fields(fields)


def test_wrappers_of_one_allocation_share_one_open(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(4096)
    a, b = descriptor(handle), descriptor(handle, alloc_offset=1024)
    ta, tb = a.to_tensor(), b.to_tensor()
    assert fake_runtime.opened == [handle]
    assert MAPPINGS.refs(handle) == 2
    assert a.to_tensor().data_ptr() == ta.data_ptr()  # a second to_tensor takes no new ref
    assert MAPPINGS.refs(handle) == 2
    assert tb.data_ptr() - ta.data_ptr() == 1024
    a.close()
    a.close()  # idempotent: the second close must not drop b's reference
    assert MAPPINGS.refs(handle) == 1
    del ta
    gc.collect()
    assert fake_runtime.closed == []  # b still holds the mapping
    b.close()
    del tb
    gc.collect()
    assert len(fake_runtime.closed) == 1
    assert not MAPPINGS.alive(handle)


def test_unmap_waits_for_the_last_tensor(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(4096)
    w = descriptor(handle)
    view = w.to_tensor()[1:]  # views keep the mapping alive too
    w.close()
    gc.collect()
    assert fake_runtime.closed == [] and MAPPINGS.alive(handle)
    view.fill_(1.0)  # still mapped: safe to touch
    del view
    gc.collect()
    assert len(fake_runtime.closed) == 1


def test_reimport_after_close_reopens(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(4096)
    for _ in range(2):  # import, map, close, unmap: twice
        w = descriptor(handle)
        w.to_tensor()
        w.close()
        gc.collect()
    assert fake_runtime.opened == [handle, handle]
    assert len(fake_runtime.closed) == 2


def test_reimport_while_a_tensor_lives_reuses_the_mapping(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(4096)
    first = descriptor(handle)
    kept = first.to_tensor()
    first.close()
    second = descriptor(handle)
    assert second.to_tensor().data_ptr() == kept.data_ptr()
    assert fake_runtime.opened == [handle]  # no second cuIpcOpenMemHandle
    second.close()
    del kept
    gc.collect()
    assert len(fake_runtime.closed) == 1


def test_closed_wrapper_refuses_to_tensor(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(4096)
    w = descriptor(handle)
    w.close()
    with pytest.raises(DescriptorError, match="closed"):
        w.to_tensor()
    assert fake_runtime.opened == []


def test_interior_offset_and_strides_replay_exactly(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(8192)
    memory = fake_runtime.view(handle)
    # A transposed [8, 4] view at element offset 3 of a storage starting 1000 bytes in.
    w = descriptor(
        handle, alloc_offset=1000, shape=[8, 4], stride=[1, 8], storage_offset=3, storage_nbytes=160
    )
    t = w.to_tensor()
    assert t.shape == (8, 4) and t.stride() == (1, 8) and t.dtype == torch.float32
    t.fill_(0)
    t[2, 1] = 7.0
    # element (2, 1) is at storage element 3 + 2*1 + 1*8 = 13 -> byte 1000 + 52
    flat = torch.from_numpy(memory[1000:1160].copy()).view(torch.float32)
    assert flat[13].item() == 7.0 and flat.count_nonzero().item() == 1
    assert memory[:1000].sum() == 0 and memory[1160:].sum() == 0  # neighbours untouched
    w.close()


def test_storage_past_the_mapping_is_refused_and_released(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(256)
    w = descriptor(handle, alloc_offset=200)  # 200 + 128 > 256
    with pytest.raises(DescriptorError, match="exceed the 256-byte allocation"):
        w.to_tensor()
    assert MAPPINGS.refs(handle) == 0
    gc.collect()
    assert len(fake_runtime.closed) == 1  # the probe open was undone
    w.close()


def test_unknown_handle_fails_without_holding_anything(fake_runtime: FakeRuntime) -> None:
    w = descriptor(b"\x01" * 64)
    with pytest.raises(DescriptorError, match="cuIpcOpenMemHandle"):
        w.to_tensor()
    assert MAPPINGS.refs(b"\x01" * 64) == 0
    w.close()


def test_racing_imports_open_once(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(4096)
    wrappers = [descriptor(handle) for _ in range(32)]
    start, opened = threading.Barrier(len(wrappers)), threading.Barrier(len(wrappers))
    errors: list[BaseException] = []
    write = threading.Lock()

    def use(w: RawCudaIPCWrapper) -> None:
        try:
            start.wait()
            t = w.to_tensor()
            with write:  # the mapping is shared; the increments must not race
                t.add_(1)
            del t
            opened.wait()  # everyone holds the mapping at once
            w.close()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=use, args=(w,)) for w in wrappers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    gc.collect()
    assert fake_runtime.opened == [handle]
    assert len(fake_runtime.closed) == 1
    assert fake_runtime.view(handle)[:128].view("float32").tolist() == [32.0] * 32


def test_unknown_device_uuid_is_refused_before_mapping(fake_runtime: FakeRuntime) -> None:
    handle, _ = fake_runtime.alloc(4096)
    w = descriptor(handle, device_uuid=UUIDS[2])
    with pytest.raises(DescriptorError, match=UUIDS[2]):
        w.to_tensor()
    assert fake_runtime.opened == []

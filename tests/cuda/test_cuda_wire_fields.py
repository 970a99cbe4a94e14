"""CUDA descriptors as wire fields: primitives only, round trips, strict validation.

Runs without a GPU: descriptors are built from fields (as a decoder builds them)
with handle bytes shaped like the real ones; nothing here opens a handle.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platform import DescriptorError, DeviceIPCWrapper, WireFormatError, wire
from lmcache_platform_cuda import CudaIPCWrapper, RawCudaIPCWrapper, _plugin, _probe, _torch_ipc
from lmcache_platform_cuda._config import IPC_ENV
from support.cuda_fakes import FakeDevices

UUID = "6f1d6c3e-2a5b-4c1e-9d3f-0a1b2c3d4e5f"
ALLOWED = {cls.wire_tag: cls for cls in (CudaIPCWrapper, RawCudaIPCWrapper)}
#: One paged vLLM layer: [2, 64 blocks, 16 tokens, 8 heads, 128] bf16.
LAYER: dict[str, Any] = {
    "dtype": "bfloat16",
    "shape": [2, 64, 16, 8, 128],
    "stride": [64 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1],
    "storage_offset": 0,
    "device_uuid": UUID,
}
LAYER_BYTES = 2 * 64 * 16 * 8 * 128 * 2


def torch_fields(**over: Any) -> dict[str, Any]:
    fields = {
        **LAYER,
        "handle": b"\x01" + bytes(range(64)),  # allocator tag + cudaIpcMemHandle_t
        "storage_nbytes": LAYER_BYTES,
        "storage_offset_bytes": 2 << 20,
        "ref_counter_handle": b"/torch_4242_2983412_7",
        "ref_counter_offset": 17,
        "event_handle": bytes(64),
        "event_sync_required": 1,
    }
    fields.update(over)
    return fields


def raw_fields(**over: Any) -> dict[str, Any]:
    fields = {
        **LAYER,
        "ipc_handle": bytes(range(64, 128)),
        "alloc_offset": 4096,
        "storage_nbytes": LAYER_BYTES,
    }
    fields.update(over)
    return fields


@pytest.mark.parametrize("cls, make", [(CudaIPCWrapper, torch_fields), (RawCudaIPCWrapper, raw_fields)])
def test_fields_round_trip(cls: type[DeviceIPCWrapper], make: Any) -> None:
    w = cls.from_fields(make())
    fields = w.fields()
    assert fields == make()
    assert all(isinstance(v, (int, str, bytes, list)) for v in fields.values())  # never objects
    again = cls.from_fields(fields)
    assert again == w and hash(again) == hash(w)
    assert cls.from_fields(make(storage_offset=8, storage_nbytes=LAYER_BYTES + 16)) != w


def test_wire_round_trip_of_both_kinds() -> None:
    wrappers = [CudaIPCWrapper.from_fields(torch_fields()), RawCudaIPCWrapper.from_fields(raw_fields())]
    data = wire.encode(wrappers)
    assert b"cuda.torch/1" in data and b"cuda.raw/1" in data
    decoded = wire.decode(data, allowed=ALLOWED)
    assert decoded == wrappers
    assert [type(w) for w in decoded] == [CudaIPCWrapper, RawCudaIPCWrapper]


def test_empty_tensor_needs_no_handle() -> None:
    empty = {**LAYER, "shape": [2, 0, 16, 8, 128]}
    for cls, fields in (
        (
            CudaIPCWrapper,
            torch_fields(
                **empty,
                handle=b"",
                storage_nbytes=0,
                storage_offset_bytes=0,
                ref_counter_handle=b"",
                ref_counter_offset=0,
                event_handle=b"",
                event_sync_required=0,
            ),
        ),
        (RawCudaIPCWrapper, raw_fields(**empty, ipc_handle=b"", alloc_offset=0, storage_nbytes=0)),
    ):
        assert cls.from_fields(fields).nbytes == 0


@pytest.mark.parametrize(
    "over, match",
    [
        ({"ref_counter_offset": 10_000}, "above the maximum 9999"),
        ({"ref_counter_offset": -1}, "below the minimum 0"),
        ({"ref_counter_handle": b"/dev/shm/../etc/passwd"}, "not a torch ref-counter name"),
        ({"ref_counter_handle": b"/torch_1_2_3\x00x"}, "not a torch ref-counter name"),
        ({"event_handle": bytes(63)}, "event_handle: 63 bytes"),
        ({"handle": bytes(10)}, "10 bytes is not a CUDA IPC handle"),
        ({"handle": bytes((1 << 16) + 1)}, "exceeds the limit"),
        ({"event_sync_required": 2}, "above the maximum 1"),
        ({"event_sync_required": True}, "expected int, got bool"),
        ({"storage_nbytes": LAYER_BYTES - 2}, "view needs"),
        ({"storage_nbytes": 0}, "empty storage carries no handles"),
        ({"handle": "text"}, "expected bytes, got str"),
        ({"dtype": "object"}, "not allowed"),
        ({"shape": [2, 64, 16, 8]}, "differ in rank"),
        ({"pickle": b"\x80\x04"}, "unknown fields"),
    ],
)
def test_torch_descriptor_validation(over: dict[str, Any], match: str) -> None:
    with pytest.raises(DescriptorError, match=match):
        CudaIPCWrapper.from_fields(torch_fields(**over))


@pytest.mark.parametrize(
    "over, match",
    [
        ({"ipc_handle": bytes(65)}, "exceeds the limit of 64"),
        ({"ipc_handle": bytes(32)}, "32 bytes, a CUDA IPC handle has 64"),
        ({"alloc_offset": -4096}, "below the minimum 0"),
        ({"alloc_offset": 1 << 60}, "above the maximum"),
        ({"storage_nbytes": 1024}, "view needs"),
        ({"storage_offset": 1}, "view needs"),
        ({"storage_nbytes": 0}, "empty storage carries no handle"),
    ],
)
def test_raw_descriptor_validation(over: dict[str, Any], match: str) -> None:
    with pytest.raises(DescriptorError, match=match):
        RawCudaIPCWrapper.from_fields(raw_fields(**over))


def test_missing_field_is_named() -> None:
    fields = raw_fields()
    del fields["alloc_offset"]
    with pytest.raises(DescriptorError, match=r"missing fields \['alloc_offset'\]"):
        RawCudaIPCWrapper.from_fields(fields)


def test_hostile_field_on_the_wire_is_a_wire_error() -> None:
    good = wire.encode([CudaIPCWrapper.from_fields(torch_fields())])
    bad = good.replace(b"/torch_4242_2983412_7", b"/torch_4242_2983412_x")
    assert len(bad) == len(good)
    with pytest.raises(WireFormatError, match="ref-counter name"):
        wire.decode(bad, allowed=ALLOWED)


@pytest.mark.parametrize("mode", ["torch", "raw"])
def test_receiver_accepts_either_kind_whatever_it_exports(
    mode: str, lmcache_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default allow-list (the resolved backend's wire classes) holds both kinds.

    The probe is faked available (no GPU here); the plugin module is the real one.
    """
    monkeypatch.setattr(_probe, "probe", lambda: _probe.Availability.yes())  # type: ignore[attr-defined]
    monkeypatch.setenv(IPC_ENV, mode)
    lmcache_registry.install("cuda", _plugin, distribution="lmcache-platform-cuda")
    wrappers = [RawCudaIPCWrapper.from_fields(raw_fields()), CudaIPCWrapper.from_fields(torch_fields())]
    assert wire.decode(wire.encode(wrappers)) == wrappers


@settings(deadline=None)  # a busy CI machine can stall one example past any deadline
@given(
    offset=st.integers(0, 1 << 40),
    blocks=st.integers(1, 4096),
    handle=st.binary(min_size=64, max_size=64),
    extra=st.integers(0, 1 << 20),
)
def test_raw_descriptors_survive_the_wire(offset: int, blocks: int, handle: bytes, extra: int) -> None:
    nbytes = 2 * blocks * 16 * 8 * 128 * 2 + extra
    shape = [2, blocks, 16, 8, 128]
    stride = [blocks * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1]
    w = RawCudaIPCWrapper.from_fields(
        raw_fields(shape=shape, stride=stride, ipc_handle=handle, alloc_offset=offset, storage_nbytes=nbytes)
    )
    assert wire.decode(wire.encode([w]), allowed=ALLOWED) == [w]


@pytest.mark.parametrize("kind", [CudaIPCWrapper, RawCudaIPCWrapper], ids=lambda k: k.__name__)
def test_wrap_refuses_non_cuda_tensors(kind: type[DeviceIPCWrapper]) -> None:
    with pytest.raises(DescriptorError, match="exports CUDA tensors, got one on cpu"):
        kind.wrap(torch.zeros(4))


@pytest.mark.parametrize("kind, make", [(CudaIPCWrapper, torch_fields), (RawCudaIPCWrapper, raw_fields)])
def test_to_tensor_checks_before_opening(
    kind: type[DeviceIPCWrapper], make: Any, fake_devices: FakeDevices
) -> None:
    """Device enumeration is faked (no GPU here); both refusals come before any CUDA call."""
    fake_devices.set(["0b9e8d7c-6b5a-4f3e-8d2c-1b0a9f8e7d6c"])
    with pytest.raises(DescriptorError, match=f"CUDA device {UUID} is not visible"):
        kind.from_fields(make()).to_tensor()
    fake_devices.set([UUID])
    closed = kind.from_fields(make())
    closed.close()
    with pytest.raises(DescriptorError, match="is closed; decode the descriptor again"):
        closed.to_tensor()


def test_a_share_reopened_in_its_own_exporting_process_is_refused_up_front(
    fake_devices: FakeDevices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench's ``transfer`` crash: ``to_tensor`` in the process that wrapped the tensor.

    CUDA IPC cannot open a handle in the process that exported it (on a GPU torch fails
    with "invalid device context"). No GPU here: torch's share is faked, so ``wrap`` runs on
    a CPU tensor; the refusal must come before any CUDA call.
    """
    fake_devices.set([UUID])
    fields = torch_fields(ref_counter_handle=b"/torch_999_123_0")
    share = (0, fields["handle"], LAYER_BYTES, 0, fields["ref_counter_handle"], 3, bytes(64), True)
    monkeypatch.setattr(_torch_ipc, "require_cuda", lambda cls, t: 0)
    monkeypatch.setattr(_torch_ipc, "share_cuda", lambda storage: share)
    monkeypatch.setattr(_torch_ipc, "EXPORTED_COUNTERS", set())
    layer = torch.empty(LAYER["shape"], dtype=torch.bfloat16)
    received = wire.decode(wire.encode([CudaIPCWrapper.wrap(layer)]), allowed=ALLOWED)[0]
    with pytest.raises(
        DescriptorError, match=r"this process exported this share \(torch ref counter /torch_999_123_0\)"
    ):
        received.to_tensor()
    # A share another process exported (another counter file) gets past the check, on to
    # opening it, which needs the GPU this machine lacks.
    other = CudaIPCWrapper.from_fields(torch_fields(ref_counter_handle=b"/torch_4242_1_0"))
    with pytest.raises(Exception) as opened:
        other.to_tensor()
    assert "exported this share" not in str(opened.value)

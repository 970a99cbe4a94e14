"""The wrapper wire format: round trips, allow-listing, and every kind of bad input.

The wrapper classes here are test doubles for the contract (no memory is mapped);
the real shared-memory wrapper crosses the wire in tests/server.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any, ClassVar

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmcache_platform
from lmcache_platform import (
    BackendSelectionError,
    DescriptorError,
    DeviceIPCWrapper,
    WireField,
    WireFormatError,
    wire,
)
from lmcache_platform.testing import fake_backend
from support.fakes import context_class

RELEASED: list[str] = []


class FakeWrapper(DeviceIPCWrapper):
    """A wrapper with one field of every primitive kind."""

    device_type = "fakedev"
    wire_tag = "fakedev.test/1"
    wire_fields: ClassVar = {
        "name": WireField(str, max_len=64),
        "handle": WireField(bytes, max_len=64),
        "ids": WireField(list, lo=0, hi=1000, max_len=8),
        "size": WireField(int, lo=0, hi=1 << 40),
    }

    def __init__(self, *, name: str, handle: bytes, ids: list[int], size: int, **base: Any):
        super().__init__(**base)
        self.name, self.handle, self.ids, self.size = name, handle, tuple(ids), size

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> FakeWrapper:
        raise NotImplementedError("a descriptor-only double")

    def to_tensor(self) -> torch.Tensor:
        raise NotImplementedError("a descriptor-only double")

    def release(self) -> None:
        RELEASED.append(self.name)


class OtherDeviceWrapper(FakeWrapper):
    device_type = "otherdev"
    wire_tag = "otherdev.test/1"


ALLOWED = {FakeWrapper.wire_tag: FakeWrapper}


def make(i: int = 0, **over: Any) -> FakeWrapper:
    kw: dict[str, Any] = dict(
        name=f"seg{i}",
        handle=bytes([i % 256]) * 16,
        ids=[i, i + 1],
        size=4096 * (i + 1),
        dtype=torch.bfloat16,
        shape=(2, 4, 16, 8, 128),
        stride=(65536, 16384, 1024, 128, 1),
        storage_offset=i,
        device_uuid="host-0",
    )
    kw.update(over)
    return FakeWrapper(**kw)


def backend(wrapper: type, wire_classes: list[type] | None = None) -> object:
    return fake_backend(
        "fakedev",
        context_class=context_class("fakedev"),
        wrapper_class=wrapper,
        wire_classes=wire_classes,
    )


def envelope(body: object, *, magic: bytes = wire.MAGIC, version: int = 1) -> bytes:
    """A message of ``body``; version 1 by default, whose records :func:`record` builds."""
    return magic + bytes([version]) + msgpack.packb(body, use_bin_type=True)


def record(**field_over: Any) -> list[object]:
    """A version-1 record: one wrapper, all its fields."""
    fields = make().fields()
    fields.update(field_over)
    return ["fakedev", FakeWrapper.wire_tag, fields]


def export_record(views: list[object], **export_over: Any) -> list[object]:
    """A version-2 record: one export's fields and its views."""
    fields = make().export_fields()
    fields.update(export_over)
    return ["fakedev", FakeWrapper.wire_tag, fields, views]


def view(**over: Any) -> list[object]:
    fields = {**make().view_fields(), **over}
    return [fields[name] for name in ("dtype", "shape", "stride", "storage_offset")]


def reject(data: object, match: str, **kw: Any) -> WireFormatError:
    with pytest.raises(WireFormatError, match=match) as info:
        wire.decode(data, **kw)  # type: ignore[arg-type]
    return info.value


# -- round trips -----------------------------------------------------------------------


def test_round_trip_keeps_order_type_and_fields() -> None:
    sent = [make(i) for i in range(5)]
    got = wire.decode(wire.encode(sent), allowed=ALLOWED)
    assert got == sent
    assert [type(w) for w in got] == [FakeWrapper] * 5
    assert got[3].handle == bytes([3]) * 16 and got[3].dtype is torch.bfloat16  # type: ignore[attr-defined]
    assert got[3].shape == (2, 4, 16, 8, 128) and isinstance(got[3].shape, tuple)


def test_empty_list_round_trips() -> None:
    assert wire.decode(wire.encode([]), allowed=ALLOWED) == []


def test_message_starts_with_magic_and_version() -> None:
    data = wire.encode([make()])
    assert data[:4] == b"LMCW" and data[4] == wire.VERSION


def test_default_allow_list_is_the_resolved_backend(lmcache_registry: Any) -> None:
    lmcache_registry.install("fakedev", backend(FakeWrapper))
    sent = [make(1), make(2)]
    assert wire.decode(wire.encode(sent)) == sent


def test_default_allow_list_includes_extra_wire_classes(lmcache_registry: Any) -> None:
    class RawWrapper(FakeWrapper):
        wire_tag = "fakedev.raw/1"

    lmcache_registry.install("fakedev", backend(FakeWrapper, [FakeWrapper, RawWrapper]))
    raw = RawWrapper(**{**make().fields(), "dtype": torch.float16, "ids": [7]})  # type: ignore[arg-type]
    got = wire.decode(wire.encode([make(), raw]))
    assert [type(w) for w in got] == [FakeWrapper, RawWrapper]


def test_real_cpu_wrapper_round_trips_and_aliases() -> None:
    """The installed cpu backend through the default allow-list: same memory after decoding.

    (Across processes, this is what tests/server does with a real server.)
    """
    tensors = [torch.arange(64, dtype=torch.float32).view(4, 16), torch.ones(3, 5)[:, 1:]]
    sent = lmcache_platform.wrap_kv_caches(tensors)
    got = wire.decode(wire.encode(sent))
    try:
        assert got == sent and [type(w) for w in got] == [type(w) for w in sent]
        assert type(got[0]).wire_tag in lmcache_platform._plugins.registry.wire_classes_for("cpu")
        view = got[1].to_tensor()
        assert view.stride() == tensors[1].stride() and torch.equal(view, tensors[1])
        view.fill_(7)
        assert torch.equal(tensors[1], torch.full((3, 4), 7.0))
        del view
    finally:
        for w in [*got, *sent]:
            w.close()


# -- one record per export (version 2) --------------------------------------------------


def test_views_of_one_export_travel_as_one_record() -> None:
    """Consecutive views of one memory share a record; the export fields go once."""
    same = [make(0, storage_offset=i * 8) for i in range(4)]
    other = make(1)
    sent = [*same, other, make(0, storage_offset=99)]  # the export returns: a new record
    data = wire.encode(sent)
    body = msgpack.unpackb(data[5:], raw=False)
    assert data[4] == wire.VERSION == 2
    assert [len(r[3]) for r in body] == [4, 1, 1]
    assert body[0][2] == same[0].export_fields() and "storage_offset" not in body[0][2]
    assert body[0][3][2] == ["bfloat16", [2, 4, 16, 8, 128], [65536, 16384, 1024, 128, 1], 16]
    assert wire.decode(data, allowed=ALLOWED) == sent


def test_version_1_messages_still_decode() -> None:
    sent = [make(0), make(1)]
    assert (
        wire.decode(
            envelope(
                [
                    record(),
                    record(name="seg1", handle=bytes([1]) * 16, ids=[1, 2], size=8192, storage_offset=1),
                ]
            ),
            allowed=ALLOWED,
        )
        == sent
    )


@pytest.mark.parametrize(
    ("views", "match", "closed"),
    [
        ([], "at least one view", []),
        ([view()[:3]], r"view 0: expected \[dtype, shape, stride, storage_offset\]", []),
        ([view(), [*view(), 1]], "view 1", []),
        ([view(), view(dtype="complex64")], "not allowed", ["seg0"]),  # the first was built: closed
        ([view(shape=[1, 2])], "differ in rank", []),
        ([view(storage_offset=-1)], "outside", []),
        ("not views", "expected a list", []),
    ],
)
def test_bad_views_are_refused(views: Any, match: str, closed: list[str]) -> None:
    RELEASED.clear()
    reject(envelope([export_record(views)], version=2), match, allowed=ALLOWED)
    assert closed == RELEASED


@pytest.mark.parametrize(
    ("over", "match"),
    [({"size": -1}, "outside"), ({"extra": 1}, "unknown fields"), ({"name": 5}, "expected str")],
)
def test_bad_export_fields_are_refused_once_for_all_views(over: dict[str, Any], match: str) -> None:
    reject(envelope([export_record([view(), view()], **over)], version=2), match, allowed=ALLOWED)


def test_an_export_record_may_not_exceed_the_wrapper_limit() -> None:
    body = [export_record([view()] * 3000), export_record([view()] * 1097)]
    reject(envelope(body, version=2), "exceed", allowed=ALLOWED)


def test_cpu_views_of_one_allocation_decode_to_one_mapping() -> None:
    """Decoded together, the layer views of one allocation map it once and stay one storage."""
    flat = torch.arange(8 * 256, dtype=torch.float32)
    layers = [flat[i * 256 : (i + 1) * 256].view(16, 16) for i in range(8)]
    sent = lmcache_platform.wrap_kv_caches(layers)
    got = wire.decode(wire.encode(sent))
    name = sent[0].fields()["memfd_name"]
    try:
        views = [w.to_tensor() for w in got]
        with open("/proc/self/maps") as f:
            maps = sum(name in line for line in f)  # type: ignore[operator]
        assert maps == 2  # the engine's and the one the decoded wrappers share
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1
        assert all(torch.equal(v, t) for v, t in zip(views, layers, strict=True))
        got[0].close()  # closing one wrapper leaves the shared mapping to the others
        assert torch.equal(got[7].to_tensor(), layers[7])
    finally:
        for w in [*got, *sent]:
            w.close()


_names = st.text(min_size=0, max_size=64)
_ints = st.integers(min_value=0, max_value=1 << 40)
_dims = st.lists(st.integers(min_value=0, max_value=1 << 16), min_size=0, max_size=6)


@st.composite
def wrappers(draw: st.DrawFn) -> FakeWrapper:
    shape = draw(_dims)
    stride = draw(st.lists(st.integers(0, 1 << 16), min_size=len(shape), max_size=len(shape)))
    return FakeWrapper(
        name=draw(_names),
        handle=draw(st.binary(max_size=64)),
        ids=draw(st.lists(st.integers(0, 1000), max_size=8)),
        size=draw(_ints),
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8])),
        shape=shape,
        stride=stride,
        storage_offset=draw(st.integers(0, 1 << 20)),
        device_uuid=draw(st.text(max_size=128)),
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(wrappers(), max_size=12))
def test_property_round_trip(sent: list[FakeWrapper]) -> None:
    got = wire.decode(wire.encode(sent), allowed=ALLOWED)
    assert got == sent
    assert [w.fields() for w in got] == [w.fields() for w in sent]


# -- hostile and malformed input --------------------------------------------------------


class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch /tmp/lmcache-wire-test-pwned",))


def test_pickle_payload_is_refused_and_never_run() -> None:
    err = reject(pickle.dumps(_Boom()), "pickle")
    assert "never accepted" in str(err)
    assert not os.path.exists("/tmp/lmcache-wire-test-pwned")
    reject(pickle.dumps([make().fields()]), "pickle")


def test_upstream_style_ext_pickle_is_refused() -> None:
    """Upstream LMCache wrapped pickles in msgpack ext code 1; no ext type is accepted."""
    body = msgpack.packb([msgpack.ExtType(1, pickle.dumps(_Boom()))])
    reject(wire.MAGIC + bytes([wire.VERSION]) + body, "malformed|ext")
    assert not os.path.exists("/tmp/lmcache-wire-test-pwned")


def test_timestamp_ext_is_refused() -> None:
    body = msgpack.packb([msgpack.Timestamp(1, 0)], datetime=False)
    reject(wire.MAGIC + bytes([wire.VERSION]) + body, "malformed")


def test_every_truncation_is_refused() -> None:
    data = wire.encode([make(0), make(1)])
    for n in range(len(data)):
        reject(data[:n], "header|truncated|expected|malformed")


def test_trailing_bytes_are_refused() -> None:
    reject(wire.encode([make()]) + b"\x00", "trailing")


def test_wrong_magic_and_version() -> None:
    good = wire.encode([make()])
    reject(b"LMCX" + good[4:], "header")
    reject(good[:4] + bytes([wire.VERSION + 1]) + good[5:], f"version {wire.VERSION + 1} is not supported")


@pytest.mark.parametrize("data", ["text", 42, None, [b"LMCW"]])
def test_non_bytes_input_is_refused(data: object) -> None:
    reject(data, "expected bytes")


def test_oversized_message_is_refused_before_parsing() -> None:
    big = envelope([record(name="x")]) + b"\x00" * wire.MAX_MESSAGE_BYTES
    reject(big, "exceed the limit")


def test_too_many_wrappers() -> None:
    reject(envelope([record()] * (wire.MAX_WRAPPERS + 1)), "malformed|exceed")
    with pytest.raises(WireFormatError, match="exceed the limit"):
        wire.encode([make()] * (wire.MAX_WRAPPERS + 1))


def test_oversized_string_is_capped_by_the_unpacker() -> None:
    reject(envelope([record(name="x" * 5000)]), "malformed")


def test_unknown_wire_tag_names_the_tag() -> None:
    rec = record()
    rec[1] = "fakedev.evil/9"
    err = reject(envelope([rec]), "'fakedev.evil/9' is not accepted", allowed=ALLOWED)
    assert "fakedev.test/1" in str(err)


def test_tag_of_another_device_type_is_refused() -> None:
    rec = ["fakedev", OtherDeviceWrapper.wire_tag, make().fields()]
    reject(
        envelope([rec]),
        "belongs to device type 'otherdev'",
        allowed={OtherDeviceWrapper.wire_tag: OtherDeviceWrapper},
    )


def test_unknown_device_type_is_wrapped_with_its_cause(lmcache_registry: Any) -> None:
    err = reject(envelope([record()]), "'fakedev' is not served in this process")
    assert isinstance(err.__cause__, BackendSelectionError)


@pytest.mark.parametrize("bad", ["CPU", "../cpu", "cpu\x00", "", "x" * 33, "1cpu", 7, None])
def test_device_type_is_checked_before_any_lookup(
    lmcache_registry: Any, bad: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(device_type: str) -> None:
        raise AssertionError(f"the registry was asked about {device_type!r}")

    monkeypatch.setattr(lmcache_registry.registry, "wire_classes_for", explode)
    rec = record()
    rec[0] = bad
    reject(envelope([rec]), "device type")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"shape": "2x4"}, "shape: expected a list"),
        ({"shape": [2, -1]}, "below the minimum"),
        ({"storage_offset": -1}, "below the minimum"),
        ({"storage_offset": True}, "expected int, got bool"),
        ({"size": 1 << 41}, "above the maximum"),
        ({"handle": "not bytes"}, "expected bytes"),
        ({"name": b"bytes"}, "expected str"),
        ({"ids": list(range(9))}, "exceed the limit"),
        ({"dtype": "object"}, "not allowed"),
        ({"dtype": "float16", "shape": [2, 2], "stride": [1]}, "differ in rank"),
        ({"shape": [1 << 40, 1 << 40], "stride": [1 << 40, 1]}, "overflows"),
        ({"extra": 1}, "unknown fields"),
    ],
)
def test_wrong_fields_raise_wire_error_from_descriptor_error(override: dict[str, Any], match: str) -> None:
    err = reject(envelope([record(**override)]), match, allowed=ALLOWED)
    assert isinstance(err.__cause__, DescriptorError)
    assert "record 0 (fakedev.test/1)" in str(err)


def test_missing_field() -> None:
    fields = make().fields()
    del fields["device_uuid"]
    reject(envelope([["fakedev", FakeWrapper.wire_tag, fields]]), "missing fields", allowed=ALLOWED)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"wrappers": []}, "expected a list"),
        ([["fakedev", FakeWrapper.wire_tag]], "expected \\[device_type"),
        ([["fakedev", FakeWrapper.wire_tag, [1, 2]]], "fields must be a map"),
        ([["fakedev", "bad tag!", {}]], "wire tag"),
        ([5], "expected a list"),
    ],
)
def test_malformed_structure(body: object, match: str) -> None:
    reject(envelope(body), match, allowed=ALLOWED)


def test_non_string_map_keys_are_refused() -> None:
    body = msgpack.packb([["fakedev", FakeWrapper.wire_tag, {1: 2}]])
    reject(wire.MAGIC + bytes([wire.VERSION]) + body, "malformed")


def test_deep_nesting_is_refused() -> None:
    depth = 5000
    body = b"\x91" * depth + b"\xc0"  # [[[[...nil...]]]]
    reject(wire.MAGIC + bytes([wire.VERSION]) + body, "malformed|expected")


def test_wrappers_built_before_a_bad_record_are_closed() -> None:
    RELEASED.clear()
    bad = record()
    bad[1] = "fakedev.unknown/1"
    reject(envelope([record(name="first"), record(name="second"), bad]), "not accepted", allowed=ALLOWED)
    assert RELEASED == ["first", "second"]


# -- encoding refuses what it cannot represent -----------------------------------------


def test_encode_refuses_non_wrappers() -> None:
    with pytest.raises(WireFormatError, match="item 1: expected a DeviceIPCWrapper"):
        wire.encode([make(), "cpu"])  # type: ignore[list-item]


def test_encode_refuses_a_class_without_a_tag() -> None:
    class Untagged(FakeWrapper):
        wire_tag = ""

    w = Untagged(**{**make().fields(), "dtype": torch.float16, "ids": []})  # type: ignore[arg-type]
    with pytest.raises(WireFormatError, match="needs a valid device_type and wire_tag"):
        wire.encode([w])


# -- fuzzing: only WireFormatError, whatever the bytes ------------------------------------

_VALID = wire.encode([make(0), make(1)])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    with pytest.raises(WireFormatError):
        wire.decode(data, allowed=ALLOWED)


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_mutated_valid_messages(mutations: list[tuple[int, int]]) -> None:
    data = bytearray(_VALID)
    for pos, value in mutations:
        data[pos] = value
    try:
        got = wire.decode(bytes(data), allowed=ALLOWED)
    except WireFormatError:
        return
    assert all(type(w) is FakeWrapper for w in got)  # a benign mutation still decodes cleanly


def test_length_prefix_lies_are_refused() -> None:
    """A str header announcing 2**32-1 bytes must not make the unpacker allocate them."""
    body = b"\x91\x93\xa7fakedev\xae" + b"fakedev.test/1" + b"\xdb" + struct.pack(">I", 0xFFFFFFFF)
    reject(wire.MAGIC + bytes([wire.VERSION]) + body, "malformed|truncated")

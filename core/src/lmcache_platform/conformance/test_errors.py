"""Conformance: malformed and hostile descriptors are refused, with typed errors.

A descriptor comes from another process, so the receiving side treats it as
untrusted: a bad field is a ``DescriptorError`` before anything is mapped, bad wire
bytes are a ``WireFormatError``. Hostile but well-typed descriptors are offered to
the spawned peer (the receiving side), which must refuse them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import DescriptorError, WireField, WireFormatError, wire
from lmcache_platform._codec import pack
from lmcache_platform.conformance._kv import random_bits
from lmcache_platform.conformance._peer import Peer
from lmcache_platform.conformance._target import Target


@pytest.fixture
def exported(lmcache_device: torch.device) -> Iterator[lp.DeviceIPCWrapper]:
    """A live export of a small 2-D tensor (a real descriptor to tamper with)."""
    tensor = random_bits((4, 16), torch.float16, seed=20).to(lmcache_device)
    (wrapper,) = lp.wrap_kv_caches([tensor])
    yield wrapper
    wrapper.close()


BASE_MUTATIONS: dict[str, dict[str, Any]] = {
    "dtype not allowed": {"dtype": "complex64"},
    "dtype not a string": {"dtype": 5},
    "negative dimension": {"shape": [-4, 16]},
    "shape and stride ranks differ": {"shape": [4, 16, 1]},
    "negative storage offset": {"storage_offset": -1},
    "overflowing extent": {"shape": [1 << 40, 1 << 40]},
    "too many dimensions": {"shape": [1] * 64, "stride": [1] * 64},
    "bool posing as an int": {"storage_offset": True},
}


@pytest.mark.parametrize("what", sorted(BASE_MUTATIONS))
def test_malformed_base_fields_are_refused(what: str, exported: lp.DeviceIPCWrapper) -> None:
    fields = {**exported.fields(), **BASE_MUTATIONS[what]}
    with pytest.raises(DescriptorError):
        type(exported).from_fields(fields)


def test_missing_and_unknown_fields_are_refused(exported: lp.DeviceIPCWrapper) -> None:
    cls, fields = type(exported), exported.fields()
    for name in fields:
        with pytest.raises(DescriptorError, match=name):
            cls.from_fields({k: v for k, v in fields.items() if k != name})
    with pytest.raises(DescriptorError, match="unknown"):
        cls.from_fields({**fields, "path": "/etc/passwd"})


def wrong_values(spec: WireField) -> Iterator[tuple[str, Any]]:
    """Values of the wrong kind, and values just outside the declared bounds."""
    yield "a float", 1.5
    yield "a dict", {"x": 1}
    yield "None", None
    if spec.kind is not str:
        yield "a str", "1"
    if spec.kind is not int:
        yield "an int", 1
    if spec.max_len is not None:
        if spec.kind is str:
            yield "a str over max_len", "a" * (spec.max_len + 1)
        elif spec.kind is bytes:
            yield "bytes over max_len", b"\0" * (spec.max_len + 1)
        elif spec.kind is list:
            yield "a list over max_len", [spec.lo or 0] * (spec.max_len + 1)
    if spec.kind in (int, list):
        for bound, step in ((spec.lo, -1), (spec.hi, 1)):
            if bound is not None:
                value = bound + step
                yield f"{'below lo' if step < 0 else 'above hi'}", [value] if spec.kind is list else value


def test_every_backend_field_refuses_wrong_kinds_and_out_of_bounds_values(
    exported: lp.DeviceIPCWrapper,
) -> None:
    cls, fields = type(exported), exported.fields()
    for name, spec in cls.wire_fields.items():
        for what, value in wrong_values(spec):
            with pytest.raises(DescriptorError):
                cls.from_fields({**fields, name: value})
                pytest.fail(f"{cls.__qualname__}.{name} accepted {what}: {value!r:.80}")


def refused_by_peer(peer: Peer, target: Target, wrapper: lp.DeviceIPCWrapper, fields: dict[str, Any]) -> str:
    """Offer ``fields`` to the peer; return the stage that refused them (fail if mapped)."""
    error = peer.error(
        "reopen_fields", device_type=target.device_type, wire_tag=type(wrapper).wire_tag, fields=fields
    )
    assert error.is_a("DescriptorError"), f"expected DescriptorError, got {error}\n{error.detail}"
    return error.message


def test_a_view_reaching_past_the_exported_memory_is_refused(
    exported: lp.DeviceIPCWrapper, lmcache_backend: Target, lmcache_peer: Peer
) -> None:
    fields: dict[str, Any] = exported.fields()
    rows, cols = fields["shape"]
    refused_by_peer(lmcache_peer, lmcache_backend, exported, {**fields, "shape": [rows * 1000, cols]})
    refused_by_peer(lmcache_peer, lmcache_backend, exported, {**fields, "storage_offset": rows * cols * 1000})


def test_a_descriptor_naming_another_device_is_refused(
    exported: lp.DeviceIPCWrapper, lmcache_backend: Target, lmcache_peer: Peer
) -> None:
    fields = {**exported.fields(), "device_uuid": "GPU-00000000-0000-0000-0000-00000000dead"}
    refused_by_peer(lmcache_peer, lmcache_backend, exported, fields)


def test_a_descriptor_with_path_tricks_in_its_strings_is_refused(
    exported: lp.DeviceIPCWrapper, lmcache_backend: Target, lmcache_peer: Peer
) -> None:
    """Every string field of the backend: a path, a parent reference, a NUL byte."""
    fields: dict[str, Any] = exported.fields()
    names = [n for n, spec in type(exported).wire_fields.items() if spec.kind is str and fields[n]]
    if not names:
        pytest.skip(f"{type(exported).__qualname__} has no string fields")
    for name in names:
        for value in ("/etc/passwd", "../" + fields[name], fields[name] + "/..", fields[name][:-1] + "\0"):
            refused_by_peer(lmcache_peer, lmcache_backend, exported, {**fields, name: value})


def test_tampered_wire_bytes_raise_wire_format_error(exported: lp.DeviceIPCWrapper) -> None:
    cls, fields = type(exported), exported.fields()
    good = wire.encode([exported])
    record = [cls.device_type, cls.wire_tag, fields]

    def message(*records: object) -> bytes:
        return pack(wire.MAGIC, wire.VERSION, list(records), max_bytes=wire.MAX_MESSAGE_BYTES, what="test")

    cases: dict[str, bytes] = {
        "truncated": good[:-3],
        "a pickle": b"\x80\x04\x95" + good,
        "unknown wire tag": message([cls.device_type, cls.wire_tag + "-forged", fields]),
        "another device type": message(["conformance_nodevice", cls.wire_tag, fields]),
        "a bad field": message([cls.device_type, cls.wire_tag, {**fields, "dtype": "complex64"}]),
        "a short record": message(record[:2]),
    }
    for what, data in cases.items():
        with pytest.raises(WireFormatError):
            wire.decode(data)
            pytest.fail(f"decode accepted {what}")

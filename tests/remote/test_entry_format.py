"""The remote entry format: exact round trips, and every kind of bad entry refused with its reason."""

from __future__ import annotations

import os
import random
import struct

import pytest
import torch

from lmcache_platform.remote._entry import (
    MAGIC,
    REASONS,
    VERSION,
    EntryIdentity,
    Refused,
    TensorSpec,
    decode,
    derive_secret,
    encode,
    encode_parts,
    spec_of,
)

WHO = EntryIdentity(b"prod-eu", bytes(range(32)), bytes(range(100, 132)))
SECRET = derive_secret(b"a deployment key of enough bytes")


def chunk() -> list[torch.Tensor]:
    return [
        torch.randn(2, 3, 16, 8),
        torch.randn(2, 16, 4).to(torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.randint(0, 255, (5,), dtype=torch.uint8),
        torch.empty(0, 4),
    ]


def refused(data: bytes | bytearray | memoryview, reason: str, **kwargs: object) -> Refused:
    with pytest.raises(Refused) as info:
        decode(data, **{"who": WHO, **kwargs})  # type: ignore[arg-type]
    assert info.value.reason == reason, str(info.value)
    return info.value


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip_is_exact_and_copy_free(secret: bytes | None, version: int) -> None:
    tensors = chunk()
    data = bytes(encode(tensors, WHO, secret, version=version))
    assert data[:4] == MAGIC and data[4] == version
    out = decode(data, WHO, secret, expect=[spec_of(t) for t in tensors])
    assert out.nbytes == sum(t.nbytes for t in tensors) and out.version == version
    for a, b in zip(tensors, out.tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    base = memoryview(data)
    start = int(torch.frombuffer(base, dtype=torch.uint8).data_ptr())
    assert start <= out.tensors[0].data_ptr() < start + len(data)  # a view of the fetched bytes


def test_an_unaligned_buffer_is_copied_once_and_still_exact() -> None:
    tensors = [torch.randn(4, 4, dtype=torch.float64)]
    data = bytearray(1) + encode(tensors, WHO)
    out = decode(memoryview(data)[1:], WHO)
    assert torch.equal(out.tensors[0], tensors[0]) and out.tensors[0].data_ptr() % 8 == 0


def test_identity_mismatches_are_refused_by_name() -> None:
    data = bytes(encode(chunk(), WHO))
    refused(data, "prefix", who=EntryIdentity(b"prod-us", WHO.namespace, WHO.key))
    refused(data, "namespace", who=EntryIdentity(WHO.prefix, bytes(32), WHO.key))
    refused(data, "key", who=EntryIdentity(WHO.prefix, WHO.namespace, bytes(32)))
    refused(data, "layout", expect=[TensorSpec("float32", (2, 3, 16, 8))])
    refused(data, "layout", expect=[TensorSpec("float16", tuple(t.shape)) for t in chunk()])


@pytest.mark.parametrize("version", [1, 2])
def test_keyed_entries_need_the_key_and_cannot_be_forged(version: int) -> None:
    plain = bytes(encode(chunk(), WHO, version=version))
    keyed = bytes(encode(chunk(), WHO, SECRET, version=version))
    refused(plain, "auth", secret=SECRET)  # an unkeyed writer cannot feed a keyed deployment
    refused(keyed, "auth")  # nor the other way round
    forged = bytes(encode(chunk(), WHO, derive_secret(b"a guessed key, not the real one"), version=version))
    refused(forged, "checksum", secret=SECRET)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_version_is_checked_with_its_own_checksum_never_the_other(secret: bytes | None) -> None:
    """Relabelling an entry's version makes its checksum wrong: no entry passes unchecked."""
    for version in (1, 2):
        data = bytearray(encode(chunk(), WHO, secret, version=version))
        data[4] = 3 - version
        refused(data, "checksum", secret=secret)


@pytest.mark.parametrize("version", [1, 2])
def test_an_entry_in_parts_is_the_same_bytes_without_copying_the_tensors(version: int) -> None:
    tensors = [*chunk(), torch.randn(6, 4).t()]  # a non-contiguous one too
    parts = encode_parts(tensors, WHO, SECRET, version=version)
    assert b"".join(parts) == bytes(encode(tensors, WHO, SECRET, version=version))
    first = int(tensors[0].data_ptr())
    assert any(int(torch.frombuffer(p, dtype=torch.uint8).data_ptr()) == first for p in parts if len(p))


def test_new_entries_are_the_new_version() -> None:
    assert VERSION == 2 and bytes(encode(chunk(), WHO))[4] == 2
    with pytest.raises(ValueError, match="version 3"):
        encode(chunk(), WHO, version=3)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        derive_secret(b"short")


def test_truncated_padded_and_foreign_bytes_are_refused() -> None:
    data = bytes(encode(chunk(), WHO))
    refused(data[:10], "truncated")
    refused(data[:100], "truncated")
    refused(data[:-1], "truncated")
    refused(data + b"\0", "truncated")
    refused(b"", "truncated")
    refused(b"PK\x03\x04" + data[4:], "magic")
    refused(b"\x80\x04\x95" + data[3:], "magic")  # a pickle's first bytes: never unpickled
    refused(data[:4] + bytes([3]) + data[5:], "version")
    refused(data[:4] + bytes([0]) + data[5:], "version")


def test_malformed_headers_are_refused() -> None:
    data = bytearray(encode(chunk(), WHO))
    bad_flags = bytearray(data)
    bad_flags[5] = 0x80
    refused(bad_flags, "header")
    bad_count = bytearray(data)
    bad_count[11] = 0
    refused(bad_count, "header")
    bad_dtype = bytearray(data)
    at = bad_dtype.index(b"float32")
    bad_dtype[at : at + 7] = b"object\0"
    refused(bad_dtype, "header")
    bad_len = bytearray(data)
    struct.pack_into("<Q", bad_len, 16, struct.unpack_from("<Q", data, 16)[0] + 64)
    refused(bad_len + bytes(64), "header")


@pytest.mark.parametrize("version", [1, 2])
def test_every_flipped_bit_is_refused(version: int) -> None:
    """No single-bit corruption anywhere in an entry is ever loaded."""
    data = bytes(encode([torch.randn(3, 5)], WHO, version=version))
    rng = random.Random(7)
    seen = set()
    for pos in list(range(len(data))) + [rng.randrange(len(data)) for _ in range(200)]:
        corrupt = bytearray(data)
        corrupt[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(Refused) as info:
            decode(corrupt, WHO)
        seen.add(info.value.reason)
    assert seen <= set(REASONS) and "checksum" in seen


def test_random_bytes_are_refused() -> None:
    for n in (0, 1, 23, 24, 64, 200, 4096):
        with pytest.raises(Refused):
            decode(os.urandom(n), WHO)


def test_encode_refuses_what_it_cannot_describe() -> None:
    with pytest.raises(ValueError, match="1 to 64 tensors"):
        encode([], WHO)
    with pytest.raises(ValueError, match="namespace"):
        encode([torch.zeros(1)], EntryIdentity(b"p", b"", b"k"))
    with pytest.raises(ValueError, match="complex64"):
        encode([torch.zeros(2, dtype=torch.complex64)], WHO)

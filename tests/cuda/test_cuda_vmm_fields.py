"""VMM descriptors as wire fields: strict validation before any driver call, fuzzed.

Runs without a GPU. Descriptors are built from fields, as the decoder builds them; the
driver is ``FakeVmmLib`` (support.cuda_fakes), which records every call, so a refusal
can be shown to come before CUDA is touched. The fds named here are real (memfds) where
a descriptor gets as far as ``to_tensor``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platform import DescriptorError, WireFormatError, wire
from lmcache_platform_cuda import CudaVmmIPCWrapper
from lmcache_platform_cuda._vmm_ipc import MAX_SEGMENTS, MIN_GRANULARITY
from support.cuda_fakes import UUIDS, FakeVmmLib, open_fds

MIB2 = MIN_GRANULARITY
ALLOWED = {CudaVmmIPCWrapper.wire_tag: CudaVmmIPCWrapper}
#: One paged vLLM layer: [2, 64 blocks, 16 tokens, 8 heads, 128] bf16 (4 MiB).
LAYER: dict[str, Any] = {
    "dtype": "bfloat16",
    "shape": [2, 64, 16, 8, 128],
    "stride": [64 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1],
    "storage_offset": 0,
    "device_uuid": UUIDS[0],
}


def fields(**over: Any) -> dict[str, Any]:
    out = {
        **LAYER,
        "segment_offsets": [0, MIB2],
        "segment_sizes": [MIB2, 2 * MIB2],
        "segment_fds": [900, 901],  # refused descriptors take no ownership: numbers will do
        "storage_start": 4096,
    }
    out.update(over)
    return out


def engine(**over: Any) -> CudaVmmIPCWrapper:
    """A descriptor as wrap() makes it (built directly: it borrows its fds, owns none)."""
    return CudaVmmIPCWrapper(**{**fields(**over), "dtype": torch.bfloat16})


def memfds(n: int) -> list[int]:
    return [os.memfd_create(f"fd{i}", os.MFD_CLOEXEC) for i in range(n)]


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_fields_round_trip() -> None:
    fds = memfds(2)
    w = CudaVmmIPCWrapper.from_fields(fields(segment_fds=fds))  # decoded: it owns the fds
    assert w.fields() == fields(segment_fds=fds)
    assert all(isinstance(v, (int, str, list)) for v in w.fields().values())  # never objects
    assert engine(segment_fds=fds) == w
    assert CudaVmmIPCWrapper.wire_fields["segment_fds"].fds
    w.close()
    assert not any(is_open(fd) for fd in fds)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"segment_fds": [900]}, "2 segment offsets, 2 sizes and 1 fds"),
        ({"segment_sizes": [MIB2]}, "2 segment offsets, 1 sizes and 2 fds"),
        ({"segment_fds": [900, 900]}, "repeats an fd"),
        ({"segment_offsets": [MIB2, 2 * MIB2]}, "segment 0 starts at 2097152, not at 0"),
        ({"segment_offsets": [0, 2 * MIB2]}, "segment 1 starts at 4194304, not at 2097152"),  # a gap
        ({"segment_offsets": [0, MIB2 // 2]}, "segment 1 starts at 1048576"),  # an overlap
        ({"segment_offsets": [MIB2, 0], "segment_sizes": [MIB2, MIB2]}, "segment 0 starts at"),  # unsorted
        (
            {"segment_sizes": [MIB2 + 4096, 2 * MIB2], "segment_offsets": [0, MIB2 + 4096]},
            "not a positive multiple",
        ),
        ({"segment_sizes": [0, 2 * MIB2], "segment_offsets": [0, 0]}, "has 0 bytes"),
        ({"segment_offsets": [-MIB2, 0]}, "below the minimum 0"),
        ({"segment_sizes": [MIB2, 1 << 60]}, "above the maximum"),
        ({"segment_fds": [900, -1]}, "below the minimum 0"),
        ({"segment_fds": [900, 1 << 40]}, "above the maximum"),
        ({"segment_fds": [900, True]}, "expected int, got bool"),
        ({"segment_fds": "900"}, "expected a list, got str"),
        ({"storage_start": 3 * MIB2 + 1}, "lies past the 6291456-byte span"),
        ({"storage_start": 3 * MIB2 - 4096}, "view needs"),
        ({"storage_offset": 1 << 20}, "view needs"),
        ({"segment_offsets": [], "segment_sizes": [], "segment_fds": [], "storage_start": 0}, "view needs"),
        ({"dtype": "object"}, "not allowed"),
        ({"pickle": b"\x80\x04"}, "unknown fields"),
    ],
)
def test_hostile_descriptors_are_refused(over: dict[str, Any], match: str) -> None:
    with pytest.raises(DescriptorError, match=match):
        CudaVmmIPCWrapper.from_fields(fields(**over))


def test_too_many_segments() -> None:
    n = MAX_SEGMENTS + 1
    over = {
        "segment_offsets": [i * MIB2 for i in range(n)],
        "segment_sizes": [MIB2] * n,
        "segment_fds": list(range(1000, 1000 + n)),
    }
    with pytest.raises(DescriptorError, match=f"1025 items exceed the limit of {MAX_SEGMENTS}"):
        CudaVmmIPCWrapper.from_fields(fields(**over))


def test_a_closed_fd_is_refused_before_any_driver_call(fake_vmm: FakeVmmLib) -> None:
    fd = os.memfd_create("x")
    os.close(fd)  # a number that names nothing
    w = engine(segment_offsets=[0], segment_sizes=[4 * MIB2], segment_fds=[fd], storage_start=0)
    with pytest.raises(DescriptorError, match=f"fd {fd} of the descriptor is not open here"):
        w.to_tensor()
    assert not [call for call in fake_vmm.calls if call.startswith("cuMem") or call == "cuDeviceGetAttribute"]


def test_an_fd_that_is_no_allocation_is_refused_by_the_driver_and_nothing_stays(fake_vmm: FakeVmmLib) -> None:
    """A hostile but open fd (here /dev/null): the import fails, nothing stays mapped."""
    baseline = open_fds()
    fd = os.open("/dev/null", os.O_RDONLY)
    w = CudaVmmIPCWrapper.from_fields(
        fields(segment_offsets=[0], segment_sizes=[4 * MIB2], segment_fds=[fd], storage_start=0)
    )
    with pytest.raises(
        DescriptorError, match="cuMemImportFromShareableHandle failed: CUDA_ERROR_INVALID_VALUE"
    ):
        w.to_tensor()
    assert fake_vmm.mappings == {} and fake_vmm.reservations == {}
    w.close()  # it owned the fd
    assert open_fds() == baseline


#: A segment fd as the fuzzer draws it: mostly a fresh memfd; else a repeat, or no fd at all.
FD_CHOICES = st.one_of(st.sampled_from(["fresh"] * 12 + ["repeat", -1, 1 << 31]))
#: Damage to a sound layout, mostly none.
JITTER = st.sampled_from([0] * 24 + [4096, -1, MIB2, -MIB2, 1 << 60])


@settings(deadline=None, max_examples=300)
@given(
    granules=st.lists(st.sampled_from([1, 1, 1, 2, 3, 3, 0, -1]), max_size=5),
    size_jitter=st.lists(JITTER, max_size=5),
    offset_jitter=st.lists(JITTER, max_size=5),
    extra=st.sampled_from([[]] * 6 + [[0], [MIB2]]),
    fd_kinds=st.lists(FD_CHOICES, min_size=6, max_size=6),
    fd_count=st.sampled_from([0] * 8 + [1, -1]),
    start=st.one_of(st.sampled_from([0, 0, 4096, 8192, MIB2]), st.integers(-2, 1 << 60)),
    blocks=st.integers(0, 24),
)
def test_fuzzed_segments_are_sound_or_refused(
    granules: list[int],
    size_jitter: list[int],
    offset_jitter: list[int],
    extra: list[int],
    fd_kinds: list[Any],
    fd_count: int,
    start: int,
    blocks: int,
) -> None:
    """Whatever the fields: a DescriptorError, taking no fd, or a descriptor whose segments tile
    a span from 0 in granules with distinct fds and the view inside it, owning its fds."""
    sizes = [g * MIB2 + j for g, j in zip(granules, size_jitter + [0] * 5, strict=False)]
    offsets = [sum(sizes[:i]) + j for i, j in enumerate(offset_jitter + [0] * 5) if i < len(sizes)]
    offsets += extra  # sometimes one too many
    fds: list[int] = []
    for kind in fd_kinds[: max(len(sizes) + fd_count, 0)]:
        fds.append(memfds(1)[0] if kind == "fresh" else fds[-1] if kind == "repeat" and fds else -1)
    made = [fd for fd in set(fds) if fd >= 0]
    shape = [2, blocks, 16, 8, 128]  # 64 KiB a block
    stride = [blocks * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1]
    over = {"shape": shape, "stride": stride, "segment_offsets": offsets, "segment_sizes": sizes}
    try:
        w = CudaVmmIPCWrapper.from_fields(fields(**over, segment_fds=fds, storage_start=start))
    except DescriptorError:
        assert all(is_open(fd) for fd in made)  # a refusal owns nothing
        for fd in made:
            os.close(fd)
        return
    assert len(w.segment_offsets) == len(w.segment_sizes) == len(set(w.segment_fds)) == len(made)
    edge = 0
    for offset, size in zip(w.segment_offsets, w.segment_sizes, strict=True):
        assert offset == edge and size > 0 and size % MIB2 == 0
        edge += size
    assert 0 <= w.storage_start <= edge and w.storage_start + w.nbytes <= edge
    data, sent = wire.encode_with_fds([w])
    assert sent == list(w.segment_fds)
    (again,) = wire.decode(data, fds=[os.dup(fd) for fd in sent], allowed=ALLOWED)
    assert {**again.fields(), "segment_fds": []} == {**w.fields(), "segment_fds": []}
    again.close()
    w.close()
    assert not any(is_open(fd) for fd in made)


@settings(deadline=None, max_examples=100)
@given(data=st.binary(min_size=0, max_size=64), flip=st.integers(0, 400))
def test_tampered_fd_messages_raise_only_wire_errors_and_close_every_fd(data: bytes, flip: int) -> None:
    """Random damage to a message with fds: WireFormatError or wrappers; never an fd leaked."""
    w = engine()
    good, sent = wire.encode_with_fds([w])
    bad = bytearray(good)
    if bad:
        bad[flip % len(bad)] ^= 0xFF if data[:1] != b"\0" else 0x01
    baseline = open_fds()
    received = [os.memfd_create("sent", os.MFD_CLOEXEC) for _ in sent]
    try:
        decoded = wire.decode(bytes(bad), fds=received, allowed=ALLOWED)
    except WireFormatError:
        assert open_fds() == baseline
        return
    for x in decoded:
        x.close()
    assert open_fds() == baseline


def test_fd_indices_out_of_range_are_refused_and_every_fd_closed() -> None:
    data, sent = wire.encode_with_fds([engine()])
    assert sent == [900, 901]
    baseline = open_fds()
    with pytest.raises(WireFormatError, match="file descriptor index 1 names none of the 1 that came"):
        wire.decode(data, fds=[os.memfd_create("only", os.MFD_CLOEXEC)], allowed=ALLOWED)
    assert open_fds() == baseline


def test_a_repeated_fd_index_gets_its_own_fd() -> None:
    """Two records naming one fd (two exports sharing an allocation): each owns a dup."""
    a, b = engine(segment_fds=[900, 901]), engine(segment_fds=[901, 902], storage_start=0)
    data, sent = wire.encode_with_fds([a, b])
    assert sent == [900, 901, 902]
    baseline = open_fds()
    received = [os.memfd_create(str(i), os.MFD_CLOEXEC) for i in range(3)]
    da, db = wire.decode(data, fds=received, allowed=ALLOWED)
    assert isinstance(da, CudaVmmIPCWrapper) and isinstance(db, CudaVmmIPCWrapper)
    assert da.segment_fds[1] != db.segment_fds[0]
    assert os.fstat(da.segment_fds[1]).st_ino == os.fstat(db.segment_fds[0]).st_ino
    da.close()
    db.close()
    assert open_fds() == baseline

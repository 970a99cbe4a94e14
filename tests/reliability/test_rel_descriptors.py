"""Case 2: hostile descriptors for the CPU wrapper, refused before anything is mapped.

Each descriptor arrives as primitives (``from_fields``, what the wire decoder calls)
and, if that accepts it, is reopened (``to_tensor``). Every one must end in
``DescriptorError`` naming the culprit, with this process's /dev/shm mappings and
open fds exactly as before (read from ``/proc/self``, not from the backend).

Segments that are not what their name claims (another user's, too permissive,
a symlink, a FIFO, a directory, the wrong size) are made for real in /dev/shm; the
one owned by another uid needs root, which CI has here (skipped otherwise).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from lmcache_platform import DescriptorError
from lmcache_platform_cpu import CpuShmIPCWrapper
from support.reliability import SHM_DIR, fd_targets, forge_name, mapped_shm, mappings_of

NOBODY = 65534


@pytest.fixture
def segment() -> Iterator[CpuShmIPCWrapper]:
    """A real segment of this process (4 KiB of float32), as the engine would wrap it."""
    tensor = torch.arange(1024, dtype=torch.float32)
    w = CpuShmIPCWrapper.wrap(tensor)
    yield w
    w.close()


def fields(w: CpuShmIPCWrapper | None = None, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "dtype": "float32",
        "shape": [1024],
        "stride": [1],
        "storage_offset": 0,
        "device_uuid": "cpu",
        "shm_name": forge_name(),
        "shm_nbytes": 4096,
    }
    if w is not None:
        base.update(w.fields())
    base.update(over)
    return base


@contextlib.contextmanager
def nothing_mapped() -> Iterator[None]:
    """No /dev/shm mapping and no fd appears meanwhile (garbage of earlier tests may go away)."""
    maps, fds = mapped_shm(), fd_targets()
    yield
    assert not mapped_shm() - maps, f"a hostile descriptor got mapped: {mapped_shm() - maps}"
    assert not fd_targets() - fds, f"a refused descriptor leaked an fd: {fd_targets() - fds}"


def refuse(f: dict[str, Any], match: str) -> DescriptorError:
    """``from_fields`` then ``to_tensor`` must raise ``DescriptorError`` matching ``match``."""
    with nothing_mapped(), pytest.raises(DescriptorError, match=match) as info:
        CpuShmIPCWrapper.from_fields(f).to_tensor()
    return info.value


# -- names ---------------------------------------------------------------------------------

HEX = "0123456789abcdef" * 2
NAMES = {
    "foreign prefix": "other_segment",
    "prefix look-alike": f"lmcache_platformX_1_2_{HEX}",
    "upper case": f"LMCACHE_PLATFORM_1_2_{HEX}",
    "not hex": f"lmcache_platform_1_2_{'g' * 32}",
    "short random part": f"lmcache_platform_1_2_{HEX[:31]}",
    "dot-dot": "..",
    "dot-dot prefix": f"../lmcache_platform_1_2_{HEX}",
    "dot-dot suffix": f"lmcache_platform_1_2_{HEX}/..",
    "escape": f"lmcache_platform_1_2_{HEX}/../../../etc/passwd",
    "absolute": f"/dev/shm/lmcache_platform_1_2_{HEX}",
    "slash": f"lmcache_platform_1/2_{HEX}",
    "nul byte": f"lmcache_platform_1_2_{HEX}\x00",
    "newline": f"lmcache_platform_1_2_{HEX}\n",
    "too long": f"lmcache_platform_{'1' * 60}_2_{HEX}",
}


@pytest.mark.parametrize("name", NAMES.values(), ids=NAMES.keys())
def test_names_outside_the_pattern_are_refused_by_from_fields(name: str) -> None:
    err = refuse(fields(shm_name=name), "not a segment of this project|exceeds the limit")
    assert "lmcache_platform_" in str(err) or "shm_name" in str(err)


def test_non_ascii_digits_are_outside_the_pattern() -> None:
    """Python's ``\\d`` matches any Unicode digit; the documented pattern is ASCII only."""
    with nothing_mapped(), pytest.raises(DescriptorError, match="not a segment of this project"):
        CpuShmIPCWrapper.from_fields(fields(shm_name=f"lmcache_platform_\u0661_\u0662_{HEX}"))


# -- layout fields ---------------------------------------------------------------------------

LAYOUTS: dict[str, tuple[dict[str, Any], str]] = {
    "negative dim": ({"shape": [-1]}, "below the minimum"),
    "negative stride": ({"stride": [-1]}, "below the minimum"),
    "negative offset": ({"storage_offset": -1}, "below the minimum"),
    "huge dim": ({"shape": [(1 << 48) + 1]}, "above the maximum"),
    "int64 overflow dim": ({"shape": [1 << 63]}, "above the maximum"),
    "uint64 overflow stride": ({"stride": [(1 << 64) - 1]}, "above the maximum"),
    "huge offset": ({"storage_offset": 1 << 64}, "above the maximum"),
    "product overflow": ({"shape": [1 << 24] * 3, "stride": [1 << 24, 1 << 12, 1]}, "overflows"),
    "stride times dim overflow": ({"shape": [1 << 47, 3], "stride": [3, 1]}, "overflows"),
    "view past the segment": ({"shape": [1025]}, "spans 4100 bytes but the memory holds only 4096"),
    "offset past the segment": ({"storage_offset": 1}, "spans 4100 bytes"),
    "stride past the segment": ({"shape": [2, 1024], "stride": [1, 1]}, "spans"),
    "rank mismatch": ({"shape": [32, 32], "stride": [1]}, "differ in rank"),
    "too many dims": ({"shape": [1] * 9, "stride": [1] * 9}, "exceed the limit"),
    "float dim": ({"shape": [1024.0]}, "expected int"),
    "bool dim": ({"shape": [True]}, "expected int"),
    "string offset": ({"storage_offset": "0"}, "expected int"),
    "shape not a list": ({"shape": 1024}, "expected a list"),
    "segment size negative": ({"shm_nbytes": -4096}, "below the minimum"),
    "size without a segment": ({"shm_name": "", "shm_nbytes": 4096}, "no memory is named"),
    "other device": ({"device_uuid": "cuda:0"}, "device_uuid"),
    "missing field": ({"shm_nbytes": None}, "missing fields"),
    "extra field": ({"mmap_flags": 1}, "unknown fields"),
}


@pytest.mark.parametrize("over, match", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_hostile_layouts_are_refused_by_from_fields(over: dict[str, Any], match: str) -> None:
    f = fields(**over)
    if f.get("shm_nbytes", 0) is None:
        del f["shm_nbytes"]
    refuse(f, match)


DTYPES = [
    "complex64",
    "complex128",
    "qint8",
    "quint4x2",
    "uint16",
    "float",
    "object",
    "torch.float32",
    "Float16",
    "float16 ",
    "",
    "__class__",
    "bits8",
    "float8_e4m3fnuz",
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_disallowed_dtypes_are_refused(dtype: str) -> None:
    refuse(fields(dtype=dtype), "not allowed")


# -- segments that are not what their name says ----------------------------------------------


@pytest.fixture
def forged() -> Iterator[Callable[..., str]]:
    """Make a well-formed name in /dev/shm as something else; everything is removed after."""
    made: list[str] = []

    def make(
        kind: str = "file",
        *,
        size: int = 4096,
        mode: int = 0o600,
        uid: int | None = None,
        target: str | None = None,
    ) -> str:
        name = forge_name()
        path = os.path.join(SHM_DIR, name)
        made.append(path)
        if kind == "file":
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            os.fchmod(fd, mode)
            if uid is not None:
                os.fchown(fd, uid, uid)
            os.close(fd)
        elif kind == "symlink":
            assert target is not None
            os.symlink(os.path.join(SHM_DIR, target), path)
        elif kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "dir":
            os.mkdir(path, 0o700)
        return name

    yield make
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_another_users_segment_is_refused_before_mapping(forged: Callable[..., str]) -> None:
    name = forged(uid=NOBODY)
    err = refuse(fields(shm_name=name), f"belongs to uid {NOBODY}")
    assert name in str(err) and mappings_of(name) == 0


def test_a_segment_readable_by_others_is_refused(forged: Callable[..., str]) -> None:
    name = forged(mode=0o644)
    refuse(fields(shm_name=name), "mode 0644")


def test_a_symlink_to_a_real_segment_is_not_followed(
    forged: Callable[..., str], segment: CpuShmIPCWrapper
) -> None:
    name = forged("symlink", target=segment.shm_name)
    producer_maps = mappings_of(segment.shm_name)  # the engine's own mapping (same process here)
    refuse(fields(segment, shm_name=name), "cannot open|not a regular file")
    assert mappings_of(segment.shm_name) == producer_maps


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_non_file_is_refused(forged: Callable[..., str], kind: str) -> None:
    refuse(fields(shm_name=forged(kind)), "not a regular file|cannot open")


@pytest.mark.parametrize("real, claimed", [(4096, 8192), (4096, 1 << 40), (8192, 4096)])
def test_a_size_other_than_the_segments_is_refused(
    forged: Callable[..., str], real: int, claimed: int
) -> None:
    """Larger would fault past the end (SIGBUS); smaller would hide a mismatch. Only exact passes."""
    name = forged(size=real)
    refuse(fields(shm_name=name, shm_nbytes=claimed), f"holds {real} bytes but the descriptor says {claimed}")


def test_a_missing_segment_is_refused() -> None:
    refuse(fields(), "does not exist")


def test_the_same_descriptor_with_honest_fields_maps(segment: CpuShmIPCWrapper) -> None:
    """The control: the refusals above are about the hostile field, not the set-up."""
    maps = mappings_of(segment.shm_name)
    reopened = CpuShmIPCWrapper.from_fields(fields(segment))
    view = reopened.to_tensor()
    assert mappings_of(segment.shm_name) == maps + 1
    assert torch.equal(view, torch.arange(1024, dtype=torch.float32))
    del view
    reopened.close()

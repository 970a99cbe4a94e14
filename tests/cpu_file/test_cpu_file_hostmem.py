"""The public host-memory kit (``lmcache_platform.hostmem``) as a vendor backend uses it.

The migration and lifetime machinery itself is exercised through both of its users:
``tests/cpu`` (POSIX shared memory) and the rest of this directory (files).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmcache_platform import DescriptorError, WireField, _headroom, hostmem
from lmcache_platform.hostmem import (
    HostMemoryIPCWrapper,
    InPlaceStore,
    SegmentNames,
    SideBySideStore,
    find_stale,
    producer_alive,
)
from lmcache_platform_cpu_file import CpuFileIPCWrapper, FileStore, _store


def test_names_are_ascii_only_and_never_paths() -> None:
    names = SegmentNames("vendor_kv_", kind="vendor", noun="buffer")
    name = names.new()
    assert names.parse(name)[1] == os.getpid() and len(name) <= names.max_len
    for bad in (
        f"vendor_kv_\u0661_\u0662_{'a' * 32}",
        f"vendor_kv_1_2_{'a' * 32}/..",
        "../" + name,
        name + "\n",
    ):
        with pytest.raises(DescriptorError, match="is not a buffer of this project"):
            names.parse(bad)
    with pytest.raises(ValueError, match="prefix"):
        SegmentNames("../")


def test_the_wire_fields_come_from_the_stores_handle_schema() -> None:
    assert CpuFileIPCWrapper.wire_fields == {
        "file_name": WireField(str, max_len=_store.NAMES.max_len),
        "file_nbytes": WireField(int, lo=0, hi=1 << 48),
    }
    assert CpuFileIPCWrapper.device_type == "cpu"
    assert HostMemoryIPCWrapper.nbytes_field == "mem_nbytes"  # the default a store's wrapper may rename


def test_a_wrapper_class_without_a_store_says_so() -> None:
    class Storeless(HostMemoryIPCWrapper):
        wire_tag = "vendor.storeless/1"

    with pytest.raises(TypeError, match="Storeless has no store"):
        Storeless.wrap(torch.ones(4))


class HalfStore:
    """A store with a handle schema but only two of the five methods."""

    handle_fields = {"vendor_name": WireField(str, max_len=64)}

    def create(self, nbytes: int) -> None: ...

    def release(self, handle: object) -> bool:
        return False


def test_a_store_missing_members_is_refused_when_the_class_is_made_listing_them() -> None:
    with pytest.raises(
        TypeError,
        match=r"Half.store \(HalfStore\) is not a HostMemoryStore: it lacks "
        r"check_handle, check_capacity, open_existing$",
    ):

        class Half(HostMemoryIPCWrapper):
            wire_tag = "vendor.half/1"
            store = HalfStore()  # type: ignore[assignment]


class OnlyCreateInPlace(FileStore):
    """Half of ``InPlaceStore``: without ``reserve`` the kit could never share in place."""

    def create_in_place(self, nbytes: int) -> tuple[dict[str, str], int]:
        raise AssertionError("never called")


class OpenFdNotAMethod(FileStore):
    open_fd = "yes"  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("store", "match"),
    [
        (OnlyCreateInPlace(), r"InPlaceStore needs the methods create_in_place, reserve: reserve missing"),
        (OpenFdNotAMethod(), r"SideBySideStore needs the methods open_fd: open_fd missing"),
    ],
)
def test_a_store_with_part_of_an_optional_protocol_is_refused_naming_it(store: object, match: str) -> None:
    """Half an ability would be silently unused; the class is refused when it is made."""
    with pytest.raises(
        TypeError, match=r"Partial.store \(\w+\) implements part of an optional store protocol: " + match
    ):
        type("Partial", (HostMemoryIPCWrapper,), {"wire_tag": "vendor.partial/1", "store": store})


def test_the_optional_abilities_are_the_protocols_a_store_satisfies() -> None:
    """``cpu.file`` maps side by side but copies rather than sharing in place; the kit uses what is there."""
    assert isinstance(CpuFileIPCWrapper.store, SideBySideStore)
    assert not isinstance(CpuFileIPCWrapper.store, InPlaceStore)
    assert isinstance(HalfStore(), SideBySideStore) is False
    tracker = CpuFileIPCWrapper._memory()
    assert tracker.side_by_side is CpuFileIPCWrapper.store and tracker.in_place is None


def test_declared_wire_fields_that_disagree_with_the_store_are_refused() -> None:
    """Declaring ``wire_fields`` used to replace the kit's own silently; wrap() then broke."""
    with pytest.raises(
        TypeError,
        match="derives them from its store's handle_fields and its nbytes_field "
        r"\(file_name, file_nbytes\): remove the declaration",
    ):

        class Extra(CpuFileIPCWrapper):
            wire_fields = {**CpuFileIPCWrapper.wire_fields, "file_path": WireField(str, max_len=4096)}

    class Same(CpuFileIPCWrapper):  # the derived fields, spelled out: harmless
        wire_fields = dict(CpuFileIPCWrapper.wire_fields)

    assert Same.wire_fields == CpuFileIPCWrapper.wire_fields and Same._memory() is CpuFileIPCWrapper._memory()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"file_nbytes": WireField(int, lo=0)}, r"reuses \['file_nbytes'\]"),
        ({"shape": WireField(list, max_len=4)}, r"reuses \['shape'\]"),
        ({"vendor_pid": WireField(int, lo=1, hi=99)}, r"must admit the empty value 0"),
        ({"vendor_name": "str"}, "must map field names to WireField declarations"),
        (
            {"handle": WireField(str, max_len=8)},
            r"the wire field\(s\) \['handle'\] would hide the wrapper's own",
        ),
        ({"close": WireField(int, lo=0)}, r"\['close'\] would hide"),
        ({}, "must map field names to WireField declarations"),
    ],
)
def test_a_handle_schema_the_kit_cannot_carry_is_refused(fields: dict[str, object], match: str) -> None:
    """Each refusal happens when the wrapper class is made, saying what to change."""
    odd_store = FileStore()
    odd_store.handle_fields = fields  # type: ignore[assignment]
    with pytest.raises(TypeError, match=match):

        class Odd(HostMemoryIPCWrapper):
            wire_tag = "vendor.odd/1"
            nbytes_field = "file_nbytes"
            store = odd_store


def test_two_stores_never_mistake_each_others_memory(kv_dir: Path) -> None:
    """A tensor in POSIX shared memory, wrapped for ``cpu.file``, moves into a file."""
    from lmcache_platform_cpu import CpuShmIPCWrapper

    t = torch.arange(16, dtype=torch.int32)
    shm = CpuShmIPCWrapper.wrap(t)
    as_file = CpuFileIPCWrapper.wrap(t)
    assert as_file.file_name and torch.equal(t, torch.arange(16, dtype=torch.int32))
    assert os.listdir(kv_dir) == [as_file.file_name]
    shm.close()
    as_file.close()
    del t


def test_find_stale_judges_only_our_files_of_dead_producers(kv_dir: Path) -> None:
    d = _store.directory()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    stale = _store.NAMES.new().replace(f"_{os.getpid()}_", f"_{dead}_")
    (kv_dir / stale).write_bytes(b"")
    (kv_dir / stale).chmod(0o600)
    (kv_dir / "unrelated").write_bytes(b"")
    handle, mm = FileStore().create(4096)
    try:
        assert find_stale(d.fd, _store.NAMES) == [stale]
        assert find_stale(d.path, _store.NAMES) == [stale]
    finally:
        mm.close()
        FileStore().release(handle)
        (kv_dir / stale).unlink()
        (kv_dir / "unrelated").unlink()
    assert producer_alive(os.getpid(), segment_ctime=0.0)
    assert not producer_alive(int(dead), segment_ctime=time.time())


def fake_cgroups(root: Path, limit: int, usage: int, inactive: int) -> str:
    """Mirror this process's real cgroup paths under ``root`` with a memory limit at the leaf."""
    leaf = ""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files, base = ("memory.max", "memory.current", "inactive_file"), root
        elif "memory" in controllers.split(","):
            files, base = (
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
                root / "memory",
            )
        else:
            continue
        here = base / path.lstrip("/")
        here.mkdir(parents=True, exist_ok=True)
        (here / files[0]).write_text(f"{limit}\n")
        (here / files[1]).write_text(f"{usage}\n")
        (here / "memory.stat").write_text(f"cache 1\n{files[2]} {inactive}\n")
        for parent in here.parents:  # unlimited ancestors, as on a host
            if parent == base.parent:
                break
            if not (parent / files[0]).exists():
                (parent / files[0]).write_text(
                    "max\n" if files[0] == "memory.max" else f"{(1 << 63) - 4096}\n"
                )
                (parent / files[1]).write_text(f"{usage}\n")
        leaf = str(here / files[0])
    return leaf


def test_memory_headroom_is_the_tightest_cgroup_limit_less_usage_with_cache_counted_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_headroom, "CGROUP_ROOT", str(tmp_path))
    leaf = fake_cgroups(tmp_path, limit=64 << 20, usage=60 << 20, inactive=8 << 20)
    room = hostmem.memory_headroom()
    assert room is not None and room.free == 12 << 20, room
    assert room.limit.startswith(f"the memory cgroup limit {tmp_path}/") and room.limit.endswith(
        "memory.limit_in_bytes (64.0 MiB, 52.0 MiB in use)"
        if "memory/" in room.limit
        else "memory.max (64.0 MiB, 52.0 MiB in use)"
    ), room.limit
    assert leaf.startswith(str(tmp_path))
    fake_cgroups(tmp_path, limit=1 << 50, usage=0, inactive=0)  # a limit looser than the host's memory
    room = hostmem.memory_headroom()
    assert room is not None and room.limit.startswith("the host's available memory (MemAvailable + SwapFree")


def test_an_nbytes_field_hiding_a_wrapper_attribute_is_refused() -> None:
    """``nbytes`` is the view's byte span on every wrapper: a field of that name would hide it."""
    with pytest.raises(TypeError, match=r"\['nbytes'\] would hide the wrapper's own attribute"):

        class Hiding(CpuFileIPCWrapper):
            nbytes_field = "nbytes"

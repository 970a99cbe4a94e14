"""Exports of pages larger than the system's: huge pages, as a ``cpu.hugetlb`` store makes them.

A memfd or file on hugetlbfs maps whole huge pages only: ``mmap`` there needs addresses,
offsets and lengths that are multiples of them. The kit reads an export's page size from
the export itself (``_remap.page_size``: ``st_blksize``, the huge page size on hugetlbfs)
and aligns what it maps side by side, and what it shares in place, to it. Most hosts
have no huge pages reserved, so the kit's paths are tested here on ordinary memfds with
a larger page size passed in or reported (a multiple of the system's page is a valid
alignment for them too), and on real huge pages where the kernel has some.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest
import torch

from lmcache_platform import DescriptorError, WireField
from lmcache_platform.hostmem import Handle, HostMemoryIPCWrapper, InPlaceStore, SideBySideStore, _remap
from lmcache_platform_cpu import CpuMemfdIPCWrapper, _memfd

MiB = 1 << 20
HUGE = 2 * MiB  # x86-64's and arm64's default huge page


def memfd(nbytes: int, flags: int = 0) -> int:
    fd = os.memfd_create("lmcache_platform_test", os.MFD_CLOEXEC | flags)
    os.ftruncate(fd, nbytes)
    return fd


def hugetlb_memfd() -> int:
    """An empty memfd on huge pages (``MFD_HUGETLB``); skip, saying why, where the kernel makes none."""
    try:
        return os.memfd_create("lmcache_platform_test", os.MFD_CLOEXEC | os.MFD_HUGETLB)
    except (AttributeError, OSError) as exc:
        pytest.skip(f"this kernel makes no MFD_HUGETLB memfds: {exc}")


@pytest.fixture
def region() -> Iterator[tuple[int, int]]:
    """8 MiB of private anonymous memory, as an engine's allocation; yields its 2 MiB-aligned middle 4 MiB."""
    libc = _remap._libc()
    base = libc.mmap(
        None, 8 * MiB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    start = -(-base // HUGE) * HUGE
    ctypes.memmove(start, bytes(range(256)) * (4 * MiB // 256), 4 * MiB)
    yield start, 4 * MiB
    _remap.unmap(base, 8 * MiB)


# -- the page size of an export ------------------------------------------------------------------


def test_an_ordinary_memfd_has_the_systems_pages() -> None:
    fd = memfd(4096)
    try:
        assert _remap.page_size(fd) == mmap.PAGESIZE
    finally:
        os.close(fd)


def test_a_hugetlb_memfd_reports_its_huge_page_size() -> None:
    """No huge page is needed for this: the size is known at creation, before any is reserved."""
    fd = hugetlb_memfd()
    try:
        page = _remap.page_size(fd)
    finally:
        os.close(fd)
    assert page > mmap.PAGESIZE and page % mmap.PAGESIZE == 0 and page & (page - 1) == 0


# -- remapping in place, side by side: on the export's page -------------------------------------


def test_remapping_in_place_goes_a_whole_number_of_pages_at_a_time(
    region: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    start, length = region
    expected = ctypes.string_at(start, length)
    monkeypatch.setattr(_remap, "SLICE", MiB)  # smaller than a page: a slice is one page
    fd = memfd(length)
    calls: list[tuple[int, int]] = []
    try:
        _remap.remap_in_place(start, length, fd, lambda at, n: calls.append((at, n)), page=HUGE)
        assert calls == [(0, HUGE), (HUGE, HUGE)]
        assert ctypes.string_at(start, length) == expected  # every byte moved with its page
        ctypes.memset(start + 5, 0x7F, 1)  # the allocation's pages are now the export's
        assert os.pread(fd, 1, 5) == b"\x7f"
    finally:
        os.close(fd)


def test_remapping_refuses_a_range_that_is_not_whole_pages_and_moves_nothing(region: tuple[int, int]) -> None:
    start, length = region
    expected = ctypes.string_at(start, length)
    fd = memfd(length)
    calls: list[tuple[int, int]] = []
    try:
        with pytest.raises(ValueError, match=f"the export's pages are {HUGE} bytes"):
            _remap.remap_in_place(
                start + mmap.PAGESIZE, length - HUGE, fd, lambda *a: calls.append(a), page=HUGE
            )
        assert calls == [] and ctypes.string_at(start, length) == expected
        ctypes.memset(start + 5, 0x7F, 1)  # still the allocation's own pages, not the export's
        assert os.pread(fd, 1, 5) == b"\x00"
    finally:
        os.close(fd)


def test_side_by_side_places_start_on_each_exports_own_pages() -> None:
    sizes, pages = [10_000, 3 * 4096, 5_000], [HUGE, 4096, HUGE]
    fds = [memfd(n) for n in sizes]
    try:
        for i, (fd, n) in enumerate(zip(fds, sizes, strict=True)):
            os.pwrite(fd, bytes([i + 1]) * n, 0)
        address, length, offsets = _remap.map_side_by_side(fds, sizes, pages)
        try:
            assert address % HUGE == 0 and offsets == [0, HUGE, 2 * HUGE] and length == 3 * HUGE
            for i, (n, offset) in enumerate(zip(sizes, offsets, strict=True)):
                assert ctypes.string_at(address + offset, n) == bytes([i + 1]) * n
        finally:
            _remap.unmap(address, length)
    finally:
        for fd in fds:
            os.close(fd)


# -- the kit, over a store whose exports report larger pages -------------------------------------


@pytest.fixture
def large_pages(monkeypatch: pytest.MonkeyPatch) -> int:
    """Every export reports 2 MiB pages, as a hugetlb store's do (its memory is ordinary here)."""
    monkeypatch.setattr(_remap, "page_size", lambda fd: HUGE)
    return HUGE


def test_separate_exports_reopen_at_steps_of_whole_large_pages(large_pages: int) -> None:
    layers = [torch.full((16 * 1024,), float(i)) for i in range(3)]  # 64 KiB each
    wrappers = [CpuMemfdIPCWrapper.wrap(t) for t in layers]
    server = [CpuMemfdIPCWrapper.from_fields(w.fields()) for w in wrappers]
    try:
        tensors = CpuMemfdIPCWrapper.to_tensors(server)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        assert tensors[0].untyped_storage().data_ptr() % large_pages == 0
        assert [t.storage_offset() * 4 for t in tensors] == [0, large_pages, 2 * large_pages]
        layers[1][7] = -1.0
        assert torch.equal(tensors[1], layers[1]) and torch.equal(tensors[2], layers[2])
        del tensors
    finally:
        for w in [*server, *wrappers]:
            w.close()


def test_an_allocation_that_does_not_fit_the_pages_is_copied_and_nothing_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_remap, "page_size", lambda fd: 1 << 30)  # no 40 MiB allocation is whole 1 GiB pages
    attempts: list[int] = []
    create_in_place = _memfd.MemfdStore.create_in_place

    def counted(self: _memfd.MemfdStore, nbytes: int) -> tuple[Handle, int]:
        attempts.append(nbytes)
        return create_in_place(self, nbytes)

    monkeypatch.setattr(_memfd.MemfdStore, "create_in_place", counted)
    flat = torch.arange(10 * MiB, dtype=torch.int32)  # 40 MiB: glibc gives it pages of its own
    assert _remap.exclusive_pages(flat.untyped_storage()) is not None
    address, expected, exports = flat.data_ptr(), flat.clone(), _memfd.owned()
    wrapper = CpuMemfdIPCWrapper.wrap(flat)
    try:
        assert len(attempts) == 1  # it tried in place, found the pages too large...
        assert flat.data_ptr() != address and torch.equal(flat, expected)  # ...and copied
        assert len(_memfd.owned() - exports) == 1  # the in-place attempt's memfd was released
        assert torch.equal(CpuMemfdIPCWrapper.from_fields(wrapper.fields()).to_tensor(), expected)
    finally:
        wrapper.close()


# -- real huge pages, where the kernel has some --------------------------------------------------


def huge_page_size() -> int:
    """The huge page size, once a huge page could be mapped; else skip, saying why."""
    fd = hugetlb_memfd()
    try:
        page = os.fstat(fd).st_blksize
        os.ftruncate(fd, page)
        mmap.mmap(fd, page).close()
    except OSError as exc:
        pytest.skip(
            f"no huge page to map ({exc.strerror}): HugePages_Total in /proc/meminfo is 0 here; "
            "reserve some with `sysctl vm.nr_hugepages=64`"
        )
    finally:
        os.close(fd)
    return page


class HugeMemfdStore:
    """A minimal ``cpu.hugetlb`` store: memfds on huge pages, sizes rounded up to a page."""

    handle_fields: ClassVar[Mapping[str, WireField]] = {
        "huge_pid": WireField(int, lo=0, hi=1 << 22),
        "huge_fd": WireField(int, lo=0, hi=(1 << 31) - 1),
        "huge_ino": WireField(int, lo=0, hi=(1 << 64) - 1),
    }

    def __init__(self) -> None:
        self.owned: dict[int, int] = {}

    @staticmethod
    def rounded(fd: int, nbytes: int) -> int:
        page = os.fstat(fd).st_blksize
        return -(-nbytes // page) * page

    def check_handle(self, handle: Handle) -> None:
        if handle["huge_pid"] == 0:
            raise DescriptorError("huge_pid 0 names no process")

    def check_capacity(self, nbytes: int) -> None:
        """Huge pages are reserved up front by the operator: the kernel refuses what does not fit."""

    def create_in_place(self, nbytes: int) -> tuple[Handle, int]:
        fd = os.memfd_create("lmcache_platform_huge", os.MFD_CLOEXEC | os.MFD_HUGETLB)
        os.ftruncate(fd, self.rounded(fd, nbytes))
        ino = self.owned[fd] = os.fstat(fd).st_ino
        return {"huge_pid": os.getpid(), "huge_fd": fd, "huge_ino": ino}, os.dup(fd)

    def reserve(self, fd: int, offset: int, nbytes: int) -> None:
        os.posix_fallocate(fd, offset, nbytes)

    def create(self, nbytes: int) -> tuple[Handle, mmap.mmap]:
        handle, fd = self.create_in_place(nbytes)
        try:
            return handle, mmap.mmap(fd, self.rounded(fd, nbytes))
        except BaseException:
            self.release(handle)
            raise
        finally:
            os.close(fd)

    def open_fd(self, handle: Handle, nbytes: int) -> int:
        fd = os.open(f"/proc/{handle['huge_pid']}/fd/{handle['huge_fd']}", os.O_RDWR | os.O_CLOEXEC)
        st = os.fstat(fd)
        if st.st_ino != handle["huge_ino"] or st.st_size != self.rounded(fd, nbytes):
            os.close(fd)
            raise DescriptorError(f"{dict(handle)} is not the memory the descriptor names")
        return fd

    def open_existing(self, handle: Handle, nbytes: int) -> mmap.mmap:
        fd = self.open_fd(handle, nbytes)
        try:
            return mmap.mmap(fd, self.rounded(fd, nbytes))
        finally:
            os.close(fd)

    def release(self, handle: Handle) -> bool:
        if handle["huge_pid"] != os.getpid() or self.owned.get(handle["huge_fd"]) != handle["huge_ino"]:
            return False
        del self.owned[handle["huge_fd"]]
        os.close(handle["huge_fd"])
        return True


class HugeIPCWrapper(HostMemoryIPCWrapper):
    wire_tag: ClassVar[str] = "test.hugetlb/1"
    store = HugeMemfdStore()


def test_the_huge_page_store_has_both_optional_abilities() -> None:
    store: Any = HugeIPCWrapper.store
    assert isinstance(store, InPlaceStore) and isinstance(store, SideBySideStore)


def test_exports_on_real_huge_pages_migrate_reopen_and_stack() -> None:
    page = huge_page_size()
    layers = [torch.full((16 * 1024,), float(i)) for i in range(3)]  # 64 KiB each: one huge page
    big = torch.arange(10 * MiB, dtype=torch.int32)  # 40 MiB: in place if its bounds fit, else copied
    expected = big.clone()
    wrappers = [HugeIPCWrapper.wrap(t) for t in [*layers, big]]
    server = [HugeIPCWrapper.from_fields(w.fields()) for w in wrappers]
    try:
        assert torch.equal(big, expected)
        tensors = HugeIPCWrapper.to_tensors(server)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        assert tensors[0].untyped_storage().data_ptr() % page == 0
        assert [t.storage_offset() * 4 for t in tensors[:3]] == [0, page, 2 * page]
        assert all(torch.equal(t, e) for t, e in zip(tensors, [*layers, expected], strict=True))
        big[-1] = -1
        assert tensors[3][-1].item() == -1  # the engine's writes reach the server
        del tensors
    finally:
        for w in [*server, *wrappers]:
            w.close()

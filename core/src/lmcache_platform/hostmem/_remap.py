"""Making an engine's existing CPU allocation shareable where it lies: pages replaced in place.

Copying a KV cache into fresh shared memory needs a second copy of it for the
time of the copy, and leaves every tensor the engine derived from the old memory
(its flat buffer, views it cut itself) pointing at private pages the server never
sees. Instead, for an allocation that owns its pages outright, the shared memory
(a store's file descriptor) is mapped over the allocation's own addresses, a slice
at a time: copy the slice into the file, map the file's slice there with
``MAP_FIXED``, which frees the private pages it replaces. Virtual addresses do not
change, so every tensor and view keeps working and sees the shared bytes; peak
memory grows by one slice.

Which allocations own their pages: torch's CPU allocator takes large blocks from
glibc ``malloc``, which serves them with a private ``mmap`` of their own (above its
mmap threshold, 128 KiB to 32 MiB). Such a block's first page holds glibc's 16-byte
chunk header (the user pointer is 64 bytes in), so the whole page range belongs to
the block, and the header moves with it: ``free`` later reads it from the shared
page and unmaps the range. :func:`exclusive_pages` accepts a storage only when all
of this is shown: a resizable storage (torch's allocator, not ``frombuffer``,
``from_blob`` or numpy), a pointer inside its first page, a header marked
mmapped and consistent with page-aligned bounds that cover the storage with little
slack, and pages that ``/proc/self/maps`` lists as anonymous private memory.
Anything else (small blocks in the malloc heap, whose pages other data share;
another libc; pinned memory) returns None, and the caller copies instead.

Linux only. Writes to the allocation by another thread during the remap would be
lost, so engines wrap before they run (vLLM registers its KV caches at start-up).

**Page sizes.** The engine's allocation is made of the system's pages (``PAGE``), but
an export may be made of larger ones: a memfd or file on hugetlbfs maps whole huge
pages (2 MiB, 1 GiB), and ``mmap`` there needs addresses, offsets and lengths that
are multiples of them. :func:`page_size` reads an export's page size from its file
descriptor; :func:`remap_in_place` and :func:`map_side_by_side` place every mapping on
a multiple of it, and remapping in place refuses an allocation whose bounds are not.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._libc import _libc as _libc  # the C library's memory calls, typed once

if TYPE_CHECKING:
    import torch

#: The system's page: what the engine's allocations are made of.
PAGE = mmap.PAGESIZE
#: Bytes copied and remapped per step (rounded up to a whole number of the export's
#: pages): the most by which wrapping raises peak memory.
SLICE = 32 << 20
#: Smaller storages are copied: one slice costs more than they do.
MIN_NBYTES = 1 << 20
_IS_MMAPPED, _FLAGS = 0x2, 0x7


def exclusive_pages(storage: torch.UntypedStorage) -> tuple[int, int] | None:
    """``(address, length)`` of the whole pages that hold ``storage`` and nothing else, or None."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes < MIN_NBYTES or not storage.resizable() or ptr % PAGE < 16 or ptr % 16:
        return None  # a page-aligned pointer has no header in its page: not a malloc block
    size_field = ctypes.c_size_t.from_address(ptr - 8).value  # same page as ptr: readable
    prev_size = ctypes.c_size_t.from_address(ptr - 16).value
    if size_field & _FLAGS != _IS_MMAPPED:
        return None
    base, length = ptr - 16 - prev_size, prev_size + (size_field & ~_FLAGS)
    if base % PAGE or length % PAGE or not base < ptr or ptr + nbytes > base + length:
        return None
    if length - nbytes > prev_size + 2 * PAGE or not _anonymous_private(base, length):
        return None
    return base, length


def page_size(fd: int) -> int:
    """The page size of the export open as ``fd``: what its mappings must be aligned to.

    The least common multiple of the system's page and the file's preferred I/O block
    (``st_blksize``): the system's page for tmpfs, memfds and most file systems, the
    huge page size on hugetlbfs (a ``MFD_HUGETLB`` memfd, a file on a hugetlbfs mount).
    """
    return math.lcm(PAGE, max(1, os.fstat(fd).st_blksize))


def _anonymous_private(start: int, length: int) -> bool:
    """Whether ``/proc/self/maps`` shows ``[start, start + length)`` as anonymous private rw memory."""
    end, covered = start + length, start
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if hi <= covered or lo > covered:
                    continue
                if fields[1] != "rw-p" or fields[4] != "0" or len(fields) > 5:
                    return False  # file-backed, shared, or a named region ([heap], [stack])
                covered = hi
                if covered >= end:
                    return True
    except OSError:
        return False
    return False


class RemapError(OSError):
    """A slice could not be reserved or mapped; the slices before it are already shared.

    The allocation stays valid and keeps its contents either way (shared and private
    pages hold the same bytes), so the caller only gives up the export.
    """


def fits_pages(address: int, length: int, page: int) -> bool:
    """Whether ``[address, address + length)`` is whole pages of ``page`` bytes."""
    return address % page == 0 and length % page == 0


def remap_in_place(
    address: int, length: int, fd: int, reserve: Callable[[int, int], None], *, page: int
) -> None:
    """Move the pages ``[address, address + length)`` into the file ``fd``, keeping the address.

    ``reserve(offset, length)`` reserves a slice of the file first (``posix_fallocate``),
    raising the store's capacity error when it is full; the file must be at least
    ``length`` bytes long. ``page`` is the file's page size (:func:`page_size`): the
    range must be whole pages of it (``ValueError`` otherwise, before anything moves),
    and every slice is. A slice at a time: reserve, copy through a second mapping of
    the file, map the file over the slice (``MAP_FIXED``), drop the second mapping's pages.
    """
    if not fits_pages(address, length, page):
        raise ValueError(
            f"cannot remap {length} bytes at {address:#x} in place: the export's pages are "
            f"{page} bytes, and the range is not whole pages of it"
        )
    step = -(-SLICE // page) * page
    libc = _libc()
    window = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        anchor = ctypes.c_char.from_buffer(window)
        window_address = ctypes.addressof(anchor)
        try:
            for offset in range(0, length, step):
                n = min(step, length - offset)
                reserve(offset, n)
                ctypes.memmove(window_address + offset, address + offset, n)
                got = libc.mmap(
                    address + offset,
                    n,
                    mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_SHARED | _MAP_FIXED,
                    fd,
                    offset,
                )
                if got != address + offset:
                    err = ctypes.get_errno()
                    raise RemapError(
                        err, f"mmap(MAP_FIXED) of {n} bytes at offset {offset}: {os.strerror(err)}"
                    )
                window.madvise(mmap.MADV_DONTNEED, offset, n)  # counted once: where the engine maps it
        finally:
            del anchor
    finally:
        window.close()


def map_side_by_side(
    fds: Sequence[int], sizes: Sequence[int], pages: Sequence[int] | None = None
) -> tuple[int, int, list[int]]:
    """Map the files ``fds`` (``sizes`` bytes each) read-write side by side in one new address range.

    ``pages`` are the files' page sizes (:func:`page_size` of each, by default). Each
    file starts on a boundary of its own pages, right after the previous one's last
    page, so equal sizes of equal pages sit at equal steps. The range is reserved
    first (no access, no memory; aligned to the largest page) and each file mapped
    over its place with ``MAP_FIXED``, so nothing else can land in between. Returns
    ``(address, length, offsets)``; release the range with :func:`unmap`. On failure
    nothing stays mapped; the caller keeps the fds.
    """
    pages = [page_size(fd) for fd in fds] if pages is None else list(pages)
    offsets, length = [], 0
    for n, page in zip(sizes, pages, strict=True):
        length = -(-length // page) * page
        offsets.append(length)
        length += -(-n // page) * page
    address = _reserve_aligned(length, max(pages, default=PAGE))
    libc = _libc()
    try:
        for fd, n, offset in zip(fds, sizes, offsets, strict=True):
            got = libc.mmap(
                address + offset, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0
            )
            if got != address + offset:
                err = ctypes.get_errno()
                raise RemapError(err, f"mmap(MAP_FIXED) of {n} bytes at offset {offset}: {os.strerror(err)}")
    except BaseException:
        unmap(address, length)
        raise
    return address, length, offsets


def _reserve_aligned(length: int, align: int) -> int:
    """Reserve ``length`` bytes of address space (no access, no memory) at a multiple of ``align``."""
    slack = align - PAGE if align > PAGE else 0
    address: int | None = _libc().mmap(
        None, length + slack, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )  # not writable: no memory is committed for it
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise RemapError(err, f"reserving {length + slack} bytes of address space: {os.strerror(err)}")
    start = -(-address // align) * align
    if start > address:  # give back the slack on either side
        unmap(address, start - address)
    if address + slack > start:
        unmap(start + length, address + slack - start)
    return start


def unmap(address: int, length: int) -> None:
    """Unmap ``[address, address + length)``, as :func:`map_side_by_side` made it."""
    if _libc().munmap(address, length):
        err = ctypes.get_errno()
        raise RemapError(err, f"munmap of {length} bytes at {address:#x}: {os.strerror(err)}")


_MAP_FIXED = 0x10  # Linux, every architecture
_PROT_NONE = 0
_MAP_FAILED = ctypes.c_void_p(-1).value

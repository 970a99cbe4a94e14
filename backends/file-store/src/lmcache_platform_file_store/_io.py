"""Reading a file's bytes into the caller's buffers: from the page cache, or past it with ``O_DIRECT``.

A buffered read of a file the page cache does not hold waits for the kernel's readahead
and then copies every byte out of the cache; an ``O_DIRECT`` read has the disk write the
bytes straight into the caller's memory (on this project's test VM, 8 MiB entries came
back cold about twice as fast). ``O_DIRECT`` wants the memory, the file offset and the
length aligned to the disk's block: :func:`read_into` reads each buffer's aligned middle
straight into it when the buffer's address and its file offset agree modulo
:data:`BLOCK` (the file store lays entries out so that the chunk's tensors do), and the
rest (headers, padding, unaligned edges) through a small aligned bounce buffer.

:data:`CACHE_FIRST` asks the kernel how much of the range the page cache holds
(``cachestat``, Linux 6.5): all of it is read through the cache (an entry written or
read a moment ago, at memory speed), anything less past it, unless the caller's memory
is not aligned so that most of it can be read in place (then a bounce buffer and a copy
would cost what the page cache costs, without its readahead). Not ``RWF_NOWAIT``: a
``preadv`` that finds a page missing starts the kernel's readahead before it gives up, so
the bytes would come from the disk twice. Where ``cachestat`` is missing, reads are buffered.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from typing import Final

#: ``O_DIRECT``'s alignment of memory, file offsets and lengths: a page, a multiple of
#: every common logical block size.
BLOCK: Final = mmap.PAGESIZE if mmap.PAGESIZE >= 4096 else 4096
O_DIRECT: Final = getattr(os, "O_DIRECT", 0)
_NR_CACHESTAT = 451  # the same number on every architecture Linux added it for (6.5)
_IOV_MAX = 1024  # buffers per preadv (Linux's IOV_MAX)

#: Read modes: through the page cache; straight from the disk; the page cache first.
BUFFERED, DIRECT, CACHE_FIRST = "buffered", "direct", "cache-first"


class Unsupported(OSError):
    """The file system (or the kernel) refuses ``O_DIRECT`` or ``cachestat``: read buffered."""


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]


_LIBC = ctypes.CDLL(None, use_errno=True)


def cached(fd: int, offset: int, length: int) -> bool:
    """Whether the page cache holds every page of ``[offset, offset + length)`` of ``fd``.
    Raises :class:`Unsupported` where the kernel lacks ``cachestat``."""
    if length <= 0:
        return True
    first = offset // mmap.PAGESIZE
    pages = -(-(offset + length) // mmap.PAGESIZE) - first
    span, stat = _Range(first * mmap.PAGESIZE, pages * mmap.PAGESIZE), _Stat()
    nr, fd_, flags = ctypes.c_long(_NR_CACHESTAT), ctypes.c_long(fd), ctypes.c_long(0)  # syscall's longs
    if _LIBC.syscall(nr, fd_, ctypes.byref(span), ctypes.byref(stat), flags) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise Unsupported(err, f"cachestat: {os.strerror(err)}")
        raise OSError(err, f"cachestat: {os.strerror(err)}")
    return int(stat.cache) >= pages


def address(view: memoryview) -> int:
    """The address of a writable byte view's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


def read_into(fd: int, pieces: Sequence[memoryview], offset: int, size: int, mode: str) -> int:
    """Fill ``pieces`` (byte views, contiguous in the file from ``offset``) from ``fd`` (a file of
    ``size`` bytes); the bytes read, short only where the file ends first. Raises
    :class:`Unsupported` when ``mode`` needs what the file system does not take."""
    want = min(sum(len(p) for p in pieces), max(size - offset, 0))
    if mode == BUFFERED:
        return _buffered(fd, pieces, offset, want)
    straight, gaps = _plan(pieces, offset, want)
    if (
        mode == CACHE_FIRST
        # memory O_DIRECT cannot fill in place would need a bounce and a copy: the page cache's
        and (2 * sum(len(v) for _, v in straight) < want or cached(fd, offset, want))
    ):
        return _buffered(fd, pieces, offset, want)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:  # the same open file (not a second open: the entry may be replaced meanwhile)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise Unsupported(exc.errno, f"O_DIRECT: {exc.strerror}") from None
        raise
    try:
        return _direct(fd, straight, gaps, want)
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # the caller's next read may be buffered


def _buffered(fd: int, pieces: Sequence[memoryview], offset: int, want: int) -> int:
    """``preadv`` until ``want`` bytes or the file's end."""
    left = [p for p in pieces if len(p)]
    done = 0
    while left and done < want:
        n = os.preadv(fd, left[:_IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        left = _skip(left, n)
    return done


def _skip(pieces: Sequence[memoryview], n: int) -> list[memoryview]:
    """``pieces`` without their first ``n`` bytes."""
    out = [p for p in pieces if len(p)]
    while out and n >= len(out[0]):
        n -= len(out.pop(0))
    if out and n:
        out[0] = out[0][n:]
    return out


_Views = list[tuple[int, memoryview]]  # (file offset, view)


def _plan(pieces: Sequence[memoryview], offset: int, want: int) -> tuple[_Views, _Views]:
    """The first ``want`` bytes of ``pieces`` (from file ``offset``) as ``(file offset, view)``:
    what ``O_DIRECT`` reads straight in (each piece's aligned middle, where its address and
    its file offset agree modulo :data:`BLOCK`), and the gaps (everything else)."""
    straight: _Views = []
    gaps: _Views = []  # read through the bounce buffer
    at = offset
    for p in pieces:
        if at >= offset + want:
            break
        p = p[: offset + want - at]
        lo, hi = -(-at // BLOCK) * BLOCK, (at + len(p)) // BLOCK * BLOCK
        if hi > lo and (address(p) - at) % BLOCK == 0:
            if lo > at:
                gaps.append((at, p[: lo - at]))
            straight.append((lo, p[lo - at : hi - at]))
            if at + len(p) > hi:
                gaps.append((hi, p[hi - at :]))
        else:
            gaps.append((at, p))
        at += len(p)
    return straight, gaps


def _direct(
    fd: int, straight: list[tuple[int, memoryview]], gaps: list[tuple[int, memoryview]], want: int
) -> int:
    """:func:`read_into` past the page cache (``fd`` has ``O_DIRECT``): :func:`_plan`'s straight
    views read in place, its gaps through a bounce buffer; at most ``want`` bytes."""
    got = 0
    for start, view in straight:
        got += _pread_full(fd, view, start)
    for group in _grouped(gaps):
        got += _through_bounce(fd, group)
    return min(got, want)


def _grouped(gaps: list[tuple[int, memoryview]]) -> list[list[tuple[int, memoryview]]]:
    """Gaps whose blocks touch, together: one bounce read each group (a header and its padding)."""
    out: list[list[tuple[int, memoryview]]] = []
    for start, view in gaps:
        if out and start // BLOCK * BLOCK <= _end_block(out[-1][-1]):
            out[-1].append((start, view))
        else:
            out.append([(start, view)])
    return out


def _end_block(gap: tuple[int, memoryview]) -> int:
    return -(-(gap[0] + len(gap[1])) // BLOCK) * BLOCK


def _through_bounce(fd: int, group: list[tuple[int, memoryview]]) -> int:
    """Read the blocks under ``group`` into aligned memory, then copy each gap out of it."""
    lo = group[0][0] // BLOCK * BLOCK
    hi = max(_end_block(g) for g in group)
    with mmap.mmap(-1, hi - lo) as bounce:
        view = memoryview(bounce)
        try:
            n = _pread_full(fd, view, lo)
            got = 0
            for start, dest in group:
                k = max(min(len(dest), lo + n - start), 0)
                dest[:k] = view[start - lo : start - lo + k]
                got += k
            return got
        finally:
            view.release()


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """``preadv`` into ``view`` until it is full or the file ends."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL and done == 0:
                raise Unsupported(exc.errno, f"O_DIRECT: {exc.strerror}") from None
            raise
        if n == 0:
            break
        done += n
        if done % BLOCK:
            break  # a direct read ends short only at the end of the file
    return done

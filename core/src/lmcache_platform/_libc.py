"""The C library's memory calls (``mmap``, ``munmap``, ``madvise``), typed once, and
:func:`populate`: a range of shared memory mapped into this process's page tables ahead of use.

On the ground floor: host memory of the cache contexts (``_kv``) and of the host-memory
kit (``hostmem``) both use them.

A server reopens an engine's KV cache as a fresh mapping: every page of it is first
touched inside a transfer, and each 4 KiB page costs a page fault there. For a cache of
128-token blocks a load of 8 chunks touches 2 random blocks per layer and head each, so
a server that has not yet touched those blocks runs the load at a third of the speed it
reaches once they are mapped (``docs/performance.md``). ``madvise(MADV_POPULATE_WRITE)``
(Linux 5.14) maps the pages writable in one call without changing a byte, at about a
quarter of a second per GiB on the development VM.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable

#: ``MADV_POPULATE_WRITE`` from ``<linux/mman.h>`` (every architecture).
MADV_POPULATE_WRITE = 23
#: Bytes per ``madvise`` call: how long a closing context waits for one (a few ms).
STEP_BYTES = 16 << 20


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    """The C library, its memory calls typed (loaded once; a test may stand in for it here)."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC


class PopulateUnsupported(OSError):
    """This kernel lacks ``MADV_POPULATE_WRITE`` (before Linux 5.14): pages fault in on use."""


def populate(address: int, nbytes: int, *, lock: threading.Lock, stopped: Callable[[], bool]) -> int:
    """Populate ``[address, address + nbytes)`` writable, one :data:`STEP_BYTES` piece at a time.

    Each piece runs under ``lock`` once ``stopped()`` said False there: the owner of the
    memory sets what ``stopped`` reads, then takes ``lock`` before unmapping, so no piece
    touches memory that is going away. Returns the bytes populated. Raises
    :class:`PopulateUnsupported`, or :class:`OSError` with the kernel's errno.
    """
    libc = _libc()
    start = address - address % mmap.PAGESIZE
    end = address + nbytes
    done = start
    while done < end:
        length = min(STEP_BYTES, end - done)
        with lock:
            if stopped():
                break
            if libc.madvise(done, length, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                why = f"madvise(MADV_POPULATE_WRITE) of {length} bytes at {done:#x}: {os.strerror(err)}"
                raise (PopulateUnsupported if err == errno.EINVAL else OSError)(err, why)
        done += length
    return done - start

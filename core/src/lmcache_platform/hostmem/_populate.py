"""Map a range of shared memory into this process's page tables ahead of use.

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

from ._remap import _libc as _libc  # re-bound here so a test can stand in for madvise

#: ``MADV_POPULATE_WRITE`` from ``<linux/mman.h>`` (every architecture).
MADV_POPULATE_WRITE = 23
#: Bytes per ``madvise`` call: how long a closing context waits for one (a few ms).
STEP_BYTES = 16 << 20


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

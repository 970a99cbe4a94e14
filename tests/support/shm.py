"""The one ``/dev/shm`` leak guard, shared by the CPU-backend and the reliability tests.

A session fixture wraps its yield in :func:`no_segment_left`: afterwards no segment of
this project made by this process or by a child it started (``pids``) may remain in
``/dev/shm``. Leftovers are removed first, so the machine stays clean, then reported as
a failure naming them.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lmcache_platform import DescriptorError
from lmcache_platform_cpu import _shm


def segments_of(pids: set[int]) -> list[str]:
    """Names in /dev/shm of our segments made by ``pids`` in this pid namespace."""
    found = []
    for name in sorted(os.listdir(_shm.SHM_DIR)):
        try:
            pidns, pid = _shm.parse_name(name)
        except DescriptorError:
            continue
        if pidns == _shm.pid_namespace() and pid in pids:
            found.append(name)
    return found


@contextmanager
def no_segment_left(what: str, pids: set[int]) -> Iterator[None]:
    """Fail if ``what`` (say, "the CPU tests") left segments of this process or ``pids``."""
    yield
    gc.collect()
    leaked = segments_of({os.getpid(), *pids})
    for name in leaked:  # leave the machine clean, then fail loudly
        _shm.unlink_any(name)
    if leaked:
        pytest.fail(f"segments left in {_shm.SHM_DIR} after {what}: {leaked}")

"""Guards of the reliability tests: nothing of ours may be left in /dev/shm.

Per session, no segment made by this process or by a child it started (pids
recorded through ``rel_child_pids``) may remain; leftovers are removed, then
reported as a failure.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
from rel_helpers import SHM_DIR, segments_of


@pytest.fixture(scope="session")
def rel_child_pids() -> set[int]:
    """Pids of processes the tests start; their segments count for the session check."""
    return set()


@pytest.fixture(scope="session", autouse=True)
def rel_no_segment_left(rel_child_pids: set[int]) -> Iterator[None]:
    yield
    gc.collect()
    leaked = segments_of({os.getpid(), *rel_child_pids})
    for name in leaked:  # leave the machine clean, then fail loudly
        os.unlink(os.path.join(SHM_DIR, name))
    if leaked:
        pytest.fail(f"segments left in {SHM_DIR} after the reliability tests: {leaked}")

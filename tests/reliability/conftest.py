"""Guards of the reliability tests: nothing of ours may be left in /dev/shm.

Per session, no segment made by this process or by a child it started (pids
recorded through ``rel_child_pids``) may remain; leftovers are removed, then
reported as a failure.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.shm import no_segment_left


@pytest.fixture(scope="session")
def rel_child_pids() -> set[int]:
    """Pids of processes the tests start; their segments count for the session check."""
    return set()


@pytest.fixture(scope="session", autouse=True)
def rel_no_segment_left(rel_child_pids: set[int]) -> Iterator[None]:
    with no_segment_left("the reliability tests", rel_child_pids):
        yield

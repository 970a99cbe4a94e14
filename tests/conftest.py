"""What every suite shares: no shared-memory segment of ours outlives the session.

Per session (each xdist worker is one), no segment made by this process or by a child
it started (tests record such pids in ``child_pids``) may remain in /dev/shm; leftovers
are removed, then reported as a failure. The CPU tests add a per-test check of their
own (``tests/cpu/conftest.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from support.shm import no_segment_left

# ``serve`` prepares all of its --max-host-bytes (8 GiB by default) from its start. The
# suite starts dozens of servers, two at a time, on a machine engines share: they keep
# 256 MiB ready instead (``ahead``). The default itself is tested with the variable unset
# (``tests/server/test_serve_cli.py``).
os.environ.setdefault("LMCACHE_PLATFORM_HOST_MEMORY", "ahead")


@pytest.fixture(scope="session")
def child_pids() -> set[int]:
    """Pids of processes the tests start; their segments count for the session check."""
    return set()


@pytest.fixture(scope="session", autouse=True)
def no_segment_left_in_dev_shm(child_pids: set[int]) -> Iterator[None]:
    with no_segment_left("the tests", child_pids):
        yield

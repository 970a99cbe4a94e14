"""Guards of the reliability tests: nothing of ours may be left in /dev/shm.

Per session, no segment made by this process or by a child it started (pids
recorded through ``rel_child_pids``) may remain; leftovers are removed, then
reported as a failure.

Each module exports with the CPU IPC kind it names in ``CPU_IPC_KIND`` (default
``shm``: the matrix's cases 1 to 9 were written for named segments; the memfd cases
are modules of their own), through ``LMCACHE_PLATFORM_CPU_IPC``, which the processes
a test starts inherit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import lmcache_platform as lp
from support.shm import no_segment_left


@pytest.fixture(scope="session")
def rel_child_pids() -> set[int]:
    """Pids of processes the tests start; their segments count for the session check."""
    return set()


@pytest.fixture(scope="session", autouse=True)
def rel_no_segment_left(rel_child_pids: set[int]) -> Iterator[None]:
    with no_segment_left("the reliability tests", rel_child_pids):
        yield


@pytest.fixture(scope="module", autouse=True)
def rel_cpu_ipc_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Select the module's CPU IPC kind before any other fixture of the module runs."""
    kind = getattr(request.module, "CPU_IPC_KIND", "shm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMCACHE_PLATFORM_CPU_IPC", kind)
        lp.refresh()
        yield kind
    lp.refresh()

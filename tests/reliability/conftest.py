"""The reliability tests' CPU IPC kind (their /dev/shm guard is ``tests/conftest.py``'s).

Each module exports with the CPU IPC kind it names in ``CPU_IPC_KIND`` (default
``shm``: the matrix's cases 1 to 9 were written for named segments; the memfd cases
are modules of their own), through ``LMCACHE_PLATFORM_CPU_IPC``, which the processes
a test starts inherit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import lmcache_platform as lp


@pytest.fixture(scope="module", autouse=True)
def rel_cpu_ipc_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Select the module's CPU IPC kind before any other fixture of the module runs."""
    kind = getattr(request.module, "CPU_IPC_KIND", "shm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMCACHE_PLATFORM_CPU_IPC", kind)
        lp.refresh()
        yield kind
    lp.refresh()

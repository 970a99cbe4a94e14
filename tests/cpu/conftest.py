"""Fixtures of the CPU-backend tests, and the leak checks that guard every one of them.

Per test: every segment this process created is unlinked, and every memfd it exported
closed, once the test's objects are collected. Per session: no segment made by this process or by a child it spawned
(their pids are recorded through ``child_pids``) is left in /dev/shm.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import lmcache_platform as lp
from lmcache_platform_cpu import _memfd, _shm
from support.shm import no_segment_left


@pytest.fixture(params=["memfd", "shm"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each export kind in turn, selected as an operator would (``LMCACHE_PLATFORM_CPU_IPC``)."""
    monkeypatch.setenv("LMCACHE_PLATFORM_CPU_IPC", request.param)
    lp.refresh()
    yield request.param
    monkeypatch.delenv("LMCACHE_PLATFORM_CPU_IPC")
    lp.refresh()


@pytest.fixture(scope="session")
def child_pids() -> set[int]:
    """Pids of processes the tests start; their segments count for the session check."""
    return set()


@pytest.fixture(scope="session", autouse=True)
def no_segment_left_in_dev_shm(child_pids: set[int]) -> Iterator[None]:
    with no_segment_left("the CPU tests", child_pids):
        yield


@pytest.fixture(autouse=True)
def no_segment_left_by_test() -> Iterator[None]:
    """Every segment and every memfd export this process made in the test is released."""
    before, memfds = _shm.owned(), _memfd.owned()
    yield
    if _shm.owned() - before or _memfd.owned() - memfds:
        gc.collect()  # only when needed: a full collection costs ~0.2 s with torch loaded
    leaked = _shm.owned() - before
    assert not leaked, f"the test left segments it created: {sorted(leaked)}"
    kept = _memfd.owned() - memfds
    assert not kept, f"the test left memfd exports open (fds {sorted(kept)})"

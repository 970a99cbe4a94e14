"""Fixtures of the CPU-backend tests, and the leak check that guards every one of them.

Per test: every segment this process created is unlinked, and every memfd it exported
closed, once the test's objects are collected (the session check is ``tests/conftest.py``'s).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import lmcache_platform as lp
from lmcache_platform_cpu import _memfd, _shm


@pytest.fixture(params=["memfd", "shm"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each export kind in turn, selected as an operator would (``LMCACHE_PLATFORM_CPU_IPC``)."""
    monkeypatch.setenv("LMCACHE_PLATFORM_CPU_IPC", request.param)
    lp.refresh()
    yield request.param
    monkeypatch.delenv("LMCACHE_PLATFORM_CPU_IPC")
    lp.refresh()


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

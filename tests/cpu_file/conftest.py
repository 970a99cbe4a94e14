"""Fixtures of the ``cpu.file`` tests: a fresh KV directory per test, and a leak check."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_platform_cpu_file import _store


@pytest.fixture
def kv_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``LMCACHE_PLATFORM_CPU_FILE_DIR`` for this test (not created yet); empty afterwards."""
    path = tmp_path / "kv"
    monkeypatch.setenv(_store.ENV_DIR, str(path))
    before = _store.owned()
    yield path
    if _store.owned() - before:
        gc.collect()
    leaked = _store.owned() - before
    assert not leaked, f"the test left KV files it created: {sorted(leaked)}"
    left = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    assert not left, f"files left in the KV directory: {left}"

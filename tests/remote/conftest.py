"""Fixtures of the remote-tier tests: real ``valkey-server`` processes on loopback (``support.valkey``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.valkey import ValkeyCluster, ValkeyNode


@pytest.fixture
def valkey_node(tmp_path: Path) -> Iterator[ValkeyNode]:
    """A fresh, empty server for this test."""
    with ValkeyNode(tmp_path / "valkey") as node:
        yield node


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    """A fresh three-primary cluster for this test (a test may kill its nodes)."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        yield cluster

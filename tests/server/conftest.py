"""The server tests' usual pieces: a tiny engine, and a reference server in this process.

``server`` runs :class:`~lmcache_platform.server.ReferenceServer` on a thread of this
process (clients over its real socket), so a test can hold a transfer inside it at a
known point; its host memory cap is 64 chunks, or the ``param`` of an indirect
parametrization. Modules that need a server process or another engine define their own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.serve import CHUNK_BYTES, InProcess, TinyEngine


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[InProcess]:
    proc = InProcess(getattr(request, "param", 64 * CHUNK_BYTES))
    yield proc
    proc.close()


@pytest.fixture
def engine() -> Iterator[TinyEngine]:
    eng = TinyEngine()
    yield eng
    eng.close()

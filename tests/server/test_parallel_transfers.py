"""Transfers of different contexts run in parallel; a chunk being read is never evicted.

The server runs in this process (:class:`ReferenceServer` on a thread, clients over
its real socket), so a test can hold one context's transfer inside the server, at a
known point, while it drives another context. With one lock for the whole server the
first test would block (and fail on its socket timeout) instead of passing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support.serve import CHUNK_BYTES, InProcess, TinyEngine, namespace

WAIT_S = 60  # a bound for the waits below, never a measured time


@pytest.fixture
def engines() -> Iterator[tuple[TinyEngine, TinyEngine]]:
    a, b = TinyEngine(), TinyEngine()
    yield a, b
    a.close()
    b.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_another_contexts_transfers_proceed_while_one_is_in_flight(
    server: InProcess, engines: tuple[TinyEngine, TinyEngine]
) -> None:
    a, b = engines
    ns = namespace()
    with server.client() as ca, server.client() as cb:
        ctx_a, ctx_b = a.register(ca, ns), b.register(cb, ns)
        a.fill(0, seed=1)
        b.fill(0, seed=2)
        held = server.hold(ctx_a, "read_chunk")
        thread, out = in_thread(lambda: ca.put(ctx_a, [(b"A" * 32, [a.blocks(0)])]))
        assert held.entered.wait(WAIT_S)  # A's put is inside its transfer now
        assert cb.lookup(ns, [b"A" * 32]) == 0  # being written: not visible yet
        # B's whole round trip runs while A's transfer is held
        assert cb.put(ctx_b, [(b"B" * 32, [b.blocks(0)])]).stored == 1
        assert cb.get(ctx_b, [(b"B" * 32, [b.blocks(5)])]).retrieved == 1
        assert b.holds(5, seed=2)
        # a second store of A's key while A copies it: "present", no second copy
        r = cb.put(ctx_b, [(b"A" * 32, [b.blocks(0)])])
        assert (r.stored, r.present) == (0, 1)
        held.release()
        thread.join(WAIT_S)
        assert out and out[0].stored == 1
        assert cb.get(ctx_b, [(b"A" * 32, [b.blocks(6)])]).retrieved == 1
        assert b.holds(6, seed=1)  # A's bytes, not B's


@pytest.mark.parametrize("server", [1 * CHUNK_BYTES], indirect=True)
def test_a_chunk_being_read_is_not_evicted(server: InProcess, engines: tuple[TinyEngine, TinyEngine]) -> None:
    a, b = engines
    ns = namespace()
    with server.client() as ca, server.client() as cb:
        ctx_a, ctx_b = a.register(ca, ns), b.register(cb, ns)
        a.fill(0, seed=11)
        ca.put(ctx_a, [(b"old" * 8, [a.blocks(0)])])  # fills the cap
        held = server.hold(ctx_a, "write_chunk")
        thread, out = in_thread(lambda: ca.get(ctx_a, [(b"old" * 8, [a.blocks(7)])]))
        assert held.entered.wait(WAIT_S)  # A is mid-read of the only chunk
        assert cb.status()["server"]["pinned"] == 1
        r = cb.put(ctx_b, [(b"new" * 8, [b.blocks(0)])])
        assert (r.stored, r.dropped, r.evicted) == (0, 1, 0)  # no room, and none taken from a reader
        held.release()
        thread.join(WAIT_S)
        assert out and out[0].retrieved == 1
        assert a.holds(7, seed=11)
        r = cb.put(ctx_b, [(b"new" * 8, [b.blocks(0)])])  # read done: now it may go
        assert (r.stored, r.evicted) == (1, 1)
        assert cb.lookup(ns, [b"old" * 8]) == 0

"""Deadlines, leases, ping, release and the -1 block id, over a real socket.

The server runs in this process (:class:`ReferenceServer` on a thread) so a test can
hold a transfer inside it at a known point (or slow a copy down) while a deadline
passes; clients talk to it over its real UNIX socket, the engine's KV caches are real
CPU tensors in shared memory, and what was (not) written is checked byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_platform.protocol import _messages as P
from lmcache_platform.server import LookupRequest, ServerClient, ServerError, new_lease_id
from support.serve import CHUNK_BYTES, InProcess, TinyEngine, namespace
from support.waits import wait_until

WAIT_S = 60  # a bound for waits, never a measured time
MS = 1_000_000


def key(i: int, tag: bytes = b"k") -> bytes:
    return (tag + i.to_bytes(4, "big")).ljust(32, b".")


def past() -> int:
    return time.monotonic_ns() - 1


def soon(ms: float) -> int:
    return time.monotonic_ns() + int(ms * MS)


def stored(client: ServerClient, engine: TinyEngine, ns: bytes, n: int, tag: bytes = b"k") -> int:
    """Register ``engine`` in ``ns``, fill slots 0..n-1 with patterns 100+i, put them as keys 0..n-1."""
    ctx = engine.register(client, ns)
    for i in range(n):
        engine.fill(i, seed=100 + i)
    assert client.put(ctx, [(key(i, tag), [engine.blocks(i)]) for i in range(n)]).stored == n
    return ctx


@contextlib.contextmanager
def stored_then_zeroed(server: InProcess, engine: TinyEngine, n: int) -> Iterator[tuple[ServerClient, int]]:
    """A client and its context holding keys 0..n-1 (:func:`stored`), the engine's KV zeroed
    since: whatever a get then writes into it shows."""
    with server.client() as c:
        ctx = stored(c, engine, namespace(), n)
        engine.zero()
        yield c, ctx


def chunk(i: int, slot: int) -> P.Chunk:
    """Key ``i`` and the engine's blocks of chunk slot ``slot``, as a raw request carries them."""
    return P.Chunk(key(i), (tuple(TinyEngine.blocks(slot)),))


# -- ping, register's clock, and replies older clients expect ----------------------------


def test_ping_answers_the_servers_clock_and_pid(server: InProcess) -> None:
    with server.client() as c:
        before = time.monotonic_ns()
        r = c.ping()
        assert before <= r.now <= time.monotonic_ns() and r.pid == os.getpid()


def test_new_reply_keys_only_for_requests_that_use_new_fields(server: InProcess, engine: TinyEngine) -> None:
    ns = namespace()
    with server.client() as c:
        reg = c.register(engine.wrappers, namespace=ns, lmcache_tokens_per_chunk=8, layout_hints=engine.hints)
        assert reg.now == 0  # a version-1 register: the reply an old client checks key by key
        assert c.call("lookup", namespace=ns, keys=[key(0)]) == {"hits": 0}
        assert set(c.call("lookup", namespace=ns, keys=[key(0)], deadline=soon(5000))) == {
            "hits",
            "remote",
        }
    with ServerClient(server.server.socket_path, timeout=WAIT_S, deadline_ms=5000) as c:
        reg = c.register(engine.wrappers, namespace=ns, lmcache_tokens_per_chunk=8, layout_hints=engine.hints)
        assert abs(reg.now - time.monotonic_ns()) < 5_000 * MS


# -- deadlines -----------------------------------------------------------------------------


def test_a_request_late_when_read_is_dropped_counted_and_writes_nothing(
    server: InProcess, engine: TinyEngine
) -> None:
    with stored_then_zeroed(server, engine, 1) as (c, ctx):
        with pytest.raises(ServerError, match="deadline passed") as info:
            c.call("get", context=ctx, chunks=[chunk(0, 3)], deadline=past())
        assert info.value.remote_type == P.DEADLINE_EXCEEDED
        assert engine.is_zero(3)
        with pytest.raises(ServerError, match="deadline passed"):
            c.call("put", context=ctx, chunks=[chunk(9, 3)], deadline=past())
        assert c.lookup(namespace(), [key(9)]) == 0
        counters = c.status()["server"]
        assert counters["deadline_drops"] == 2 and counters["errors"] == 2
        assert counters["requests"]["get"] == 1 and counters["requests"]["put"] == 2


def test_a_request_queued_behind_another_is_dropped_when_its_deadline_passes(
    server: InProcess, engine: TinyEngine
) -> None:
    with stored_then_zeroed(server, engine, 2) as (c, ctx):
        held = server.hold(ctx, "write_chunk")
        first = P.encode_request("get", 101, context=ctx, chunks=[chunk(0, 4)])
        second = P.encode_request("get", 102, context=ctx, chunks=[chunk(1, 5)], deadline=soon(200))
        c.send_raw(first)
        c.send_raw(second)  # pipelined: waits in the socket behind the first
        assert held.entered.wait(WAIT_S)
        time.sleep(0.3)  # the second's deadline passes while the first is held
        held.release()
        r1, r2 = c.recv_reply(), c.recv_reply()
        assert (r1.request_id, r1.ok) == (101, True)
        assert (r2.request_id, r2.ok, r2.error_type) == (102, False, "DeadlineExceeded")
        assert engine.holds(4, seed=100)
        assert engine.is_zero(5), "a dropped get wrote into the engine's blocks"
        assert c.status()["server"]["deadline_drops"] == 1


def test_a_transfer_stops_between_batches_once_its_deadline_passes(
    server: InProcess, engine: TinyEngine
) -> None:
    with stored_then_zeroed(server, engine, 8) as (c, ctx):
        batch = server.ctx(ctx).max_batch_size
        assert batch < 8, "the request must span several batches"
        held = server.hold(ctx, "write_chunk")
        rid = 7
        c.send_raw(
            P.encode_request(
                "get",
                rid,
                context=ctx,
                chunks=[chunk(i, 8 + i) for i in range(8)],
                deadline=soon(300),
            )
        )
        assert held.entered.wait(WAIT_S)  # inside the first batch, before its deadline
        time.sleep(0.4)
        held.release()
        reply = c.recv_reply()
        assert (reply.ok, reply.error_type) == (False, "DeadlineExceeded")
        assert f"after {batch} of 8 chunks were written" in reply.error_message
        for i in range(8):
            if i < batch:
                assert engine.holds(8 + i, seed=100 + i)  # the batch under way when it expired
            else:
                assert engine.is_zero(8 + i), f"chunk {i} was written after the deadline"


def test_a_late_put_commits_nothing(server: InProcess, engine: TinyEngine) -> None:
    ns = namespace()
    with server.client() as c:
        ctx = engine.register(c, ns)
        engine.fill(0, seed=5)
        before = c.status()["server"]
        copy = server.ctx(ctx).read_chunk

        def slow_copy(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.3)  # the deadline passes during the copy
            return copy(*args, **kwargs)

        server.ctx(ctx).read_chunk = slow_copy
        with pytest.raises(ServerError, match="after the store's reads; nothing was committed") as info:
            c.call("put", context=ctx, chunks=[chunk(0, 0)], deadline=soon(100))
        assert info.value.remote_type == "DeadlineExceeded"
        after = c.status()["server"]
        assert c.lookup(ns, [key(0)]) == 0
        assert (after["stored"], after["chunks"], after["host_bytes"]) == (
            before["stored"],
            before["chunks"],
            before["host_bytes"],
        )
        del server.ctx(ctx).read_chunk  # the reservation was given back: a timely put stores it
        assert c.put(ctx, [(key(0), [engine.blocks(0)])]).stored == 1


# -- lookups over namespaces and leases ----------------------------------------------------


def test_lookup_over_namespaces_counts_the_leading_keys_held_in_every_one(server: InProcess) -> None:
    a, b = TinyEngine(), TinyEngine()
    ns_a, ns_b = namespace("a"), namespace("b")
    try:
        with server.client() as c:
            stored(c, a, ns_a, 4)
            stored(c, b, ns_b, 2)
            keys = [key(i) for i in range(4)]
            assert c.lookup([ns_a, ns_b], keys) == 2
            assert c.lookup([ns_b, ns_a], keys) == 2
            assert c.lookup([ns_a], keys) == 4
            assert c.lookup([ns_a, namespace("none")], keys) == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("server", [4 * CHUNK_BYTES], indirect=True)
def test_a_lease_pins_its_hits_against_eviction_until_released(server: InProcess) -> None:
    a, b, w = TinyEngine(), TinyEngine(), TinyEngine()
    ns, other = namespace("pinned"), namespace("other")
    try:
        with server.client() as ca, server.client() as cb, server.client() as cw:
            ctx_a = stored(ca, a, ns, 4)  # the cap is full
            lease = new_lease_id()
            assert ca.lookup(ns, [key(i) for i in range(2)], lease=lease, lease_ms=60_000) == 2
            assert server.counters()["leases"] == 1 and server.counters()["lease_pins"] == 2
            ctx_b = b.register(cb, other)
            ctx_w = w.register(cw, other)
            for i in range(8):
                b.fill(i, seed=200 + i)
                w.fill(i, seed=300 + i)
            results: list[Any] = []

            def put(client: ServerClient, ctx: int, eng: TinyEngine, tag: bytes) -> None:
                for i in range(8):  # one chunk per put: each evicts what it can
                    results.append(client.put(ctx, [(key(i, tag), [eng.blocks(i)])]))

            threads = [
                threading.Thread(target=put, args=(cb, ctx_b, b, b"B")),
                threading.Thread(target=put, args=(cw, ctx_w, w, b"W")),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT_S)
            assert len(results) == 16 and sum(r.evicted for r in results) >= 2
            assert ca.lookup(ns, [key(i) for i in range(4)]) == 2  # the leased two survived, the rest went
            a.zero()
            assert ca.get(ctx_a, [(key(i), [a.blocks(i)]) for i in range(2)]).retrieved == 2
            assert a.holds(0, seed=100) and a.holds(1, seed=101)
            ca.release(lease)
            ca.release(lease)  # already gone: still fine
            assert server.counters()["leases"] == 0 and server.counters()["lease_pins"] == 0
            r = cb.put(ctx_b, [(key(i, b"X"), [b.blocks(i)]) for i in range(4)])
            assert r.stored == 4  # unpinned: they may go now
            assert ca.lookup(ns, [key(0)]) == 0
    finally:
        for eng in (a, b, w):
            eng.close()


def test_a_get_with_the_lease_releases_its_namespaces_share(server: InProcess) -> None:
    a, b = TinyEngine(), TinyEngine()
    ns_a, ns_b = namespace("a"), namespace("b")
    try:
        with server.client() as c:
            ctx_a = stored(c, a, ns_a, 2)
            ctx_b = stored(c, b, ns_b, 2)
            lease = new_lease_id()
            assert c.lookup([ns_a, ns_b], [key(0), key(1)], lease=lease, lease_ms=60_000) == 2
            assert (server.counters()["leases"], server.counters()["lease_pins"]) == (1, 4)
            assert (
                c.get(ctx_a, [(key(0), [a.blocks(5)]), (key(1), [a.blocks(6)])], lease=lease).retrieved == 2
            )
            assert (server.counters()["leases"], server.counters()["lease_pins"]) == (1, 2)
            assert c.get(ctx_b, [(key(0), [b.blocks(5)])], lease=lease).retrieved == 1
            assert (server.counters()["leases"], server.counters()["lease_pins"]) == (0, 0)
            assert server.counters()["lease_expired"] == 0 and server.counters()["leases_taken"] == 1
    finally:
        a.close()
        b.close()


def test_a_lease_expires_and_a_closed_connection_takes_its_leases(
    server: InProcess, engine: TinyEngine
) -> None:
    ns = namespace()
    with server.client() as c:
        stored(c, engine, ns, 2)
        assert c.lookup(ns, [key(0), key(1)], lease=new_lease_id(), lease_ms=150) == 2
        # no request arrives: the sweeper thread ends it
        waited = wait_until(lambda: server.counters()["leases"] == 0, "the lease to expire")
        print(f"lease of 150 ms ended {waited * 1e3:.0f} ms after the lookup returned")
        assert server.counters()["lease_expired"] == 1 and server.counters()["pinned"] == 0
        assert server.counters()["lease_unread_chunks"] == 2  # found, never read: lost hits
        with server.client() as other:
            lease = new_lease_id()
            assert other.lookup(ns, [key(0)], lease=lease, lease_ms=60_000) == 1
            # Another connection drawing the same id (engines seeding one generator alike did)
            # holds a lease of its own: never refused, and ending one leaves the other.
            assert c.lookup(ns, [key(0)], lease=lease, lease_ms=60_000) == 1
            assert (server.counters()["leases"], server.counters()["lease_pins"]) == (2, 2)
            c.release(lease)
            assert (server.counters()["leases"], server.counters()["lease_pins"]) == (1, 1)
            assert other.lookup(ns, [key(0), key(1)], lease=lease, lease_ms=60_000) == 2  # renewed
            assert (server.counters()["leases"], server.counters()["lease_pins"]) == (1, 2)
        wait_until(lambda: server.counters()["leases"] == 0, "the closed connection's leases to end")
        assert server.counters()["pinned"] == 0 and server.counters()["lease_expired"] == 1


def test_lookup_refuses_malformed_lease_fields(server: InProcess) -> None:
    ns = namespace()
    with server.client() as c:
        for fields, match in [
            ({"namespace": ns, "lease": 5}, "'lease' and 'lease_ms' go together"),
            ({"namespace": ns, "lease": 5, "lease_ms": 600_001}, "lease_ms: 600001 is outside"),
            ({"namespace": ns, "lease": 0, "lease_ms": 10}, "lease: 0 is outside"),
            ({"namespace": ns, "namespaces": [ns]}, "exactly one of"),
            ({"namespaces": []}, "namespaces: must not be empty"),
            ({"namespace": ns, "deadline": -1}, "deadline: -1 is outside"),
        ]:
            c.send_raw(_raw_lookup(fields))
            reply = c.recv_reply()
            assert (reply.ok, reply.error_type) == (False, "WireFormatError")
            assert re.search(match, reply.error_message), (match, reply.error_message)
        assert c.ping().pid == os.getpid()  # still serving


def _raw_lookup(fields: dict[str, Any]) -> bytes:
    from lmcache_platform import _codec

    return _codec.pack(
        P.MAGIC,
        P.VERSION,
        {"op": "lookup", "id": 3, "keys": [b"k"], **fields},
        max_bytes=1 << 20,
        what="test",
    )


# -- the -1 block id over the wire --------------------------------------------------------


def test_get_skips_minus_one_blocks_and_put_refuses_them(server: InProcess, engine: TinyEngine) -> None:
    ns = namespace()
    with server.client() as c:
        ctx = stored(c, engine, ns, 1)
        want_second_block = [t[:, 1].clone() for t in engine.tensors]  # slot 0 is blocks 0 and 1
        engine.zero()
        snapshot = [t.clone() for t in engine.tensors]
        assert c.get(ctx, [(key(0), [[-1, 9]])]).retrieved == 1
        for t, want, before in zip(engine.tensors, want_second_block, snapshot, strict=True):
            assert t[:, 9].equal(want)  # the chunk's second block, where it was asked
            t[:, 9] = before[:, 9]
            assert t.equal(before), "a skipped block's positions were written"
        with pytest.raises(ServerError, match=r"engine group 0: block id -1 \(skip\)") as info:
            c.put(ctx, [(key(5), [[-1, 9]])])
        assert info.value.remote_type == "TransferError"
        with pytest.raises(ServerError, match="some repeat"):
            c.get(ctx, [(key(0), [[9, 9]])])


def test_a_lookup_says_which_namespaces_no_live_context_registered(server: InProcess) -> None:
    """A scheduler whose link is back before its workers' must not offer hits they cannot load."""
    engine = TinyEngine()
    other = b"n" * 32
    try:
        with server.client() as c:
            ctx = engine.register(c, b"m" * 32)
            engine.fill(0, seed=1)
            assert c.put(ctx, [(key(0), [engine.blocks(0)])]).stored == 1
            live = c.execute(LookupRequest(namespaces=(b"m" * 32,), keys=(key(0),)))
            assert (live.hits, live.unregistered) == (1, 0)
            both = c.execute(LookupRequest(namespaces=(b"m" * 32, other), keys=(key(0),)))
            assert both.unregistered == 1
        with server.client() as c:  # the registering connection closed: its context with it
            deadline = time.monotonic() + 10  # the server notices the close on its own thread
            while c.status()["server"]["contexts"] and time.monotonic() < deadline:
                time.sleep(0.01)
            gone = c.execute(LookupRequest(namespaces=(b"m" * 32,), keys=(key(0),)))
            assert (gone.hits, gone.unregistered) == (1, 1)  # still held, but no engine registered
    finally:
        engine.close()

"""The server's chunk index on its own: LRU order, pins, reservations and the byte budget.

The same rules are exercised over a real socket in ``test_cache_semantics.py``; here
each one is pinned down exactly, including the interleavings a socket test cannot
force (a read in progress while a store needs room, two stores of one key at once).
"""

from __future__ import annotations

import pytest

from lmcache_platform import TransferError
from lmcache_platform.server._index import ChunkIndex, Reservation

NS = b"ns"
C = 100  # bytes per chunk


def put(index: ChunkIndex, *keys: str, ns: object = NS) -> Reservation:
    res = index.reserve(ns, list(keys), C, shared=True)
    index.commit(res, [([f"payload of {k}"], C) for k in res.keys])
    return res


def present(index: ChunkIndex, *keys: str, ns: object = NS) -> list[str]:
    """Which of ``keys`` are stored, asked one at a time (each ask touches only that key)."""
    return [k for k in keys if index.lookup(ns, [k])]


def test_lookup_counts_the_leading_present_keys() -> None:
    index = ChunkIndex(10 * C)
    put(index, "a", "b", "d")
    assert index.lookup(NS, ["a", "b", "c", "d"]) == 2
    assert index.lookup(NS, ["c", "a"]) == 0
    assert index.lookup(NS, []) == 0
    assert index.lookup(b"other", ["a"]) == 0
    stats = index.stats()
    assert (stats["hits"], stats["misses"]) == (2, 2 + 2 + 1)


def test_a_present_key_is_not_written_again() -> None:
    index = ChunkIndex(10 * C)
    put(index, "a")
    res = index.reserve(NS, ["a", "b"], C, shared=True)
    assert (res.keys, res.present, res.dropped) == (["b"], 1, 0)
    index.commit(res, [(["new b"], C)])
    (a,) = index.acquire(NS, ["a"])
    assert a.payload == ["payload of a"]  # untouched
    index.release([a])
    assert index.stats()["host_bytes"] == 2 * C


def test_least_recently_used_goes_first() -> None:
    index = ChunkIndex(3 * C)
    for k in "abc":
        put(index, k)
    index.lookup(NS, ["a"])  # a is now the most recently used
    res = put(index, "d")
    assert res.evicted == 1
    assert present(index, "a", "b", "c", "d") == ["a", "c", "d"]
    assert index.stats()["evictions"] == 1 and index.stats()["host_bytes"] == 3 * C


def test_within_one_request_the_tail_goes_first() -> None:
    """Keys chain a prefix; its tail is worthless without its head, so the tail is evicted first."""
    index = ChunkIndex(3 * C)
    put(index, "a", "b", "c")
    put(index, "x")
    assert index.lookup(NS, ["a", "b", "c"]) == 2
    put(index, "y")  # after the lookup touched b then a: x is oldest
    assert present(index, "a", "b", "x", "y") == ["a", "b", "y"]


def test_a_store_that_does_not_fit_keeps_its_leading_keys() -> None:
    index = ChunkIndex(3 * C)
    put(index, "old")
    res = put(index, "a", "b", "c", "d", "e")
    assert (res.keys, res.dropped, res.evicted) == (["a", "b", "c"], 2, 1)
    assert index.lookup(NS, ["a", "b", "c", "d"]) == 3


def test_a_store_never_evicts_its_own_present_keys() -> None:
    index = ChunkIndex(2 * C)
    put(index, "a")
    put(index, "p")
    held = index.acquire(NS, ["p"])  # p cannot go; the only other chunk is a...
    res = index.reserve(NS, ["a", "b"], C, shared=True)  # ...which this request itself needs
    assert (res.keys, res.present, res.dropped, res.evicted) == ([], 1, 1, 0)
    index.commit(res, [])
    index.release(held)
    assert present(index, "a", "b", "p") == ["a", "p"]


def test_a_chunk_being_read_is_never_evicted() -> None:
    index = ChunkIndex(1 * C)
    put(index, "a")
    held = index.acquire(NS, ["a"])
    res = index.reserve(NS, ["b"], C, shared=True)
    assert (res.keys, res.dropped, res.evicted) == ([], 1, 0)  # nothing else to evict: dropped
    index.commit(res, [])
    assert index.stats()["pinned"] == 1
    index.release(held)
    assert put(index, "b").evicted == 1
    assert present(index, "a", "b") == ["b"]


def test_a_key_being_written_is_invisible_and_not_written_twice() -> None:
    index = ChunkIndex(10 * C)
    first = index.reserve(NS, ["k"], C, shared=True)
    assert index.lookup(NS, ["k"]) == 0 and index.acquire(NS, ["k"]) == []
    second = index.reserve(NS, ["k"], C, shared=True)  # another engine stores the same prefix
    assert (second.keys, second.present) == ([], 1)
    index.commit(second, [])
    assert index.stats()["host_bytes"] == C  # reserved once
    index.commit(first, [(["k"], C)])
    assert index.lookup(NS, ["k"]) == 1


def test_an_aborted_store_leaves_nothing() -> None:
    index = ChunkIndex(2 * C)
    res = index.reserve(NS, ["a", "b"], C, shared=True)
    assert index.stats()["host_bytes"] == 2 * C
    index.abort(res)
    assert index.stats()["host_bytes"] == 0 and index.count(NS) == 0
    assert put(index, "a", "b").keys == ["a", "b"]  # the keys are free to store again
    with pytest.raises(ValueError, match="already committed or aborted"):
        index.abort(res)


def test_private_chunks_replace_are_never_evicted_and_refuse_when_full() -> None:
    index = ChunkIndex(3 * C)
    put(index, "shared")
    ctx = 7  # a context's own chunks live in the namespace of its id
    res = index.reserve(ctx, ["c1", "c2"], C, shared=False)
    index.commit(res, [(["one"], C), (["two"], C)])
    res = index.reserve(ctx, ["c1"], C, shared=False)  # replaces: needs no new room
    assert res.evicted == 0
    index.commit(res, [(["one again"], C)])
    (c1,) = index.acquire(ctx, ["c1"])
    assert c1.payload == ["one again"]
    index.release([c1])
    res = index.reserve(ctx, ["c3"], C, shared=False)  # evicts the shared chunk, never c1/c2
    assert res.evicted == 1
    index.commit(res, [(["three"], C)])
    with pytest.raises(TransferError, match=r"exceeds the server's host memory.*nothing was stored"):
        index.reserve(ctx, ["c4"], C, shared=False)
    assert put(index, "s2").dropped == 1  # private chunks are not evictable for shared ones either
    assert index.drop(ctx) == 3
    assert index.stats()["chunks"] == 0 and index.stats()["host_bytes"] == 0


def test_namespaces_never_mix() -> None:
    index = ChunkIndex(10 * C)
    put(index, "k", ns=b"A")
    put(index, "k", ns=7)  # an int namespace (a context's own) never equals a client's bytes
    assert index.count(b"A") == 1 and index.count(7) == 1 and index.count(b"B") == 0
    assert index.lookup(b"B", ["k"]) == 0
    assert index.drop(7) == 1 and index.lookup(b"A", ["k"]) == 1


def test_evictions_are_remembered_in_order_for_removal_events(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_platform.server import _index

    monkeypatch.setattr(_index, "REMOVAL_LOG", 4)
    index = ChunkIndex(2 * C)
    put(index, "a", "b")
    put(index, "x", ns=b"other")  # evicts the least recently used: b (a was touched last)
    put(index, "c")
    assert index.removed_since([NS, b"other"], 0, 10) == ([(0, "b"), (0, "a")], 2, False)
    assert index.removed_since([b"other"], 0, 10) == ([], 2, False)  # other namespaces' only
    assert index.removed_since([NS], 1, 10) == ([(0, "a")], 2, False)
    assert index.removed_since([NS], 0, 1) == ([(0, "b")], 1, False)  # paged: the cursor resumes
    assert index.removed_since([NS], 2, 10) == ([], 2, False)  # nothing new
    for k in "defgh":
        put(index, k)
    removed, cursor, missed = index.removed_since([NS, b"other"], 2, 10)
    assert missed and cursor == index.removed_since([NS], cursor, 10)[1]  # the log kept its last 4 only
    assert len(removed) == 4


def test_a_contexts_own_chunks_are_not_reported_as_removed() -> None:
    index = ChunkIndex(10 * C)
    res = index.reserve(7, ["own"], C, shared=False)
    index.commit(res, [(["payload"], C)])
    assert index.drop(7) == 1
    assert index.removed_since([7], 0, 10) == ([], 0, False)

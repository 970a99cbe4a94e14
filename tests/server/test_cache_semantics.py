"""The server as a cache, over a real ``lmcache-platform serve`` process and its socket.

Engines are this test process: real CPU KV tensors wrapped by the installed backend.
Keys come from :func:`chunk_keys` over token ids, namespaces from
:func:`cache_namespace`, as a connector computes them. Each test uses namespaces of its
own, so tests sharing a server do not see each other's chunks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from lmcache_platform.server import ServerClient, ServerError, chunk_keys
from support.serve import BLOCKS, CHUNK, CHUNK_BYTES, HEAD, Serve, TinyEngine, namespace, private_dir

_models = itertools.count()


def fresh_namespace(head: int = HEAD) -> bytes:
    return namespace(model=f"model-{next(_models)}", head=head)


def tokens(n_chunks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_chunks * CHUNK))


def registered(client: ServerClient, engine: TinyEngine, n_chunks: int) -> tuple[bytes, list[bytes], int]:
    """A fresh namespace, the keys of ``n_chunks`` chunks in it, and ``engine``'s context there."""
    ns = fresh_namespace()
    return ns, chunk_keys(tokens(n_chunks), CHUNK, ns), engine.register(client, ns)


def serve_holding(tmp_path_factory: pytest.TempPathFactory, chunks: int) -> Iterator[Serve]:
    """A ``serve`` process whose memory cap holds exactly ``chunks`` chunks; it must stop cleanly."""
    sock = private_dir(tmp_path_factory.mktemp(f"cap{chunks}")) / "kv.sock"
    with Serve(sock, "--max-host-bytes", str(chunks * CHUNK_BYTES)) as proc:
        yield proc
        assert proc.stop() == 0


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    yield from serve_holding(tmp_path_factory, 256)


@pytest.fixture
def client(serve: Serve) -> Iterator[ServerClient]:
    with ServerClient(str(serve.socket_path), timeout=60) as c:
        yield c


def counters(client: ServerClient) -> dict[str, int]:
    return dict(client.status()["server"])


# -- sharing between engines --------------------------------------------------------------


def test_a_second_engine_loads_what_the_first_stored(serve: Serve, engine: TinyEngine) -> None:
    ns = fresh_namespace()
    keys = chunk_keys(tokens(3), CHUNK, ns)
    with ServerClient(str(serve.socket_path), timeout=60) as a:
        ctx_a = engine.register(a, ns)
        for i in range(3):
            engine.fill(i, seed=100 + i)
        r = a.put(ctx_a, [(k, [engine.blocks(i)]) for i, k in enumerate(keys)])
        assert (r.stored, r.present, r.dropped, r.bytes) == (3, 0, 0, 3 * CHUNK_BYTES)
    b_engine = TinyEngine()  # another engine: its own memory, its own connection and context
    try:
        with ServerClient(str(serve.socket_path), timeout=60) as b:
            ctx_b = b_engine.register(b, ns)
            assert b.lookup(ns, keys) == 3
            got = b.get(ctx_b, [(k, [b_engine.blocks(10 + i)]) for i, k in enumerate(keys)])
            assert (got.retrieved, got.bytes) == (3, 3 * CHUNK_BYTES)
            assert all(b_engine.holds(10 + i, seed=100 + i) for i in range(3))
            others = [i for i in range(BLOCKS // 2) if i not in (10, 11, 12)]
            assert all(b_engine.is_zero(i) for i in others), "a block outside the request changed"
    finally:
        b_engine.close()


def test_keyed_chunks_survive_the_context_that_stored_them(serve: Serve, engine: TinyEngine) -> None:
    ns = fresh_namespace()
    (key,) = chunk_keys(tokens(1), CHUNK, ns)
    with ServerClient(str(serve.socket_path), timeout=60) as a:
        ctx = engine.register(a, ns)
        engine.fill(0, seed=7)
        a.put(ctx, [(key, [engine.blocks(0)])])
        a.store(ctx, [("private", [engine.blocks(0)])])  # a chunk id: goes with the context
        assert a.status(ctx)["context"]["stored_chunks"] == 1
        a.unregister(ctx)
        ctx = engine.register(a, ns)
        with pytest.raises(ServerError, match="unknown chunk ids \\['private'\\]"):
            a.retrieve(ctx, [("private", [engine.blocks(1)])])
    # that connection is gone (an engine exit); a new engine still finds the keyed chunk
    with ServerClient(str(serve.socket_path), timeout=60) as b:
        assert b.lookup(ns, [key]) == 1
        ctx = engine.register(b, ns)
        assert b.get(ctx, [(key, [engine.blocks(5)])]).retrieved == 1
        assert engine.holds(5, seed=7)


# -- lookup, put and get semantics ---------------------------------------------------------


def test_lookup_counts_leading_present_keys(client: ServerClient, engine: TinyEngine) -> None:
    ns, keys, ctx = registered(client, engine, 5)
    client.put(ctx, [(keys[i], [engine.blocks(i)]) for i in (0, 1, 3)])  # a hole at 2
    before = counters(client)
    assert client.lookup(ns, keys) == 2
    assert client.lookup(ns, keys[3:]) == 1  # leading from where the caller starts
    assert client.lookup(ns, keys[2:]) == 0
    assert client.lookup(ns, []) == 0
    assert client.lookup(ns, [keys[0], keys[0], keys[1]]) == 3
    after = counters(client)
    assert after["hits"] - before["hits"] == 2 + 1 + 0 + 3
    assert after["misses"] - before["misses"] == 3 + 1 + 3 + 0


def test_storing_a_present_key_copies_nothing(client: ServerClient, engine: TinyEngine) -> None:
    _, keys, ctx = registered(client, engine, 2)
    engine.fill(0, seed=1)
    assert client.put(ctx, [(keys[0], [engine.blocks(0)])]).stored == 1
    engine.fill(0, seed=2)  # the engine's blocks change: a copy would be visible
    engine.fill(1, seed=3)
    before = counters(client)
    r = client.put(ctx, [(keys[0], [engine.blocks(0)]), (keys[1], [engine.blocks(1)])])
    assert (r.stored, r.present, r.bytes) == (1, 1, CHUNK_BYTES)
    assert counters(client)["host_bytes"] - before["host_bytes"] == CHUNK_BYTES
    client.get(ctx, [(keys[0], [engine.blocks(4)]), (keys[1], [engine.blocks(5)])])
    assert engine.holds(4, seed=1) and engine.holds(5, seed=3)


def test_get_writes_the_leading_present_chunks_and_nothing_after(
    client: ServerClient, engine: TinyEngine
) -> None:
    _, keys, ctx = registered(client, engine, 4)
    for i in range(4):
        engine.fill(i, seed=20 + i)
    client.put(ctx, [(keys[i], [engine.blocks(i)]) for i in (0, 1, 3)])
    engine.zero()
    got = client.get(ctx, [(k, [engine.blocks(8 + i)]) for i, k in enumerate(keys)])
    assert (got.retrieved, got.bytes) == (2, 2 * CHUNK_BYTES)
    assert engine.holds(8, seed=20) and engine.holds(9, seed=21)
    assert engine.is_zero(10) and engine.is_zero(11), "chunks after the first missing key were written"


def test_a_bad_block_id_anywhere_means_nothing_moves(client: ServerClient, engine: TinyEngine) -> None:
    ns, keys, ctx = registered(client, engine, 2)
    engine.fill(0, seed=5)
    with pytest.raises(ServerError, match=r"chunk 1 \(key [0-9a-f]{16}\.\.\.\).*out of range") as info:
        client.put(ctx, [(keys[0], [engine.blocks(0)]), (keys[1], [[0, BLOCKS]])])
    assert info.value.remote_type == "TransferError"
    assert client.lookup(ns, keys) == 0, "a refused put stored its first chunk"
    client.put(ctx, [(keys[0], [engine.blocks(0)])])
    with pytest.raises(ServerError, match=r"chunk 1 .*repeat"):
        client.get(ctx, [(keys[0], [engine.blocks(3)]), (keys[0], [[6, 6]])])
    assert engine.is_zero(3), "a refused get wrote its first chunk"
    with pytest.raises(ServerError, match="appears twice in one request"):
        client.put(ctx, [(keys[1], [engine.blocks(1)]), (keys[1], [engine.blocks(2)])])
    assert client.lookup(ns, keys) == 1


def test_put_and_get_need_a_namespace(client: ServerClient, engine: TinyEngine) -> None:
    ctx = engine.register(client)  # no namespace: chunk ids only
    assert client.status(ctx)["context"]["namespace"] == b""
    for call in (client.put, client.get):
        with pytest.raises(ServerError, match="registered without a namespace") as info:
            call(ctx, [(b"k" * 32, [engine.blocks(0)])])
        assert info.value.remote_type == "TransferError"
    client.store(ctx, [("still works", [engine.blocks(0)])])


# -- namespaces -------------------------------------------------------------------------------


def test_a_key_from_another_namespace_never_matches(client: ServerClient, engine: TinyEngine) -> None:
    ns_a, ns_b = fresh_namespace(), fresh_namespace()
    key = b"the same key bytes in both".ljust(32, b".")
    ctx_a = engine.register(client, ns_a)
    ctx_b = engine.register(client, ns_b)
    engine.fill(0, seed=9)
    client.put(ctx_a, [(key, [engine.blocks(0)])])
    assert client.lookup(ns_a, [key]) == 1
    assert client.lookup(ns_b, [key]) == 0
    assert client.get(ctx_b, [(key, [engine.blocks(3)])]).retrieved == 0
    assert engine.is_zero(3)
    assert client.put(ctx_b, [(key, [engine.blocks(0)])]).stored == 1  # its own copy, not "present"
    # the connector's keys already differ by namespace; the server keeps them apart regardless
    assert chunk_keys(tokens(1), CHUNK, ns_a) != chunk_keys(tokens(1), CHUNK, ns_b)


def test_a_namespace_holds_one_kv_layout(client: ServerClient, engine: TinyEngine) -> None:
    ns = fresh_namespace()
    ctx = engine.register(client, ns)
    engine.fill(0, seed=4)
    client.put(ctx, [(b"k" * 32, [engine.blocks(0)])])
    other = TinyEngine(head=HEAD * 2)  # a bigger head: chunks of other bytes under the same name
    try:
        match = r"holds chunks of another KV layout .*head_size is 8 there, 16 here"
        with pytest.raises(ServerError, match=match) as info:
            other.register(client, ns)
        assert info.value.remote_type == "LayoutError"
        other.register(client, fresh_namespace(head=HEAD * 2))  # under its own namespace: fine
    finally:
        other.close()
    assert engine.register(client, ns) > 0  # the same layout may join


# -- LRU eviction under the memory cap ---------------------------------------------------------

CAP_CHUNKS = 4


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    yield from serve_holding(tmp_path_factory, CAP_CHUNKS)


@pytest.fixture
def small_client(small: Serve) -> Iterator[ServerClient]:
    with ServerClient(str(small.socket_path), timeout=60) as c:
        yield c


def present(client: ServerClient, ns: bytes, keys: list[bytes]) -> list[int]:
    """Indices of the stored ``keys``, asked one by one (each ask touches one key)."""
    return [i for i, k in enumerate(keys) if client.lookup(ns, [k])]


def test_the_least_recently_used_chunk_is_evicted(small_client: ServerClient, engine: TinyEngine) -> None:
    c = small_client
    ns = fresh_namespace()
    keys = [bytes([i]) * 32 for i in range(5)]
    ctx = engine.register(c, ns)
    for i in range(4):  # fill the cap, one request each: 0 is the oldest
        engine.fill(i, seed=30 + i)
        c.put(ctx, [(keys[i], [engine.blocks(i)])])
    assert c.lookup(ns, keys[:1]) == 1  # 0 becomes the most recently used; 1 is now the oldest
    before = counters(c)
    start = c.removals([ns]).cursor  # the server's removals so far (other tests' too)
    engine.fill(4, seed=34)
    r = c.put(ctx, [(keys[4], [engine.blocks(4)])])
    assert (r.stored, r.evicted) == (1, 1)
    after = counters(c)
    assert after["evictions"] - before["evictions"] == 1
    assert after["host_bytes"] == CAP_CHUNKS * CHUNK_BYTES == after["max_host_bytes"]
    assert after["chunks"] == CAP_CHUNKS
    assert present(c, ns, keys) == [0, 2, 3, 4]
    gone = c.removals([fresh_namespace(), ns], since=start)
    assert [(i, k) for i, k in gone.removed] == [(1, keys[1])] and not gone.missed  # for KV events
    assert c.removals([ns], since=gone.cursor).removed == ()
    engine.zero()  # what is left is whole and exact
    got = c.get(ctx, [(keys[i], [engine.blocks(8 + j)]) for j, i in enumerate((0, 2, 3, 4))])
    assert got.retrieved == 4
    assert all(engine.holds(8 + j, seed=30 + i) for j, i in enumerate((0, 2, 3, 4)))


def test_within_one_request_the_prefix_tail_is_evicted_first(
    small_client: ServerClient, engine: TinyEngine
) -> None:
    c = small_client
    ns, keys, ctx = registered(c, engine, 4)
    c.put(ctx, [(k, [engine.blocks(i)]) for i, k in enumerate(keys)])  # one request fills the cap
    (extra,) = chunk_keys(tokens(1, start=10_000), CHUNK, ns)
    assert c.put(ctx, [(extra, [engine.blocks(5)])]).evicted == 1
    assert c.lookup(ns, keys) == 3  # the head survives: the prefix is still usable up to there
    assert c.lookup(ns, keys[3:]) == 0


def test_a_put_beyond_the_cap_keeps_its_leading_chunks(
    small_client: ServerClient, engine: TinyEngine
) -> None:
    c = small_client
    ns, keys, ctx = registered(c, engine, 6)
    r = c.put(ctx, [(k, [engine.blocks(i)]) for i, k in enumerate(keys)])
    assert (r.stored, r.dropped, r.bytes) == (CAP_CHUNKS, 2, CAP_CHUNKS * CHUNK_BYTES)
    assert c.lookup(ns, keys) == CAP_CHUNKS
    assert counters(c)["host_bytes"] <= counters(c)["max_host_bytes"]

"""The remote tier against a real ``valkey-server``: round trips, refusals, failures, capacity.

Every call's time is measured and printed, never asserted; what is asserted is what the
tier did (its answers and counters) and that no call raised.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_platform.remote._entry import EntryIdentity, TensorSpec, encode
from lmcache_platform.remote._tier import DEGRADE_AFTER, RemoteTier, check_prefix, load_key_file
from support.valkey import ValkeyNode
from support.waits import until

NS = bytes(range(32))
OTHER_NS = bytes(range(1, 33))
KEYS = [bytes([i]) * 32 for i in range(1, 41)]


def chunk(seed: int, mib: float = 0.25) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * (1 << 20)) // 8
    return [torch.randn(2, n // 2, generator=g), torch.randn(2, n // 2, generator=g).to(torch.bfloat16)]


def make_tier(node: ValkeyNode, **kwargs: object) -> RemoteTier:
    kwargs.setdefault("prefix", "test")
    kwargs.setdefault("retry_first_s", 0.2)
    kwargs.setdefault("retry_max_s", 0.8)
    tier = RemoteTier.open(node.url, **kwargs)  # type: ignore[arg-type]
    assert tier.wait_ready(10), tier.stats()
    return tier


@pytest.fixture
def tier(valkey_node: ValkeyNode) -> Iterator[RemoteTier]:
    t = make_tier(valkey_node)
    yield t
    t.close()


def fill(tier: RemoteTier, n: int, namespace: bytes = NS, mib: float = 0.25) -> list[list[torch.Tensor]]:
    chunks = [chunk(i, mib) for i in range(n)]
    for key, c in zip(KEYS, chunks, strict=False):
        assert tier.write_behind(namespace, key, c)
    assert tier.flush(30)
    return chunks


def deadline_in(ms: float) -> int:
    return time.monotonic_ns() + int(ms * 1e6)


def timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - started


@pytest.fixture
def tier_log(tier: RemoteTier, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """``caplog`` with the tier's INFO lines, from the ready ``tier`` on: each state change
    (``remote_down``, ``remote_up``) the test causes counts once, its first ``remote_up`` not."""
    caplog.set_level(logging.INFO, logger="lmcache_platform.remote._tier")
    return caplog


def events(caplog: pytest.LogCaptureFixture, name: str) -> int:
    return sum(getattr(r, "event", "") == name for r in caplog.records)


# -- the happy path ---------------------------------------------------------------------------


def test_write_behind_lookup_and_fetch_round_trip(tier: RemoteTier, valkey_node: ValkeyNode) -> None:
    chunks = fill(tier, 10)
    assert tier.lookup_more(NS, KEYS[:10]) == 10
    assert tier.lookup_more(NS, KEYS[:15]) == 10  # the leading run only
    assert tier.lookup_more(NS, [KEYS[20], *KEYS[:5]]) == 0
    assert tier.lookup_more(OTHER_NS, KEYS[:10]) == 0
    got = tier.fetch(
        NS,
        KEYS[:12],
        deadline_in(5000),
        expect=[TensorSpec(str(t.dtype)[6:], tuple(t.shape)) for t in chunks[0]],
    )
    assert [g is not None for g in got] == [True] * 10 + [False] * 2
    for want, have in zip(chunks, got, strict=False):
        assert have is not None and all(torch.equal(a, b) for a, b in zip(want, have.tensors, strict=True))
    s = tier.stats()
    assert (s["written"], s["fetched"], s["fetch_misses"], s["errors"], s["state"]) == (
        10,
        10,
        2,
        0,
        "healthy",
    )
    assert (s["hits"], s["misses"]) == (20, 5 + 6 + 10)
    stored = sorted(valkey_node.client().keys("*"))
    assert stored[0] == b"test:" + NS.hex().encode() + b":" + KEYS[0].hex().encode()
    assert all(b"{" not in k for k in stored)  # no hash tag: keys spread over a cluster's slots


def test_prefixes_keep_deployments_apart(valkey_node: ValkeyNode) -> None:
    a, b = make_tier(valkey_node, prefix="east"), make_tier(valkey_node, prefix="west")
    try:
        fill(a, 3)
        assert a.lookup_more(NS, KEYS[:3]) == 3 and b.lookup_more(NS, KEYS[:3]) == 0
        assert b.fetch(NS, KEYS[:3]) == [None] * 3
    finally:
        a.close()
        b.close()
    for bad in ("", "a{b}", "a b", "x" * 65):
        with pytest.raises(ValueError, match="remote prefix"):
            check_prefix(bad)


# -- the trust boundary -------------------------------------------------------------------------


def test_bad_entries_written_straight_into_valkey_are_refused_and_counted(
    tier: RemoteTier, valkey_node: ValkeyNode, caplog: pytest.LogCaptureFixture
) -> None:
    fill(tier, 8)
    raw = valkey_node.client()
    k = [tier.store_key(NS, key) for key in KEYS[:8]]
    good = raw.get(k[0])
    corrupt = bytearray(raw.get(k[1]))
    corrupt[len(corrupt) // 2] ^= 0x10
    raw.set(k[1], bytes(corrupt))  # a flipped bit in the payload
    raw.set(k[2], good[:-100])  # a truncated write
    foreign = encode(chunk(2), EntryIdentity(b"test", OTHER_NS, KEYS[2]))
    raw.set(k[3], bytes(foreign))  # another namespace's chunk under this key
    raw.set(k[4], good)  # chunk 0's entry under chunk 4's key
    raw.set(k[5], bytes(encode(chunk(5), EntryIdentity(b"prod", NS, KEYS[5]))))  # another deployment's
    raw.set(k[6], pickle.dumps({"boom": object.__name__}))  # never unpickled
    raw.set(k[7], b"")
    with caplog.at_level(logging.WARNING, logger="lmcache_platform.remote._tier"):
        got = tier.fetch(NS, KEYS[:8], deadline_in(5000))
    assert got[0] is not None and got[1:] == [None] * 7
    s = tier.stats()
    assert (s["refused_checksum"], s["refused_truncated"], s["refused_namespace"]) == (1, 2, 1)
    assert (s["refused_key"], s["refused_prefix"], s["refused_magic"], s["fetched"]) == (1, 1, 1, 1)
    assert events(caplog, "remote_refused") == 1  # rate-limited: one line for a burst
    assert tier.state == "healthy"


def test_layout_mismatch_is_refused(tier: RemoteTier) -> None:
    fill(tier, 1)
    assert tier.fetch(NS, KEYS[:1], expect=[TensorSpec("float16", (2, 1))]) == [None]
    assert tier.stats()["refused_layout"] == 1


def test_a_keyed_deployment_refuses_unkeyed_and_forged_entries(
    valkey_node: ValkeyNode, tmp_path: Path
) -> None:
    key_file, other = tmp_path / "remote.key", tmp_path / "other.key"
    key_file.write_bytes(b"0123456789abcdef-the-real-deployment-key\n")
    other.write_bytes(b"fedcba9876543210-an-attackers-guess\n")
    keyed = make_tier(valkey_node, key_file=str(key_file))
    plain = make_tier(valkey_node)
    forger = make_tier(valkey_node, key_file=str(other))
    try:
        fill(plain, 1)
        assert keyed.fetch(NS, KEYS[:1]) == [None] and keyed.stats()["refused_auth"] == 1
        fill(forger, 1)
        assert keyed.fetch(NS, KEYS[:1]) == [None] and keyed.stats()["refused_checksum"] == 1
        assert keyed.stats()["removed_refused"] == 2  # deleted (delete_many): never read twice
        assert valkey_node.client().exists(keyed.store_key(NS, KEYS[0])) == 0
        fill(forger, 1)
        assert plain.fetch(NS, KEYS[:1]) == [None] and plain.stats()["refused_auth"] == 1
        fill(keyed, 2)
        assert [c is not None for c in keyed.fetch(NS, KEYS[:2])] == [True, True]
    finally:
        for t in (keyed, plain, forger):
            t.close()
    (tmp_path / "short.key").write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_key_file(str(tmp_path / "short.key"))


# -- failures -------------------------------------------------------------------------------


def test_remote_killed_mid_run_then_back(
    tier: RemoteTier, valkey_node: ValkeyNode, tier_log: pytest.LogCaptureFixture
) -> None:
    fill(tier, 5)
    valkey_node.kill()
    times = []
    for i in range(20):
        hits, t1 = timed(tier.lookup_more, NS, KEYS[:5], deadline_in(200))
        got, t2 = timed(tier.fetch, NS, KEYS[:5], deadline_in(200))
        _, t3 = timed(tier.write_behind, NS, KEYS[10 + i], chunk(i))
        assert hits == 0 and got == [None] * 5
        times += [t1, t2, t3]
    assert tier.state == "down"
    s = tier.stats()
    print(f"\nremote killed: 60 calls, slowest {max(times) * 1e3:.2f} ms; {s}")
    assert s["dropped_down"] >= 19 and s["errors"] >= 1 and s["skipped"] >= 38, s
    assert (s["hits"], s["misses"], s["fetch_misses"]) == (0, 0, 0), s  # a store not asked counts no miss
    assert events(tier_log, "remote_down") == 1, tier_log.text
    valkey_node.restart()  # empty: nothing is persisted
    assert until(lambda: tier.state == "healthy"), tier.stats()
    assert events(tier_log, "remote_up") == 1 and events(tier_log, "remote_down") == 1, tier_log.text
    assert tier.lookup_more(NS, KEYS[:5], deadline_in(1000)) == 0  # the data went with the server
    fill(tier, 2)
    assert tier.lookup_more(NS, KEYS[:5], deadline_in(1000)) == 2


def test_a_hung_remote_costs_each_call_its_deadline_then_nothing(
    tier: RemoteTier, valkey_node: ValkeyNode, tier_log: pytest.LogCaptureFixture
) -> None:
    fill(tier, 3)
    valkey_node.pause()
    try:
        hits, took = timed(tier.lookup_more, NS, KEYS[:3], deadline_in(150))
        assert hits == 0
        assert until(lambda: tier.state == "down", 10), tier.stats()
        later = [timed(tier.lookup_more, NS, KEYS[:3], deadline_in(150))[1] for _ in range(10)]
        print(
            f"\nhung remote: first lookup {took * 1e3:.1f} ms (deadline 150 ms), then {max(later) * 1e3:.2f} ms at most"
        )
        assert tier.stats()["timeouts"] >= 1 and events(tier_log, "remote_down") == 1
    finally:
        valkey_node.resume()
    assert until(lambda: tier.state == "healthy", 10), tier.stats()
    assert tier.lookup_more(NS, KEYS[:3], deadline_in(2000)) == 3


def test_flushall_means_misses_not_failures(tier: RemoteTier, valkey_node: ValkeyNode) -> None:
    fill(tier, 4)
    valkey_node.client().flushall()
    assert tier.lookup_more(NS, KEYS[:4]) == 0
    assert tier.fetch(NS, KEYS[:4]) == [None] * 4
    s = tier.stats()
    assert (s["state"], s["fetch_misses"], s["errors"]) == ("healthy", 4, 0)


def test_a_passed_deadline_skips_the_store(tier: RemoteTier) -> None:
    fill(tier, 2)
    assert tier.lookup_more(NS, KEYS[:2], time.monotonic_ns() - 1) == 0
    assert tier.fetch(NS, KEYS[:2], time.monotonic_ns() - 1) == [None, None]
    assert tier.stats()["deadline_passed"] == 2


# -- capacity -------------------------------------------------------------------------------


def test_maxmemory_with_lru_evicts_old_entries_whole(tmp_path: Path) -> None:
    # Valkey's LRU is sampled (5 keys per eviction by default: an old key may outlive newer
    # ones); 64 samples over these 40 keys make it the exact order this test reads.
    config = ["maxmemory 8mb", "maxmemory-policy allkeys-lru", "maxmemory-samples 64"]
    with ValkeyNode(tmp_path / "lru", config=config) as node:
        tier = make_tier(node)
        try:
            fill(tier, 40, mib=0.5)  # 20 MiB into 8 MiB
            s = tier.stats()
            assert (s["written"], s["write_errors"]) == (40, 0)
            got = tier.fetch(NS, KEYS[:40], deadline_in(10_000))
            kept = [i for i, g in enumerate(got) if g is not None]
            print(f"\nmaxmemory 8mb allkeys-lru: {len(kept)} of 40 half-MiB chunks kept: {kept}")
            assert 0 < len(kept) < 40 and 39 in kept
            assert not any(v for k, v in tier.stats().items() if k.startswith("refused_"))
            assert tier.lookup_more(NS, KEYS[:40]) == 0  # the head of the prefix went first
        finally:
            tier.close()


def test_maxmemory_without_eviction_degrades_the_tier_until_it_takes_writes_again(tmp_path: Path) -> None:
    """A Valkey at ``maxmemory`` with ``noeviction`` refuses writes: counted, the tier degraded
    (its entries still served, writes dropped but a trial), healthy again once it takes one."""
    with ValkeyNode(tmp_path / "full", config=["maxmemory 4mb", "maxmemory-policy noeviction"]) as node:
        tier = make_tier(node)
        try:
            assert tier.write_behind(NS, KEYS[0], chunk(0, 0.05)) and tier.flush(30)
            for key in KEYS[1:20]:
                tier.write_behind(NS, key, chunk(0, 0.5))
            assert tier.flush(30)
            s = tier.stats()
            print(f"\nmaxmemory 4mb noeviction: {s}")
            assert s["write_errors"] >= DEGRADE_AFTER and s["state"] == "degraded"
            assert s["written"] + s["write_errors"] + s["dropped_degraded"] == 20
            assert tier.fetch(NS, [KEYS[0]])[0] is not None  # what it holds is still served
            node.client().config_set("maxmemory", "0")
            trials = (i.to_bytes(4, "big") * 8 for i in itertools.count(1 << 24))

            def heals() -> bool:
                tier.write_behind(NS, next(trials), chunk(0, 0.05))  # taken when a trial is due
                return tier.flush(5) and tier.state == "healthy"

            assert until(heals, 20, interval=0.2), tier.stats()
            assert tier.stats()["state_changes"] == s["state_changes"] + 1
        finally:
            tier.close()


def test_a_full_queue_drops_and_counts_without_blocking(valkey_node: ValkeyNode) -> None:
    tier = make_tier(valkey_node, queue_bytes=4 << 20, write_timeout_s=2.0)
    try:
        valkey_node.pause()  # the writer's batch hangs: the queue fills
        times = []
        for i in range(200):
            _, took = timed(tier.write_behind, NS, bytes([i % 256]) * 32, chunk(i % 4, 0.25))
            times.append(took)
        s = tier.stats()
        times.sort()
        print(
            f"\nqueue of 4 MiB, store hung: 200 write_behind calls, median {times[100] * 1e6:.1f} us, "
            f"max {times[-1] * 1e6:.1f} us; queued {s['queued']}, dropped_full {s['dropped_full']}"
        )
        assert s["dropped_full"] >= 150 and s["queued"] + s["dropped_full"] == 200
    finally:
        valkey_node.resume()
        tier.close()


def test_ttl_lets_the_store_forget(valkey_node: ValkeyNode) -> None:
    tier = make_tier(valkey_node, ttl_s=1.0)
    try:
        fill(tier, 2)
        assert tier.lookup_more(NS, KEYS[:2]) == 2
        assert 0 < valkey_node.client().pttl(tier.store_key(NS, KEYS[0])) <= 1000
        assert until(lambda: tier.lookup_more(NS, KEYS[:2]) == 0, 15)
    finally:
        tier.close()


# -- figures (printed, never asserted) ------------------------------------------------------------


def _socket_copy_mib_s(payload: bytes, rounds: int = 3) -> float:
    """The same bytes over a plain loopback TCP socket into a preallocated buffer: the floor to compare with."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1):
                conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    best = 0.0
    with socket.create_connection(server.getsockname()) as s:
        buf = memoryview(bytearray(len(payload)))
        for _ in range(rounds):
            started = time.perf_counter()
            s.sendall(b"x")
            got = 0
            while got < len(payload):
                got += s.recv_into(buf[got:], len(payload) - got)
            best = max(best, len(payload) / (1 << 20) / (time.perf_counter() - started))
    server.close()
    return best


def test_figures(tier: RemoteTier) -> None:
    lines = []
    fill(tier, 40, mib=0.0625)
    for n in (1, 32, 40):
        samples = sorted(timed(tier.lookup_more, NS, KEYS[:n], deadline_in(1000))[1] for _ in range(100))
        lines.append(
            f"lookup_more of {n} keys: median {samples[50] * 1e6:.0f} us, p90 {samples[90] * 1e6:.0f} us"
        )
    for mib in (4, 64):
        key = b"\xee" * 32
        tier.write_behind(NS, key, [torch.randn(mib << 18)])
        assert tier.flush(60)
        store_key = tier.store_key(NS, key)
        raw = [timed(tier.store.get_many, [store_key], timeout=30)[1] for _ in range(3)]
        full = [timed(tier.fetch, NS, [key], deadline_in(30_000))[1] for _ in range(3)]
        (entry,) = tier.store.get_many([store_key], timeout=30)
        assert entry is not None
        floor = _socket_copy_mib_s(bytes(entry))
        lines.append(
            f"{mib} MiB chunk: store get {mib / min(raw):.0f} MiB/s, fetch (get + check + views) "
            f"{mib / min(full):.0f} MiB/s; a loopback socket copy of the same bytes {floor:.0f} MiB/s"
        )
    keys = [bytes([0xF0 + i]) * 32 for i in range(4)]
    for key in keys:
        tier.write_behind(NS, key, [torch.randn(16 << 18)])
    assert tier.flush(60)
    store_keys = [tier.store_key(NS, k) for k in keys]
    raw = [timed(tier.store.get_many, store_keys, timeout=30)[1] for _ in range(3)]
    full = [timed(tier.fetch, NS, keys, deadline_in(30_000))[1] for _ in range(3)]
    lines.append(
        f"4 chunks of 16 MiB in one fetch: store get {64 / min(raw):.0f} MiB/s, "
        f"fetch {64 / min(full):.0f} MiB/s ({tier.decode_threads} decoder threads)"
    )
    print("\n" + "\n".join(lines))


def test_lookup_over_several_namespaces_is_one_round_trip(tier: RemoteTier) -> None:
    fill(tier, 6)
    fill(tier, 3, namespace=OTHER_NS)
    assert tier.lookup_more_many([(NS, KEYS[2:8]), (OTHER_NS, KEYS[1:8]), (b"\x09" * 32, [])]) == [4, 2, 0]
    assert tier.stats()["lookups"] == 1

"""The remote tier on a three-node Valkey Cluster: keys spread, and a dead node costs only its keys."""

from __future__ import annotations

import time

import torch

from lmcache_platform.remote._tier import RemoteTier
from support.valkey import ValkeyCluster

NS = bytes(range(32))
KEYS = [bytes([i]) * 32 for i in range(1, 61)]


def chunk(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 1024, generator=g)]


def test_keys_spread_and_a_dead_node_costs_only_its_chunks(valkey_cluster: ValkeyCluster) -> None:
    tier = RemoteTier.open(valkey_cluster.url, prefix="c1", retry_first_s=0.2)
    try:
        assert tier.wait_ready(10), tier.stats()
        for i, key in enumerate(KEYS):
            assert tier.write_behind(NS, key, chunk(i))
        assert tier.flush(30)
        per_node = [int(n.client().dbsize()) for n in valkey_cluster.nodes]
        print(f"\n60 chunks over 3 primaries: {per_node}")
        assert sum(per_node) == 60 and min(per_node) > 0
        assert tier.lookup_more(NS, KEYS) == 60

        victim = valkey_cluster.nodes[1]
        lost = {i for i, k in enumerate(KEYS) if valkey_cluster.node_of(tier.store_key(NS, k)) is victim}
        victim.kill()
        started = time.perf_counter()
        got = tier.fetch(NS, KEYS, time.monotonic_ns() + 2_000_000_000)
        took = time.perf_counter() - started
        assert {i for i, g in enumerate(got) if g is None} == lost
        for i, g in enumerate(got):
            if g is not None:
                assert torch.equal(g.tensors[0], chunk(i)[0])
        first_lost = min(lost)
        assert tier.lookup_more(NS, KEYS, time.monotonic_ns() + 2_000_000_000) == first_lost
        s = tier.stats()
        print(f"one primary killed: fetch of 60 took {took * 1e3:.1f} ms, {len(lost)} lost; {s}")
        assert s["state"] == "healthy" and s["errors"] >= 2 * len(lost) and s["fetched"] == 60 - len(lost)
        assert s["fetch_misses"] == 0  # the lost chunks count as errors, not as misses

        other = b"\x07" * 32
        unwritable = sum(valkey_cluster.node_of(tier.store_key(other, k)) is victim for k in KEYS)
        for i, key in enumerate(KEYS):  # writes go on: the live nodes take theirs
            tier.write_behind(other, key, chunk(i))
        assert tier.flush(30)
        s = tier.stats()
        assert s["written"] == 60 + 60 - unwritable and s["write_errors"] == unwritable, s
    finally:
        tier.close()

"""Case 6: the reference server under load from 8 engine processes.

Each client (a spawned process, ``support.reliability_workers.load_client``) wraps a small model,
registers it, then alternates store and retrieve requests, writing fresh random
bytes before every store and comparing every retrieved byte with what it stored.
The server is a real spawned :class:`lmcache_platform.server.ServerProcess`.
Leaks are judged on the server process from ``/proc``: fds, /dev/shm mappings,
threads and RSS after all clients are gone, against a baseline taken after a
warm-up client; and on the clients' segments in /dev/shm.

CI runs 8 x 1,000 requests of 8 KiB chunks; ``LMCACHE_SOAK=1`` runs 8 x 10,000 of 64 KiB.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_platform.server import ServerClient, ServerProcess
from support.reliability import Resources, Workers, describe, emit, segments_of, sized

CLIENTS = 8
REQUESTS = sized(1_000, 10_000)
#: Model per client: CI 4 layers with head size 16 (8 KiB chunks); soak 8 x 64 (64 KiB chunks).
LAYERS, HEAD = sized(4, 8), sized(16, 64)
RSS_SLACK = 32 << 20


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(max_host_bytes=64 << 20) as proc:
        yield proc


def run_clients(
    server: ServerProcess, n: int, requests: int, pids: set[int]
) -> tuple[list[dict[str, Any]], float]:
    """Start ``n`` clients, release them together, collect their reports; return them and the wall time."""
    from support.reliability_workers import load_client

    args = [(server.socket_path, i, requests, 1000 + i, LAYERS, HEAD) for i in range(n)]
    with Workers(load_client, args, pids) as clients:
        return clients.release(timeout=1800)


def settle(
    server: ServerProcess, pid: int, threads: int | None = None
) -> tuple[dict[str, Any], Resources, int]:
    """Wait (bounded) until the server counts only the measuring connection; then measure.

    The server closes a connection's socket before it stops counting it, so
    ``connections == 1`` means every other client's fd is gone. Its thread ends a
    moment later: with ``threads`` (the baseline) given, wait until the count is
    back to it; without, until the count has held still. The measuring connection's
    socket and thread are counted every time, so the figures compare like with like.
    Returns the status, the resources and the thread count.
    """
    with ServerClient(server.socket_path, timeout=30) as c:
        for _ in range(600):
            status = c.status()["server"]
            if status["connections"] == 1:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"connections still open after 30 s: {status}")
        now = threads_of(pid)
        for _ in range(500):
            time.sleep(0.02)
            before, now = now, threads_of(pid)
            if (now <= threads) if threads is not None else (now == before):
                break
        return status, Resources.of(pid), now


def warm_up(server: ServerProcess) -> None:
    """A few requests from this process, so the baseline excludes the server's first-use costs."""
    import torch

    import lmcache_platform as lp
    from lmcache_platform import KVFormat, LayoutHints

    tensors = [torch.ones(2, 8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    wrappers = lp.wrap_kv_caches(tensors)
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=4, num_kv_heads=2)
    with ServerClient(server.socket_path, timeout=30) as c:
        ctx = c.register(wrappers, lmcache_tokens_per_chunk=8, layout_hints=hints).context
        for i in range(20):
            c.store(ctx, [(f"w{i % 4}", [[0, 1]])])
            c.retrieve(ctx, [(f"w{i % 4}", [[2, 3]])])
        c.unregister(ctx)
    for w in wrappers:
        w.close()


def test_eight_engines_hammer_the_server_without_errors_leaks_or_corruption(
    server: ServerProcess, child_pids: set[int], request: pytest.FixtureRequest
) -> None:
    pid = server.pid
    assert pid is not None
    warm_up(server)  # first-use allocations of the server are not leaks
    base_status, before, threads = settle(server, pid)

    reports, wall = run_clients(server, CLIENTS, REQUESTS, child_pids)

    status, after, threads_after = settle(server, pid, threads)
    errors = [e for r in reports for e in r["errors"]]
    assert errors == [] and sum(r["error_count"] for r in reports) == 0, errors
    assert sum(r["mismatches"] for r in reports) == 0
    assert all(r["stores"] + r["retrieves"] == REQUESTS for r in reports)
    assert base_status["contexts"] == status["contexts"] == 0
    assert status["chunks"] == 0 and status["host_bytes"] == 0
    d = before.delta(after)
    assert (d["fds"], d["shm_maps"]) == (0, 0), describe(before, after)
    assert d["rss"] < RSS_SLACK, describe(before, after)
    assert threads_after <= threads, (threads, threads_after)
    assert segments_of(child_pids) == []  # every client's segments went with it

    total = CLIENTS * REQUESTS
    moved = sum(r["bytes"] for r in reports)
    emit(
        request,
        "6 load",
        f"{CLIENTS} clients x {REQUESTS:,} requests ({sum(r['stores'] for r in reports):,} stores, "
        f"{sum(r['retrieves'] for r in reports):,} retrieves) in {wall:.2f} s: {total / wall:,.0f} requests/s, "
        f"{moved / wall / 1e9:.3f} GB/s of chunk data ({moved / 2**20:.1f} MiB), 0 errors, 0 mismatches; "
        f"server {describe(before, after)}, connection threads all exited",
        requests_per_s=total / wall,
        gb_per_s=moved / wall / 1e9,
    )

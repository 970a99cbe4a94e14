"""Case 8: the server as a shared cache under load from several engine processes.

Engines are spawned processes (``support.cache_workers``) registered in one namespace,
so they share every chunk. A chunk's bytes are a function of its key, so any engine
checks any chunk it loads, whoever stored it.

* 8.1 mixed load under eviction pressure: random puts, gets and lookups of runs of
  keys, with a memory cap a quarter of the key universe: no error, no torn or stale
  chunk, no write past the first missing key; the byte accounting matches.
* 8.2 nothing lost: every engine stores its own keys and a common prefix at once,
  then loads every key any engine stored: all there, all exact, the common prefix
  copied once.
* 8.3 parallel versus one lock: the same engine processes load 2 MiB chunks from a
  server with per-context transfer locks and from one that serializes every transfer
  (the old behaviour), in alternating rounds; the figures are printed, not asserted.

CI sizes are small; ``LMCACHE_SOAK=1`` runs ten times the requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_platform.server import ServerClient, ServerProcess, cache_namespace
from support import commands
from support.cache_workers import Model, mixed_client, reader_client, store_then_load_client
from support.reliability import Workers, emit, segments_of, sized

SMALL = dict(layers=4, heads=2, head=32, block=4, chunk=8, blocks=64)  # 16 KiB chunks, 16 slots
BIG = dict(layers=8, heads=8, head=128, block=16, chunk=64, blocks=64)  # 2 MiB chunks, 16 slots
SMALL_CHUNK_BYTES, BIG_CHUNK_BYTES = Model(**SMALL).chunk_bytes, Model(**BIG).chunk_bytes


def ns(name: str, model: dict[str, int]) -> str:
    return cache_namespace(
        model=name,
        kv_layout=json.dumps(model, sort_keys=True),
        dtype="bfloat16",
        block_size=model["block"],
        chunk_size=model["chunk"],
    ).hex()


def server_counters(server: ServerProcess) -> dict[str, Any]:
    with ServerClient(server.socket_path, timeout=60) as c:
        return dict(c.status()["server"])


@pytest.fixture(autouse=True)
def no_client_segments(child_pids: set[int]) -> Iterator[None]:
    """After each test: every engine's shared-memory segments went with it."""
    yield
    assert segments_of(child_pids) == []  # every engine's segments went with it


# -- 8.1 ------------------------------------------------------------------------------------------

CLIENTS = 6
REQUESTS = sized(300, 3_000)
UNIVERSE = 64


def test_mixed_load_under_eviction_pressure_tears_nothing(
    child_pids: set[int], request: pytest.FixtureRequest
) -> None:
    cap = UNIVERSE // 4 * SMALL_CHUNK_BYTES
    namespace = ns("8.1", SMALL)
    specs = [
        {"model": SMALL, "seed": 700 + i, "universe": UNIVERSE, "requests": REQUESTS, "namespace": namespace}
        for i in range(CLIENTS)
    ]
    with ServerProcess(max_host_bytes=cap) as server:
        with Workers(mixed_client, [(server.socket_path, spec) for spec in specs], child_pids) as clients:
            reports, wall = clients.release()
        status = server_counters(server)
    errors = [e for r in reports for e in r["errors"]]
    assert errors == [], errors[:5]
    assert sum(r["mismatches"] for r in reports) == 0, "a loaded chunk was torn, stale or misplaced"
    total = {
        k: sum(r[k] for r in reports)
        for k in ("puts", "gets", "lookups", "stored", "present", "dropped", "retrieved", "hits")
    }
    assert total["puts"] + total["gets"] + total["lookups"] == CLIENTS * REQUESTS
    # the server's counters agree with what the engines saw
    assert status["stored"] == total["stored"] and status["present"] == total["present"]
    assert status["retrieved"] == total["retrieved"]
    assert status["evictions"] > 0 and total["retrieved"] > 0  # the load did hit both paths
    assert status["chunks"] == total["stored"] - status["evictions"]
    assert status["host_bytes"] == status["chunks"] * SMALL_CHUNK_BYTES <= cap
    assert (status["contexts"], status["pinned"]) == (0, 0)
    emit(
        request,
        "8.1 cache load",
        f"{CLIENTS} engines x {REQUESTS:,} requests in {wall:.2f} s ({CLIENTS * REQUESTS / wall:,.0f} requests/s): "
        f"{total['puts']:,} puts ({total['stored']:,} chunks stored, {total['present']:,} already present, "
        f"{total['dropped']:,} dropped), {total['gets']:,} gets ({total['retrieved']:,} chunks loaded and checked), "
        f"{total['lookups']:,} lookups; {status['evictions']:,} evictions under a cap of {cap // SMALL_CHUNK_BYTES} "
        f"chunks; 0 errors, 0 torn chunks",
        requests_per_s=CLIENTS * REQUESTS / wall,
        evictions=status["evictions"],
    )


# -- 8.2 ------------------------------------------------------------------------------------------

OWN_KEYS = sized(24, 240)
COMMON = 8


def test_concurrent_stores_lose_nothing_and_copy_a_shared_prefix_once(
    child_pids: set[int], request: pytest.FixtureRequest
) -> None:
    namespace = ns("8.2", SMALL)
    common = list(range(COMMON))
    own = [list(range(1000 * (i + 1), 1000 * (i + 1) + OWN_KEYS)) for i in range(CLIENTS)]
    everyone = common + [k for keys in own for k in keys]
    specs = [
        {"model": SMALL, "namespace": namespace, "keys": common + own[i], "all_keys": everyone}
        for i in range(CLIENTS)
    ]
    with ServerProcess(max_host_bytes=2 * len(everyone) * SMALL_CHUNK_BYTES) as server:
        args = [(server.socket_path, spec) for spec in specs]
        with Workers(store_then_load_client, args, child_pids) as clients:
            assert all(r == {"ready": True} for r in clients.gather())
            started = clients.go()
            assert all(r == {"stored": True} for r in clients.gather())
            stored_s = time.perf_counter() - started
            clients.go()
            reports = clients.gather()
            clients.join()
        status = server_counters(server)
    errors = [e for r in reports for e in r["errors"]]
    assert errors == [], errors[:5]
    assert sum(r["dropped"] for r in reports) == 0
    assert sum(r["stored"] for r in reports) == len(everyone), "a key was stored twice, or not at all"
    assert sum(r["present"] for r in reports) == (CLIENTS - 1) * COMMON
    assert [r["retrieved"] for r in reports] == [len(everyone)] * CLIENTS and sum(
        r["missing"] for r in reports
    ) == 0
    assert sum(r["mismatches"] for r in reports) == 0
    assert (status["chunks"], status["evictions"]) == (len(everyone), 0)
    emit(
        request,
        "8.2 nothing lost",
        f"{CLIENTS} engines stored {len(everyone):,} distinct chunks at once ({COMMON} common to all, "
        f"copied once; {(CLIENTS - 1) * COMMON} puts found them present) in {stored_s:.2f} s; every engine "
        f"then loaded all {len(everyone):,}: 0 missing, 0 mismatched",
    )


# -- 8.3 ------------------------------------------------------------------------------------------

READERS = 4
READS = sized(40, 400)
READ_CHUNKS, PER_REQUEST = 6, 2
ROUNDS = 3


def test_loads_of_different_engines_in_parallel_and_serialized(
    child_pids: set[int], request: pytest.FixtureRequest
) -> None:
    cap = READERS * READ_CHUNKS * BIG_CHUNK_BYTES
    namespace = ns("8.3", BIG)
    specs = [
        {
            "model": BIG,
            "namespace": namespace,
            "first_key": 100 * i,
            "chunks": READ_CHUNKS,
            "per_request": PER_REQUEST,
            "requests": READS,
        }
        for i in range(READERS)
    ]
    modes = ("per-context locks", "one lock")
    walls: dict[str, list[float]] = {m: [] for m in modes}
    with (
        ServerProcess(max_host_bytes=cap) as par,
        ServerProcess(max_host_bytes=cap, parallel_transfers=False) as ser,
    ):
        args = [([par.socket_path, ser.socket_path], spec) for spec in specs]
        with Workers(reader_client, args, child_pids) as clients:
            assert all(r == {"ready": True} for r in clients.gather())
            for _ in range(ROUNDS):  # alternate, so a busy moment of the machine hits both
                for i, mode in enumerate(modes):
                    started = clients.go(commands.message("read", {"server": i}))
                    reports = [commands.result_of("read", r) for r in clients.gather()]
                    walls[mode].append(time.perf_counter() - started)
                    assert sum(r["error_count"] for r in reports) == 0, [
                        e for r in reports for e in r["errors"]
                    ]
                    assert sum(r["mismatches"] for r in reports) == 0
                    assert sum(r["bytes"] for r in reports) == READERS * READS * PER_REQUEST * BIG_CHUNK_BYTES
            clients.go(commands.message("exit"))
            assert all(r["ok"] for r in clients.gather())
            clients.join()
        status = [server_counters(s) for s in (par, ser)]
    assert [s["parallel_transfers"] for s in status] == [True, False]
    assert [s["evictions"] for s in status] == [0, 0]
    moved = READERS * READS * PER_REQUEST * BIG_CHUNK_BYTES
    best = {m: min(w) for m, w in walls.items()}
    figures = "; ".join(
        f"{m}: best {moved / best[m] / 1e9:.2f} GB/s ({READERS * READS / best[m]:,.0f} requests/s), rounds "
        + ", ".join(f"{moved / w / 1e9:.2f}" for w in walls[m])
        for m in modes
    )
    emit(
        request,
        "8.3 parallel loads",
        f"{READERS} engines x {READS} gets of {PER_REQUEST} x {BIG_CHUNK_BYTES >> 20} MiB chunks, {ROUNDS} "
        f"alternating rounds per server: {figures}; parallel/serialized {best[modes[1]] / best[modes[0]]:.2f}x; "
        f"0 mismatches",
        best_gb_per_s={m: moved / best[m] / 1e9 for m in modes},
    )

"""Prefill/decode roles and KV-cache events with real vLLM engines (issue 30, items 4 and 5).

Roles: a prefill engine (``kv_role="kv_producer"``) and a decode engine
(``kv_consumer``) share one real ``lmcache-platform serve``, as a P/D deployment
would. The decode engine loads what the prefill engine stored and gives the prefill
engine's own prefix-cache-hit output; the producer never looks up or loads; the
consumer never stores.

Events: an engine with vLLM's KV-event publisher on (ZMQ over a private IPC socket)
and a subscriber (``support.kv_events``, decoding with vLLM's ``KVEventBatch`` as a
router would). The connector's ``BlockStored`` events have medium ``"CPU"`` and name
the same block hashes as vLLM's own ``"GPU"`` events for the prompt; when the server
evicts those chunks (a server with room for a few), ``BlockRemoved`` with medium
``"CPU"`` follows for exactly those hashes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support import vllm_driver as drv
from support.kv_events import Subscriber
from support.vllm_driver import Lab, brief, connected, connector_tokens, expect, prompt, same, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-roles")]

#: The gqa model's chunk in the server: 256 tokens x 4 layers x K and V x 2 heads x 64 x bf16.
CHUNK_BYTES = 256 * 4 * 2 * 2 * 64 * 2


def test_the_decode_engine_loads_what_the_prefill_engine_stored(lab: Lab) -> None:
    server = lab.server("roles")
    producer = lab.engine("roles-prefill", with_role(connected("gqa", server), "kv_producer"))
    consumer = lab.engine("roles-decode", with_role(connected("gqa", server), "kv_consumer"))
    p = prompt(tokens(drv.L3, 61))
    before = int(server.status()["chunks"])
    prefill = producer.cold(p)
    stored = _wait(lambda: int(server.status()["chunks"]) - before, 3)
    local_hit = producer.run(p)  # the producer's own prefix-cache hit: the reference
    producer.reset_prefix_cache()
    again = producer.run(p)  # the server holds it, yet a producer never loads
    decode = consumer.cold(p)
    fresh = consumer.cold(prompt(tokens(drv.L3, 62)))
    after_fresh = int(server.status()["chunks"])
    p_stats, d_stats = producer.stats()["counters"], consumer.stats()["counters"]
    observed = {
        "stored": stored,
        "prefill": brief(prefill),
        "again": brief(again),
        "decode": brief(decode),
        "fresh": brief(fresh),
        "chunks_after_fresh": after_fresh,
        "producer": p_stats,
        "consumer": d_stats,
    }
    expect(
        observed,
        producer_stored=stored == 3,
        producer_never_looks_up=p_stats["lookups"] == 0 and connector_tokens(again) == 0,
        producer_output_unchanged=same(again, prefill),
        consumer_loaded=connector_tokens(decode) == 3 * 256 and decode["cached"] == 3 * 256,
        consumer_equal_to_a_hit=same(decode, local_hit),
        consumer_never_stores=after_fresh == before + 3 and d_stats["stored_chunks"] == 0,
    )


@pytest.fixture
def published(lab: Lab, tmp_path: Path) -> Iterator[tuple[Any, Any, Subscriber]]:
    """A server with room for 4 chunks, an engine publishing KV events, and a subscriber."""
    server = lab.server("events", max_host_bytes=4 * CHUNK_BYTES)
    endpoint = f"ipc://{tmp_path}/kv-events"
    subscriber = Subscriber(endpoint, tmp_path / "events.jsonl")
    try:
        engine = lab.engine(f"events-{tmp_path.name}", connected("gqa", server, kv_events_endpoint=endpoint))
        subscriber.wait_connected()
        time.sleep(1.0)  # ZMQ's subscription reaches the publisher a moment after the connect
        yield server, engine, subscriber
    finally:
        lab.retire(f"events-{tmp_path.name}")
        subscriber.close()


def test_stored_and_evicted_chunks_reach_a_router_with_our_medium(published: Any) -> None:
    server, engine, subscriber = published
    p = prompt(tokens(drv.L3, 63))
    engine.cold(p)
    seen = subscriber.wait(lambda ev: _ours(ev, "BlockStored"))
    stored = _ours(seen, "BlockStored")
    ours = [h for e in stored for h in e["block_hashes"]]
    gpu = [h for e in seen if e["type"] == "BlockStored" and e["medium"] != "CPU" for h in e["block_hashes"]]
    # Other prompts fill the server (room for four chunks): the first prompt's chunks go.
    for seed in (64, 65):
        engine.cold(prompt(tokens(drv.L3, seed)))
    # vLLM collects the connector's events on its steps only: short requests (nothing stored)
    # give it steps until the last eviction was read.
    removed: list[Any] = []
    for seed in range(70, 80):
        seen = subscriber.wait(
            lambda ev: set(ours) <= {h for e in _ours(ev, "BlockRemoved") for h in e["block_hashes"]}, 3
        )
        removed = [h for e in _ours(seen, "BlockRemoved") for h in e["block_hashes"]]
        if set(ours) <= set(removed):
            break
        engine.run(prompt(tokens(16, seed)))
    observed = {
        "stored_events": len(stored),
        "stored_hashes": len(ours),
        "stored_tokens": sum(len(e["token_ids"]) for e in stored),
        "gpu_hashes": len(gpu),
        "removed_hashes": len(removed),
        "server": server.status(),
        "types": sorted({(e["type"], e["medium"]) for e in seen}),
    }
    expect(
        observed,
        stored_three_chunks=sum(len(e["token_ids"]) for e in stored) == 3 * 256,
        hashes_are_vllms=bool(ours) and set(ours) <= set(gpu),
        first_prompt_removed=bool(ours) and set(ours) <= set(removed),  # later prompts evict too
    )


def with_role(spec: dict[str, Any], role: str) -> dict[str, Any]:
    return {**spec, "connector": {**spec["connector"], "role": role}}


def _ours(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind and e["medium"] == "CPU"]


def _wait(measure: Any, want: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while True:
        got = int(measure())
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)

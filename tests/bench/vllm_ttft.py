"""Time to first token with and without the connector's hit, on a real vLLM CPU engine.

Run with the vLLM virtualenv's Python (``make bench-vllm``)::

    .venv-vllm/bin/python tests/bench/vllm_ttft.py [--prompt-tokens 2048] [--prompts 3] [--json]

A Qwen2-style model of 8 layers, hidden size 1024 (16 heads over 8 KV heads of 64,
seeded Kaiming-scale dummy weights), so that prefill dominates on 2 cores. Engine A
computes and stores ``--prompts`` distinct prompts through ``lmcache-platform serve``;
engine B, a fresh process, runs each once (every one a first sight for B: its KV comes
from the server); engine C, a fresh process without a connector, recomputes them.
Each engine warms up on an unrelated prompt first. Time to first token is one
``generate`` with ``max_tokens=1``. Also reported: the bytes loaded, the connector's
load bandwidth and ``copy_`` of the same bytes in B's process.

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 8,
    "head_dim": 64,
    "use_sliding_window": False,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
CHUNK = 256


def prompt(seed: int, n: int) -> list[int]:
    return [(i * (31 + 2 * seed) + 7 * seed) % 4000 + 1 for i in range(n)]


def engine(spec: dict) -> None:
    """One engine (a child process): warm up, run the prompts, print one JSON line each."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    import torch
    from engine_check import sensitive_weights
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(MODEL))
        transfer = None
        if spec["socket"]:
            transfer = KVTransferConfig(
                kv_connector="ProbeConnector",
                kv_connector_module_path="probe_connector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "socket": spec["socket"],
                    "tokens_per_chunk": CHUNK,
                    "model_id": "bench ttft",
                },
            )
        llm = LLM(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            kv_cache_memory_bytes=512 << 20,
            max_model_len=8192,
            max_num_batched_tokens=8192,
            enforce_eager=True,
            enable_prefix_caching=True,
            seed=0,
            kv_transfer_config=transfer,
        )
        llm.apply_model(sensitive_weights)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([TokensPrompt(prompt_token_ids=prompt(99, spec["tokens"]))], one, use_tqdm=False)
        import probe_connector

        for ids in spec["prompts"]:
            before = {
                k: sum(c.stats[k] for c in probe_connector.INSTANCES)
                for k in ("loaded_bytes", "load_seconds")
            }
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], one, use_tqdm=False)[0]
            ttft = time.perf_counter() - t0
            moved = {k: sum(c.stats[k] for c in probe_connector.INSTANCES) - v for k, v in before.items()}
            copy_gbps = 0.0
            if moved["loaded_bytes"]:
                src = torch.empty(int(moved["loaded_bytes"]), dtype=torch.uint8).fill_(1)
                dst = torch.empty_like(src).fill_(2)
                t1 = time.perf_counter()
                dst.copy_(src)
                copy_gbps = src.numel() / (time.perf_counter() - t1) / 1e9
            print(
                json.dumps(
                    {
                        "ttft_s": ttft,
                        "cached": int(out.num_cached_tokens or 0),
                        **moved,
                        "copy_gbps": copy_gbps,
                    }
                ),
                flush=True,
            )


def run_engine(spec: dict) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, __file__, "--engine", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"engine failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"ttft_s"')]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048 + 17)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine(json.loads(args.engine))
        return
    prompts = [prompt(i, args.prompt_tokens) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        sock = os.path.join(tmp, "server.sock")
        server = subprocess.Popen(
            [sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", sock],
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
        )
        try:
            while not os.path.exists(sock):
                time.sleep(0.1)
            base = {"tokens": args.prompt_tokens, "prompts": prompts}
            run_engine({**base, "socket": sock})  # A: computes and stores
            hit = run_engine({**base, "socket": sock})  # B: loads
            cold = run_engine({**base, "socket": None})  # C: recomputes, no connector
        finally:
            server.terminate()
            server.wait(30)
    loaded = statistics.median(r["loaded_bytes"] for r in hit)
    load_gbps = statistics.median(
        r["loaded_bytes"] / r["load_seconds"] / 1e9 for r in hit if r["load_seconds"]
    )
    result = {
        "model": "qwen2-style, 8 layers, hidden 1024, 8 KV heads x 64, bf16",
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "ttft_recompute_s": statistics.median(r["ttft_s"] for r in cold),
        "ttft_hit_s": statistics.median(r["ttft_s"] for r in hit),
        "hit_cached_tokens": statistics.median(r["cached"] for r in hit),
        "loaded_bytes": loaded,
        "load_gbps": load_gbps,
        "copy_gbps": statistics.median(r["copy_gbps"] for r in hit),
    }
    result["ttft_ratio"] = result["ttft_hit_s"] / result["ttft_recompute_s"]
    result["load_vs_copy"] = result["load_gbps"] / result["copy_gbps"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"vLLM time to first token, {result['model']}, {args.prompt_tokens}-token prompts "
        f"(median of {args.prompts}):"
    )
    print(f"  recompute (no connector)    {result['ttft_recompute_s'] * 1e3:8.1f} ms")
    print(
        f"  connector hit               {result['ttft_hit_s'] * 1e3:8.1f} ms   "
        f"({result['hit_cached_tokens']:.0f} tokens loaded, {loaded / 2**20:.1f} MiB)"
    )
    print(f"  ratio                       {result['ttft_ratio']:8.2f}   (goal <= 0.30)")
    print(
        f"  load bandwidth              {load_gbps:8.2f} GB/s   copy_ of the same bytes "
        f"{result['copy_gbps']:.2f} GB/s ({result['load_vs_copy']:.2f} x)"
    )


if __name__ == "__main__":
    main()

"""Time to first token with and without the connector's hit, on a real vLLM CPU engine.

Run with the vLLM virtualenv's Python (``make bench-vllm``)::

    PYTHONPATH=tests .venv-vllm/bin/python -m bench.vllm_ttft [--prompt-tokens 2048] [--prompts 3] [--json]

A Qwen2-style model of 8 layers, hidden size 1024 (16 heads over 8 KV heads of 64,
seeded Kaiming-scale dummy weights), so that prefill dominates on 2 cores. Engine A
computes and stores ``--prompts`` distinct prompts through ``lmcache-platform serve``;
engine B, a fresh process, runs each once (every one a first sight for B: its KV comes
from the server); engine C, a fresh process without a connector, recomputes them.
Each engine is a process of ``support.vllm_driver`` and warms up on an unrelated prompt
first. Time to first token is one ``generate`` with ``max_tokens=1``, timed in the engine
process. Also reported: the bytes loaded, the connector's load bandwidth and ``copy_`` of
the same bytes in this process.

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from support.vllm_driver import start_engine

ROOT = Path(__file__).resolve().parents[2]

#: The model: the ``gqa`` kind of ``support.vllm_models``, resized (its ``config.json`` overrides).
SIZES: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 8,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
}
CHUNK = 256


def prompt(seed: int, n: int) -> list[int]:
    return [(i * (31 + 2 * seed) + 7 * seed) % 4000 + 1 for i in range(n)]


def run_engine(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One fresh engine (``support.vllm_driver``): each of ``spec["prompts"]`` once, timed.

    ``spec``: ``socket`` (null: no connector), ``tokens`` (the warm-up prompt's length),
    ``prompts``, ``model_id``. The engine warms up on an unrelated prompt first; then per
    prompt one ``generate`` with ``max_tokens=1`` (``ttft_s``, timed in the engine
    process), its cached tokens and the bytes and seconds the connector loaded for it.
    """
    connector = None
    if spec["socket"]:
        connector = {"socket": spec["socket"], "model_id": spec.get("model_id", "bench ttft")}
        wait_contexts(spec["socket"], lambda n: n == 0)  # the engine before this one has gone
    engine = start_engine(
        {
            "model": "gqa",
            "config": SIZES,
            "kv_cache_memory_bytes": 512 << 20,
            "max_model_len": 8192,
            "max_num_batched_tokens": 8192,
            "connector": connector,
        },
        name="bench",
        timeout=1800,
    )
    try:
        if spec["socket"]:  # its workers registered: a request before that neither loads nor stores
            wait_contexts(spec["socket"], lambda n: n >= 1)
        engine.run({"ids": prompt(99, spec["tokens"])}, max_tokens=1, logprobs=None, timeout=1800)
        out = []
        for ids in spec["prompts"]:
            before = engine.stats()["counters"]
            result = engine.run({"ids": ids}, max_tokens=1, logprobs=None, timeout=1800)
            after = engine.stats()["counters"]
            moved = {k: after.get(k, 0) - before.get(k, 0) for k in ("loaded_bytes", "load_seconds")}
            out.append({"ttft_s": result["seconds"], "cached": result["cached"], **moved})
        return out
    finally:
        engine.close()


def wait_contexts(socket: str, ok: Callable[[int], bool], timeout: float = 120) -> None:
    """Until the server at ``socket`` holds a number of contexts ``ok`` accepts (bounded)."""
    from lmcache_platform.client import ServerClient

    deadline = time.monotonic() + timeout
    with ServerClient(socket, timeout=10) as client:
        while not ok(int(client.status()["server"]["contexts"])):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the server at {socket}: contexts still {client.status()['server']['contexts']}"
                )
            time.sleep(0.1)


def copy_gbps(nbytes: int) -> float:
    """``copy_`` of ``nbytes`` between two tensors already touched, in this process."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(2)
    t0 = time.perf_counter()
    dst.copy_(src)
    return nbytes / (time.perf_counter() - t0) / 1e9


def arguments(doc: str | None) -> argparse.ArgumentParser:
    """The flags every time-to-first-token benchmark has: ``--prompt-tokens``, ``--prompts``, ``--json``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048 + 17)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    return parser


def prompts_of(args: argparse.Namespace) -> list[list[int]]:
    return [prompt(i, args.prompt_tokens) for i in range(args.prompts)]


@contextlib.contextmanager
def work_dir() -> Iterator[Path]:
    """A temporary directory only this user may enter: it holds the servers' sockets."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        yield Path(tmp)


def medians(args: argparse.Namespace, **runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The model, the prompts and each run's median time to first token (``ttft_<run>_s``)."""
    return {
        "model": "qwen2-style, 8 layers, hidden 1024, 8 KV heads x 64, bf16",
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        **{f"ttft_{name}_s": statistics.median(r["ttft_s"] for r in rs) for name, rs in runs.items()},
    }


def load_gbps(runs: list[dict[str, Any]]) -> float:
    """The connector's median load bandwidth over the runs that loaded."""
    return statistics.median(r["loaded_bytes"] / r["load_seconds"] / 1e9 for r in runs if r["load_seconds"])


def main() -> None:
    args = arguments(__doc__).parse_args()
    prompts = prompts_of(args)
    with work_dir() as work:
        sock = str(work / "server.sock")
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
    result = {
        **medians(args, recompute=cold, hit=hit),
        "hit_cached_tokens": statistics.median(r["cached"] for r in hit),
        "loaded_bytes": loaded,
        "load_gbps": load_gbps(hit),
        "copy_gbps": statistics.median(copy_gbps(int(r["loaded_bytes"])) for r in hit if r["loaded_bytes"]),
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
        f"  load bandwidth              {result['load_gbps']:8.2f} GB/s   copy_ of the same bytes "
        f"{result['copy_gbps']:.2f} GB/s ({result['load_vs_copy']:.2f} x)"
    )


if __name__ == "__main__":
    main()

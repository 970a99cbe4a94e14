"""A real vLLM CUDA engine with ``OffloadingConnector`` and ``LMCachePlatformTier`` (``scripts/gpu-check``).

``python -m support.vllm_tier_gpu OUT_DIR`` (``tests`` on ``PYTHONPATH``) exits 0 having
written ``vllm-tier.json`` when the check passed, 1 when it failed, and 3 (skip) when
this host has no vLLM with CUDA and native tiering (vLLM >= 0.32 built for CUDA). It
starts ``lmcache-platform serve``, then engine A (a process: vLLM's ``LLM`` on a tiny
dummy-weight model, vLLM's native offloading with our tier through the server) runs one
prompt, then engine B (another process, the same configuration) runs it again: B's
prompt must come from the tier (``num_cached_tokens``) and its greedy output equal A's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SKIP = 3
PROMPT_TOKENS = 1024


def usable() -> str | None:
    """Why this host cannot run the check, or None."""
    try:
        import torch
        from vllm.v1.kv_offload.tiering import spec  # noqa: F401
    except Exception as exc:  # a missing or broken vLLM: nothing to check here
        return f"no vLLM with native tiering: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def engine(model: str, sock: str, out: Path) -> None:
    """One engine's run (a child process): the prompt's output and cached tokens to ``out``."""
    from vllm.config import KVTransferConfig

    from vllm import LLM, SamplingParams

    tier = {"type": "LMCachePlatformTier", "module_path": "lmcache_platform.vllm.tier", "socket": sock}
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": [tier],
        },
    )
    llm = LLM(model=model, load_format="dummy", enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=4096, kv_transfer_config=transfer, seed=0)  # fmt: skip
    prompt = {"prompt_token_ids": [(7 * i) % 4000 + 10 for i in range(PROMPT_TOKENS)]}
    result = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    report = {"tokens": list(result.outputs[0].token_ids), "cached": result.num_cached_tokens}
    time.sleep(2.0)  # let the cascade to the tier finish before the engine goes
    out.write_text(json.dumps(report))


def main() -> int:
    out = Path(sys.argv[1])
    why = usable()
    if why:
        print(f"vllm tier: skipped: {why}")
        (out / "vllm-tier.txt").write_text(f"skipped: {why}\n")
        return SKIP
    from support.vllm_models import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="lmcache-gpu-tier-"))
    work.chmod(0o700)
    model = str(make_tiny_model(work / "model", "gqa"))
    sock = str(work / "kv.sock")
    serve = subprocess.Popen([sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", sock,
                              "--max-host-bytes", "4G"])  # fmt: skip
    try:
        while not os.path.exists(sock):
            if serve.poll() is not None:
                raise SystemExit("serve did not start")
            time.sleep(0.1)
        runs: dict[str, Any] = {}
        for name in ("a", "b"):
            path = work / f"{name}.json"
            child = subprocess.run([sys.executable, "-m", "support.vllm_tier_gpu", "--engine", model, sock, str(path)],
                                   timeout=400)  # fmt: skip
            if child.returncode or not path.exists():
                raise SystemExit(f"engine {name} failed ({child.returncode})")
            runs[name] = json.loads(path.read_text())
    finally:
        serve.terminate()
        serve.wait(30)
    passed = runs["a"]["tokens"] == runs["b"]["tokens"] and runs["b"]["cached"] >= PROMPT_TOKENS // 2
    report = {"passed": passed, **runs}
    (out / "vllm-tier.json").write_text(json.dumps(report, indent=1))
    print(f"vllm tier: {'passed' if passed else 'FAILED'}: {report}")
    return 0 if passed else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    else:
        sys.exit(main())

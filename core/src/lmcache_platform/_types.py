"""Plain value types shared by the facade, the hooks and the backends. No torch here."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class EngineType(enum.Enum):
    """The serving engine that allocated the KV caches (it decides layout conventions)."""

    VLLM = "vllm"
    SGLANG = "sglang"


class KVFormat(enum.Enum):
    """Per-layer paged KV layouts understood by the base cache context.

    Names say where K/V and the heads sit; shapes are given for one layer.
    """

    #: vLLM flash-attention: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
    FLASH_ATTN = "flash_attn"
    #: flash-attention, heads before tokens: ``[2, num_blocks, num_kv_heads, block_size, head_size]``
    FLASH_ATTN_HND = "flash_attn_hnd"
    #: FlashInfer-style: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
    FLASHINFER = "flashinfer"
    #: FlashInfer-style, heads before tokens: ``[num_blocks, 2, num_kv_heads, block_size, head_size]``
    FLASHINFER_HND = "flashinfer_hnd"
    #: Multi-head latent attention: ``[num_blocks, block_size, head_size]``
    MLA = "mla"


@dataclass(frozen=True, kw_only=True)
class LayoutHints:
    """What the engine knows about its layout, for shapes that are ambiguous alone.

    ``kv_format`` applies to every layer unless ``per_layer`` names a format for a
    layer index. ``block_size`` and ``num_kv_heads`` disambiguate NHD from HND.
    """

    kv_format: KVFormat | None = None
    per_layer: dict[int, KVFormat] = field(default_factory=dict)
    block_size: int | None = None
    num_kv_heads: int | None = None


@dataclass(frozen=True, kw_only=True)
class EngineGroupInfo:
    """One engine KV-cache group: its layers, block size and optional sliding window."""

    layer_indices: Sequence[int]
    block_size: int
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class CacheContextConfig:
    """Everything ``create_cache_context`` passes to a backend's cache-context class.

    One frozen, keyword-only object instead of a positional list: adding a field
    later does not break any backend's constructor.
    """

    lmcache_tokens_per_chunk: int = 256
    layout_hints: LayoutHints | None = None
    engine_group_infos: tuple[EngineGroupInfo, ...] = ()
    engine_type: EngineType = EngineType.VLLM
    separate_object_groups: bool = True
    full_sw_kv: bool = False
    #: Chunk slots in the staging buffer.
    max_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.lmcache_tokens_per_chunk <= 0:
            raise ValueError(
                f"lmcache_tokens_per_chunk must be positive, got {self.lmcache_tokens_per_chunk}"
            )
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")


@dataclass(frozen=True)
class Availability:
    """A backend's answer to "can you serve this device type on this host?"."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Availability:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Availability:
        if not reason:
            raise ValueError("an unavailable backend must say why")
        return cls(False, reason)

"""Plain value types shared by the facade, the hooks and the backends. No torch here."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._events import DeviceEvent


class EngineType(enum.Enum):
    """The serving engine that allocated the KV caches (it decides layout conventions)."""

    #: vLLM.
    VLLM = "vllm"
    #: SGLang.
    SGLANG = "sglang"


class KVFormat(enum.Enum):
    """Names of the per-layer KV layouts the base cache context understands.

    Each is a case of one axis-meaning model (see the layouts page), not a code path.
    Shapes are given for one layer; ``H`` = num_kv_heads, ``D`` = head_size.
    """

    #: Current vLLM, ``[num_blocks, H, block_size, 2 * D]`` (K then V in the last
    #: dim), in any of vLLM's six physical ``KVCacheLayout`` orders.
    VLLM = "vllm"
    #: Current vLLM multi-head latent attention, ``[num_blocks, 1, block_size, latent]``.
    VLLM_MLA = "vllm_mla"
    #: Older vLLM flash-attention, ``[2, num_blocks, block_size, H, D]``.
    FLASH_ATTN = "flash_attn"
    #: Flash-attention with heads before tokens, ``[2, num_blocks, H, block_size, D]``.
    FLASH_ATTN_HND = "flash_attn_hnd"
    #: FlashInfer-style, ``[num_blocks, 2, block_size, H, D]``.
    FLASHINFER = "flashinfer"
    #: FlashInfer-style with heads before tokens, ``[num_blocks, 2, H, block_size, D]``.
    FLASHINFER_HND = "flashinfer_hnd"
    #: Older vLLM multi-head latent attention, ``[num_blocks, block_size, latent]``.
    MLA = "mla"
    #: SGLang's MHA pool, a pair of tensors per layer (K and V), each ``[slots, H, D]``
    #: (pages of ``block_size`` token slots).
    SGLANG = "sglang"
    #: SGLang's MLA pool, ``[slots, 1, latent]``.
    SGLANG_MLA = "sglang_mla"


@dataclass(frozen=True, kw_only=True)
class LayoutHints:
    """What the engine knows about its layout, for shapes that are ambiguous alone.

    ``kv_format`` applies to every layer unless ``per_layer`` names a format for a
    layer index. ``block_size`` and ``num_kv_heads`` disambiguate NHD from HND.
    ``engine_layout`` is the engine's own layout name: one of vLLM's ``KVCacheLayout``
    members (``"LBHNC"``, ``"LBNHC"``, ``"LHBNC"``, ``"BLHNC"``, ``"BLNHC"``,
    ``"BHLNC"``) or the older ``"NHD"``/``"HND"``; the strides are checked against it.
    ``head_size`` splits current vLLM's packed content dim (``2 * head_size`` is K and
    V, ``head_size`` with one head an MLA latent).
    """

    kv_format: KVFormat | None = None
    per_layer: dict[int, KVFormat] = field(default_factory=dict)
    block_size: int | None = None
    num_kv_heads: int | None = None
    engine_layout: str | None = None
    head_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class EngineGroupInfo:
    """One engine KV-cache group: its layers, block size and optional sliding window."""

    layer_indices: Sequence[int]
    block_size: int
    sliding_window: int | None = None


#: The chunk formats a cache context can use (``CacheContextConfig.chunk_format``).
CHUNK_FORMATS: tuple[str, ...] = ("tokens", "blocks")


@dataclass(frozen=True, kw_only=True)
class CacheContextConfig:
    """Everything ``create_cache_context`` passes to a backend's cache-context class.

    One frozen, keyword-only object instead of a positional list: adding a field
    later does not break any backend's constructor.
    """

    lmcache_tokens_per_chunk: int = 256
    layout_hints: LayoutHints | None = None
    engine_group_infos: tuple[EngineGroupInfo, ...] = ()
    #: Decides what an otherwise ambiguous shape means (a 3-D layer is SGLang's
    #: token-slot pool for ``SGLANG``, vLLM's older MLA layout for ``VLLM``).
    engine_type: EngineType = EngineType.VLLM
    separate_object_groups: bool = True
    full_sw_kv: bool = False
    #: Chunk slots in the staging buffer. The server's choice, not the engine's.
    max_batch_size: int = field(default=4, metadata={"server": True})
    #: The engine's layer names in layer order (``model.layers.3.self_attn.attn``), so
    #: that every error names the engine's layer; empty means "use the index".
    layer_names: tuple[str, ...] = ()
    #: How a chunk's bytes are ordered: ``"tokens"`` (token-major, readable by any
    #: layout) or ``"blocks"`` (the engine's own blocks, copied whole: the fast path when
    #: every reader has this layout, as in one cache namespace). See :data:`CHUNK_FORMATS`.
    chunk_format: str = "tokens"
    #: The :class:`DeviceEvent` class of the backend that was selected for the device
    #: (its ``lmcache_platform_device_event_class`` hook), filled in by whoever selects
    #: the backend (``create_cache_context``); None: this context takes no events.
    device_event_class: type[DeviceEvent] | None = field(default=None, metadata={"server": True})

    def __post_init__(self) -> None:
        if self.chunk_format not in CHUNK_FORMATS:
            known = ", ".join(map(repr, CHUNK_FORMATS))
            raise ValueError(f"chunk_format must be one of {known}, got {self.chunk_format!r}")
        if self.lmcache_tokens_per_chunk <= 0:
            raise ValueError(
                f"lmcache_tokens_per_chunk must be positive, got {self.lmcache_tokens_per_chunk}"
            )
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")


#: The config fields an engine chooses: ``create_cache_context``'s keywords, and what
#: the reference server's ``register`` request carries. Fields marked ``server`` are not.
ENGINE_KEYWORDS: tuple[str, ...] = tuple(
    f.name for f in fields(CacheContextConfig) if not f.metadata.get("server")
)


@dataclass(frozen=True)
class Availability:
    """A backend's answer to "can you serve this device type on this host?"."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Availability:
        """The backend can serve its device type here."""
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Availability:
        """The backend cannot serve here; ``reason`` (not empty) says why, for an operator."""
        if not reason:
            raise ValueError("an unavailable backend must say why")
        return cls(False, reason)


#: The levels of a :class:`DoctorFinding`, mildest first.
DOCTOR_LEVELS = ("info", "warning", "error")


@dataclass(frozen=True)
class DoctorFinding:
    """One line a backend adds to ``lmcache-platform doctor`` (the optional doctor hook).

    ``info`` states a fact (where the memory lives, how much is free); ``warning`` and
    ``error`` say what to fix, and the message says how. An ``error`` means the backend
    cannot serve KV caches on this host as it stands: doctor then exits 1.
    """

    level: str
    message: str

    def __post_init__(self) -> None:
        if self.level not in DOCTOR_LEVELS:
            raise ValueError(f"DoctorFinding level {self.level!r} is not one of {', '.join(DOCTOR_LEVELS)}")
        if not isinstance(self.message, str) or not self.message.strip() or "\n" in self.message:
            raise ValueError(f"DoctorFinding message must be one non-empty line, got {self.message!r}")

    @classmethod
    def info(cls, message: str) -> DoctorFinding:
        """A finding of level ``info``: a fact."""
        return cls("info", message)

    @classmethod
    def warning(cls, message: str) -> DoctorFinding:
        """A finding of level ``warning``: something to fix; the message says how."""
        return cls("warning", message)

    @classmethod
    def error(cls, message: str) -> DoctorFinding:
        """A finding of level ``error``: the backend cannot serve here as it stands."""
        return cls("error", message)

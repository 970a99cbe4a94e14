"""Layer grouping: engine groups -> kernel groups -> object groups.

* An **engine group** is what the engine calls a KV-cache group: layers that share
  one block table (``EngineGroupInfo``: layer indices, block size, optional sliding
  window). Block ids are given per engine group. Without ``EngineGroupInfo`` every
  layer forms one implicit engine group.
* A **kernel group** is a set of layers of one engine group that also share format,
  shape, strides and dtype, so one kernel launch (or one vectorized torch op) can
  move them.
* An **object group** is a set of kernel groups stored together as one object in
  the staging buffer (and in the KV store): with ``separate_object_groups=True`` one
  per distinct sliding-window size (full attention counts as one size), else one
  for all.

Sliding windows. With ``full_sw_kv=False`` a kernel group of a sliding-window engine
group keeps, of each chunk, only the last ``min(tokens_per_chunk, sliding_window)``
tokens, the only ones a later token can attend to; its staging region is that many
tokens long. With ``full_sw_kv=True`` it keeps the whole chunk like any other group.

Kernel blocks. A layer's tensor may use blocks smaller than its engine group's (vLLM
splits a manager block into ``ratio`` kernel blocks and shows ``ratio`` times as many
blocks). The kernel group records ``blocks_per_engine_block``; block ids stay the
engine's, and the transfer plan translates each into its ``ratio`` kernel blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import LayoutError
from .._types import EngineGroupInfo, KVFormat
from .layout import FORMATS, FormatDims, LayerLayout, LayerTensors, discover_layouts

if TYPE_CHECKING:
    import torch

    from .._types import CacheContextConfig


@dataclass(frozen=True)
class EngineGroup:
    """A validated :class:`EngineGroupInfo` with its index."""

    index: int
    layer_indices: tuple[int, ...]
    block_size: int
    sliding_window: int | None


@dataclass(frozen=True)
class KernelGroup(FormatDims):
    """Layers of one engine group sharing format, shape and dtype.

    ``tokens_per_slot`` is how many tokens of a chunk this group keeps in a staging
    slot (``tokens_per_chunk``, or fewer for a trimmed sliding-window group).
    """

    index: int
    engine_group_idx: int
    object_group_idx: int
    layer_indices: tuple[int, ...]
    kv_format: KVFormat
    dtype: torch.dtype
    #: Per-layer tensor shape and stride, as given (identical for every layer).
    layer_shape: tuple[int, ...]
    layer_stride: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None
    tokens_per_slot: int
    #: Tensor blocks per engine block (1 unless the engine splits into kernel blocks);
    #: ``block_size`` and ``num_blocks`` are the tensor's.
    blocks_per_engine_block: int = 1

    @property
    def engine_block_size(self) -> int:
        """Tokens per block of the engine group's block table."""
        return self.block_size * self.blocks_per_engine_block

    @property
    def num_engine_blocks(self) -> int:
        """Engine block ids this group's layers can address."""
        return self.num_blocks // self.blocks_per_engine_block

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this group's layers (all planes, all layers)."""
        return self.kv_size * self.num_layers * self.hidden_dim * self.itemsize

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts of the group, for a context's ``report_status()``."""
        return {
            "kernel_group_idx": self.index,
            "engine_group_idx": self.engine_group_idx,
            "object_group_idx": self.object_group_idx,
            "layer_indices": list(self.layer_indices),
            "num_layers": self.num_layers,
            "kv_format": self.kv_format.value,
            "is_mla": self.is_mla,
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer_shape": list(self.layer_shape),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "sliding_window": self.sliding_window,
            "tokens_per_slot": self.tokens_per_slot,
        }


@dataclass(frozen=True)
class ObjectGroup:
    """Kernel groups stored as one object.

    ``sliding_window`` is the window its kernel groups share; None for full attention,
    and for the single object group of ``separate_object_groups=False``.
    """

    index: int
    kernel_group_indices: tuple[int, ...]
    sliding_window: int | None

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts of the group, for a context's ``report_status()``."""
        return {
            "object_group_idx": self.index,
            "kernel_group_indices": list(self.kernel_group_indices),
            "sliding_window": self.sliding_window,
        }


def resolve_engine_groups(
    infos: Sequence[EngineGroupInfo], num_layers: int
) -> tuple[EngineGroup, ...] | None:
    """Validate ``infos``: every layer in exactly one group. None means "one implicit group"."""
    if not infos:
        return None
    owner: dict[int, int] = {}
    groups = []
    for g, info in enumerate(infos):
        layers = tuple(info.layer_indices)
        if not layers:
            raise LayoutError(f"engine group {g} has no layers")
        if info.block_size <= 0:
            raise LayoutError(f"engine group {g}: block_size must be positive, got {info.block_size}")
        if info.sliding_window is not None and info.sliding_window <= 0:
            raise LayoutError(
                f"engine group {g}: sliding_window must be positive or None, got {info.sliding_window}"
            )
        for layer in layers:
            if not 0 <= layer < num_layers:
                raise LayoutError(f"engine group {g} names layer {layer}, but there are {num_layers} layers")
            if layer in owner:
                raise LayoutError(f"layer {layer} is in engine groups {owner[layer]} and {g}")
            owner[layer] = g
        groups.append(EngineGroup(g, tuple(sorted(layers)), info.block_size, info.sliding_window))
    missing = sorted(set(range(num_layers)) - set(owner))
    if missing:
        raise LayoutError(f"layers {missing} are in no engine group")
    return tuple(groups)


class KVLayerGroupsManager:
    """Builds and holds the engine, kernel and object groups of one cache context.

    Kernel groups are numbered by object group, then by decreasing element size (so
    the kernel groups of an object group pack back to back with natural alignment),
    then by first layer. Object groups are numbered by their first layer.
    """

    def __init__(
        self,
        layouts: Sequence[LayerLayout],
        engine_groups: tuple[EngineGroup, ...] | None,
        *,
        tokens_per_chunk: int,
        separate_object_groups: bool,
        full_sw_kv: bool,
    ) -> None:
        if engine_groups is None:
            sizes = sorted({lay.block_size for lay in layouts})
            if len(sizes) != 1:
                raise LayoutError(
                    f"layers have different block sizes {sizes}; pass engine_group_infos "
                    f"to say which layers share a block table"
                )
            engine_groups = (EngineGroup(0, tuple(range(len(layouts))), sizes[0], None),)
        self.tokens_per_chunk = tokens_per_chunk
        self.engine_groups = engine_groups

        # Kernel groups: layers of one engine group with equal format, shape, stride, dtype.
        buckets: dict[tuple[object, ...], tuple[EngineGroup, list[int]]] = {}
        for eg in engine_groups:
            if tokens_per_chunk % eg.block_size:
                raise LayoutError(
                    f"engine group {eg.index}: tokens_per_chunk {tokens_per_chunk} is not a "
                    f"multiple of its block size {eg.block_size}, so chunks would start "
                    f"mid-block"
                )
            for layer in eg.layer_indices:
                lay = layouts[layer]
                splits = FORMATS[lay.kv_format].kernel_blocks
                if eg.block_size % lay.block_size if splits else eg.block_size != lay.block_size:
                    raise LayoutError(
                        f"layer {layer} has block size {lay.block_size} but engine group "
                        f"{eg.index} says {eg.block_size}"
                    )
                key = (eg.index, lay.kv_format, lay.shape, lay.stride, lay.dtype)
                buckets.setdefault(key, (eg, []))[1].append(layer)

        def window_key(eg: EngineGroup) -> int:
            """Object-group key: the window size (0 for full attention), or 0 for all."""
            return (eg.sliding_window or 0) if separate_object_groups else 0

        og_first_layer: dict[int, int] = {}
        for eg, layers in buckets.values():
            wkey = window_key(eg)
            og_first_layer[wkey] = min(og_first_layer.get(wkey, layers[0]), layers[0])
        og_of_key = {wkey: i for i, wkey in enumerate(sorted(og_first_layer, key=og_first_layer.__getitem__))}

        ordered = sorted(
            buckets.values(),
            key=lambda b: (og_of_key[window_key(b[0])], -layouts[b[1][0]].dtype.itemsize, b[1][0]),
        )
        kernel_groups = []
        for idx, (eg, layers) in enumerate(ordered):
            lay = layouts[layers[0]]
            per_slot = tokens_per_chunk
            if eg.sliding_window is not None and not full_sw_kv:
                per_slot = min(tokens_per_chunk, eg.sliding_window)
            kernel_groups.append(
                KernelGroup(
                    index=idx,
                    engine_group_idx=eg.index,
                    object_group_idx=og_of_key[window_key(eg)],
                    layer_indices=tuple(layers),
                    kv_format=lay.kv_format,
                    dtype=lay.dtype,
                    layer_shape=lay.shape,
                    layer_stride=lay.stride,
                    num_blocks=lay.num_blocks,
                    block_size=lay.block_size,
                    num_kv_heads=lay.num_kv_heads,
                    head_size=lay.head_size,
                    sliding_window=eg.sliding_window,
                    tokens_per_slot=per_slot,
                    blocks_per_engine_block=eg.block_size // lay.block_size,
                )
            )
        self.kernel_groups: tuple[KernelGroup, ...] = tuple(kernel_groups)
        self.object_groups: tuple[ObjectGroup, ...] = tuple(
            ObjectGroup(
                index=og,
                kernel_group_indices=tuple(k.index for k in kernel_groups if k.object_group_idx == og),
                sliding_window=wkey or None,
            )
            for wkey, og in og_of_key.items()
        )

    @property
    def num_kernel_groups(self) -> int:
        return len(self.kernel_groups)

    @property
    def num_object_groups(self) -> int:
        return len(self.object_groups)

    @property
    def num_engine_groups(self) -> int:
        return len(self.engine_groups)

    def kept_range(self, num_tokens: int, kernel_group_idx: int) -> tuple[int, int]:
        """Chunk positions ``[first, first + count)`` a chunk of ``num_tokens`` keeps in a group.

        The kept tokens are the last ``tokens_per_slot`` of the chunk; for groups that
        are not trimmed that is the whole chunk.
        """
        kept = min(num_tokens, self.kernel_groups[kernel_group_idx].tokens_per_slot)
        return num_tokens - kept, kept

    def kept_tokens(self, num_tokens: int, kernel_group_idx: int) -> int:
        """Tokens kept for ``num_tokens`` tokens split into chunks (all full but the last)."""
        full, rest = divmod(num_tokens, self.tokens_per_chunk)
        per_slot = self.kernel_groups[kernel_group_idx].tokens_per_slot
        return full * per_slot + min(rest, per_slot)

    def blocks_for(self, num_tokens: int, kernel_group_idx: int) -> int:
        """Block ids the engine passes for a chunk of ``num_tokens`` tokens in this group."""
        return -(-num_tokens // self.kernel_groups[kernel_group_idx].engine_block_size)


def discover_groups(
    layers: Sequence[LayerTensors],
    config: CacheContextConfig,
    *,
    supported: Sequence[KVFormat] | None,
    owner: str,
    layer_name: Callable[[int], str],
) -> tuple[list[LayerLayout], KVLayerGroupsManager]:
    """Each layer's layout and the groups of one registration, as ``config`` describes it.

    ``supported``: the formats the context (``owner``) serves, None for all; a layer of
    another format is refused, named by ``layer_name``.
    """
    names = config.layer_names
    if names and len(names) != len(layers):
        raise LayoutError(
            f"{len(names)} layer names for {len(layers)} layers; "
            f"CacheContextConfig.layer_names must name every layer or none"
        )
    engine_groups = resolve_engine_groups(config.engine_group_infos, len(layers))
    block_sizes = {layer: eg.block_size for eg in engine_groups or () for layer in eg.layer_indices}
    layouts = discover_layouts(
        layers, config.layout_hints, block_sizes, names=config.layer_names, engine_type=config.engine_type
    )
    for index, lay in enumerate(layouts):
        if supported is not None and lay.kv_format not in supported:
            raise LayoutError(
                f"{layer_name(index)}: {owner} does not serve the {lay.kv_format.value} format "
                f"(it serves: {', '.join(f.value for f in supported)})"
            )
    manager = KVLayerGroupsManager(
        layouts,
        engine_groups,
        tokens_per_chunk=config.lmcache_tokens_per_chunk,
        separate_object_groups=config.separate_object_groups,
        full_sw_kv=config.full_sw_kv,
    )
    return layouts, manager

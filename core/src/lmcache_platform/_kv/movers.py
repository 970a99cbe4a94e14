"""A cache context's movers: per kernel group, the object that copies its chunk's bytes.

Every group gets a token-major :class:`~.transfer.GroupMover`; with the ``"blocks"``
chunk format also a whole-block :class:`~.blocks.BlockMover`, which that format uses.
Built once per context, from the layer tensors, their layouts and the staging views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from .._errors import LayoutError
from .blocks import BlockMover, block_order
from .layout import plane_views
from .reopen import tensors_of
from .transfer import GroupMover

if TYPE_CHECKING:
    import torch

    from .groups import KVLayerGroupsManager
    from .layout import LayerLayout, LayerTensors


class Movers(NamedTuple):
    tokens: list[GroupMover]
    #: Empty unless the chunk format is ``"blocks"``.
    blocks: list[BlockMover]
    #: Per kernel group, whether one op moves all its layers (the chunk format's movers).
    stacked: list[bool]
    #: Per kernel group, the axis names of its blocks in payload order.
    block_orders: list[str]


def build_movers(
    layers: Sequence[LayerTensors],
    layouts: Sequence[LayerLayout],
    manager: KVLayerGroupsManager,
    slot_views: Sequence[Sequence[torch.Tensor]],
    *,
    chunk_format: str,
    gather_words: Sequence[str],
    scatter_words: Sequence[str],
) -> Movers:
    """The movers of every kernel group; ``slot_views[slot][kernel group]`` its staging views."""
    groups = manager.kernel_groups
    tokens = [
        GroupMover(
            [plane_views(layers[i], layouts[i]) for i in kg.layer_indices],
            [views[kg.index] for views in slot_views],
            block_size=kg.block_size,
            num_kv_heads=kg.num_kv_heads,
            gather_words=gather_words,
            scatter_words=scatter_words,
        )
        for kg in groups
    ]
    orders = [
        block_order(tensors_of(layers[kg.layer_indices[0]]), layouts[kg.layer_indices[0]]) for kg in groups
    ]
    if chunk_format != "blocks":
        return Movers(tokens, [], [m.stacked for m in tokens], orders)
    for kg in groups:
        if kg.tokens_per_slot % kg.block_size:
            raise LayoutError(
                f"kernel group {kg.index} (layers {list(kg.layer_indices)}): chunk_format "
                f"'blocks' keeps whole blocks, but the group keeps {kg.tokens_per_slot} tokens "
                f"of a chunk (sliding window {kg.sliding_window}), not a multiple of its block "
                f"size {kg.block_size}; use chunk_format='tokens' or full_sw_kv=True"
            )
    blocks = [
        BlockMover(
            [tensors_of(layers[i]) for i in kg.layer_indices],
            layouts[kg.layer_indices[0]],
            slot_region=slot_views[0][kg.index].reshape(-1),
            blocks_per_slot=kg.tokens_per_slot // kg.block_size,
            gather_words=gather_words,
            scatter_words=scatter_words,
        )
        for kg in groups
    ]
    return Movers(tokens, blocks, [m.stacked for m in blocks], orders)

"""The ``"blocks"`` chunk format: a chunk as the engine's own blocks, each copied whole.

A namespace binds one KV layout (the server refuses a context of another), so every
context that reads a namespace's chunks lays out its blocks alike. Its chunks may then
keep the engine's block order instead of the token-major staging order, and a move is
a copy of whole blocks instead of a transpose: for a kernel group whose layers sit at
one step in one allocation, one ``index_select`` (store) or ``index_copy_`` (retrieve)
over all its layers, on a ``[layers, tensors, *outer, blocks, *inner]`` view of the
allocation in opaque wide words; otherwise one op per layer (per tensor of a K/V pair).

What a block is, read off the strides of a layer's tensor: the axes whose stride is
below the block axis's are *inner* (a block's content, in memory order, merged where
contiguous); the axes with larger strides are *outer* and repeat the block axis
(flash-attention's K/V planes in ``[2, B, N, H, D]``, the heads of vLLM's ``LHBNC``).
A kernel group's payload is dense ``[layers, tensors, *outer, blocks, *inner]`` with
the kept blocks in chunk order: ``tokens_per_slot // block_size`` blocks, exactly the
bytes of the token-major region. :func:`block_order` names those axes
(``"block head token kv_dim"`` for vLLM's ``LBHNC``); it is part of a namespace's
binding, so chunks never cross between physical orders.

Such a chunk holds whole blocks only: each group keeps a whole number of its blocks per
chunk (a sliding window too), and a transfer's ``num_tokens`` is a multiple of every
group's block size. Kernel blocks smaller than the engine's are the tensor's blocks
(the plan has translated the ids already); skipped blocks (``-1``) are absent from the
plan's parts, so nothing reads or writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .layout import FORMATS, Axis, LayerLayout
from .transfer import GATHER_WORD_DTYPES, SCATTER_WORD_DTYPES, GroupTransfer, stack_planes, word_views

if TYPE_CHECKING:
    import torch

#: Dims of a payload or page view before its outer axes: layers, then tensors of a layer.
_LEAD = 2


def _block_form(t: torch.Tensor, layout: LayerLayout) -> tuple[torch.Tensor, list[str]]:
    """``t`` viewed as ``[*outer, blocks, *inner]``, and the names of its axes in that order.

    Axes of size 1 are dropped (their stride means nothing); contiguous inner axes merge.
    """
    spec = FORMATS[layout.kv_format]
    names = [a.value for a in spec.axes]
    if Axis.SLOT in spec.axes:  # token slots: pages of block_size slots
        at = spec.axes.index(Axis.SLOT)
        t = t.unflatten(at, (layout.num_blocks, layout.block_size))  # type: ignore[no-untyped-call]
        names[at : at + 1] = [Axis.BLOCK.value, Axis.TOKEN.value]
    b = names.index(Axis.BLOCK.value)
    step = t.stride(b)
    rest = [i for i in range(t.dim()) if i != b and t.size(i) > 1]
    strides = [int(x) for x in t.stride()]
    outer = sorted((i for i in rest if strides[i] > step), key=lambda i: -strides[i])
    inner = sorted((i for i in rest if strides[i] <= step), key=lambda i: -strides[i])
    ones = [i for i in range(t.dim()) if i != b and t.size(i) == 1]
    view = t.permute([*outer, b, *inner, *ones])
    for _ in ones:
        view = view.select(-1, 0)
    return _merge_from(view, len(outer) + 1), [names[i] for i in (*outer, b, *inner)]


def _merge_from(t: torch.Tensor, start: int) -> torch.Tensor:
    """Merge adjacent dims from ``start`` on wherever they are contiguous with each other."""
    sizes, strides = list(t.shape[:start]), list(t.stride()[:start])
    tail_sizes, tail_strides = list(t.shape[start:]), list(t.stride()[start:])
    merged_sizes: list[int] = []
    merged_strides: list[int] = []
    for size, stride in zip(tail_sizes, tail_strides, strict=True):
        if merged_sizes and merged_strides[-1] == size * stride:
            merged_sizes[-1] *= size
            merged_strides[-1] = stride
        else:
            merged_sizes.append(size)
            merged_strides.append(stride)
    return t.as_strided([*sizes, *merged_sizes], [*strides, *merged_strides], t.storage_offset())


def block_order(tensors: Sequence[torch.Tensor], layout: LayerLayout) -> str:
    """The axis names of one layer's blocks in payload order (``"kv block token head dim"``)."""
    return " ".join(_block_form(tensors[0], layout)[1])


class BlockMover:
    """Whole-block gather/scatter for one kernel group between its layers and a payload.

    ``layers[l]`` holds layer ``l``'s tensor(s) as the engine handed them (two for a
    K/V pair); ``slot_region`` is staging slot 0's region of the group, 1-D in the
    group's dtype, which fixes the word types (payloads share its alignment: the
    context lays every chunk buffer out like a slot). ``blocks_per_slot`` is the
    blocks a payload holds. Gathers move ``int64`` words, scatters ``complex128``
    (torch's fastest for ``index_select`` and ``index_copy_``), narrower where the
    memory demands it.
    """

    def __init__(
        self,
        layers: Sequence[Sequence[torch.Tensor]],
        layout: LayerLayout,
        *,
        slot_region: torch.Tensor,
        blocks_per_slot: int,
        gather_words: Sequence[str] = GATHER_WORD_DTYPES,
        scatter_words: Sequence[str] = SCATTER_WORD_DTYPES,
    ) -> None:
        forms = [[_block_form(t, layout)[0] for t in layer] for layer in layers]
        self.order = block_order(layers[0], layout)
        self.block_size = layout.block_size
        b = self.order.split().index(Axis.BLOCK.value)  # outer axes come first, unmerged
        #: The block dim of page and payload views.
        self.block_dim = _LEAD + b
        per_tensor = [int(s) for s in forms[0][0].shape]
        shape = [len(layers), len(layers[0]), *per_tensor[:b], blocks_per_slot, *per_tensor[b + 1 :]]
        template = slot_region.view(shape)
        self._gather = _Pages(forms, template, gather_words)
        self._scatter = _Pages(forms, template, scatter_words)
        self.stacked = len(self._gather.pages) == 1 and len(layers) > 1

    def gather(self, slot: int | None, part: GroupTransfer) -> None:
        """Copy the part's whole blocks into ``part.buffer`` (``slot`` is not needed)."""
        import torch

        v = self._gather
        for pages, payload in zip(v.pages, self._payload(v, part), strict=True):
            torch.index_select(pages, self.block_dim, part.block_ids, out=payload)

    def scatter(self, slot: int | None, part: GroupTransfer) -> None:
        """Copy the part's whole blocks from ``part.buffer`` into the engine's blocks."""
        v = self._scatter
        for pages, payload in zip(v.pages, self._payload(v, part), strict=True):
            pages.index_copy_(self.block_dim, part.block_ids, payload)

    def _payload(self, v: _Pages, part: GroupTransfer) -> list[torch.Tensor]:
        """The payload slices a part moves, one per page view: its blocks at their position."""
        whole = part.buffer.view(v.word).view(v.shape)
        first, n = part.staging_offset // self.block_size, len(part.block_id_list)
        return [
            whole[lo : lo + nl, to : to + nt].narrow(self.block_dim, first, n) for lo, nl, to, nt in v.spans
        ]


class _Pages:
    """A group's page views and the payload's matching slices, in one word type."""

    def __init__(
        self, forms: Sequence[Sequence[torch.Tensor]], template: torch.Tensor, word_dtypes: Sequence[str]
    ) -> None:
        num_tensors = len(forms[0])
        flat = [f for layer in forms for f in layer]
        words = word_views([*flat, template], word_dtypes)
        self.word = words[-1].dtype
        self.shape = tuple(int(s) for s in words[-1].shape)
        paged = [words[i * num_tensors : (i + 1) * num_tensors] for i in range(len(forms))]
        self.pages = stack_planes(paged)
        # Which (first layer, layers, first tensor, tensors) of the payload each page view covers.
        self.spans: list[tuple[int, int, int, int]] = []
        for view in self.pages:
            nl, nt = int(view.shape[0]), int(view.shape[1])
            layer, tensor = divmod(sum(s[1] * s[3] for s in self.spans), num_tensors)
            self.spans.append((layer, nl, tensor, nt))

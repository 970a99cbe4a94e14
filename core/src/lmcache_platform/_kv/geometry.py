"""A kernel group's chunk transfer as one strided copy: the data a native kernel needs.

The layout model turns every layer into strided views (:func:`~.layout.plane_views` for
token-major chunks, the block form of :mod:`.blocks` for whole-block chunks). All
layers of a kernel group share shape and strides, so one description covers the
group: a list of *units* (a plane of a layer, or one outer index of a layer's block
form), each with the tensor it lives in and two offsets, and the strides shared by all
of them. A kernel then needs nothing per format: a new layout in the layout model is
new data here, never a new code path in a kernel.

Counting in elements of the group's dtype, element ``(o, i)`` of row ``r`` of block
``b`` of unit ``u`` is at::

    paged  = tensor[u.tensor] + u.paged_offset + b * block_stride + r * row_stride
             + o * outer_stride + i * inner_stride
    staged = buffer + u.staged_offset + staged_row * row_elems + o * inner + i

where ``tensor[k]`` is the group's ``k``-th tensor (layer-major, a layer's K and V
tensors in order: the order of ``get_kernel_group_kv_pointers``), ``buffer`` is a
part's buffer and ``staged_row`` counts rows from the buffer's start. A row is a token
in the ``"tokens"`` chunk format (``rows_per_block`` is the block size) and a whole
block in ``"blocks"`` (one row a block), so chunk position ``p`` is row
``p // tokens_per_row``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .blocks import _block_form
from .layout import FORMATS, LayerLayout, plane_views

if TYPE_CHECKING:
    import torch

    from .groups import KernelGroup


@dataclass(frozen=True)
class CopyUnit:
    """One strided piece of a kernel group: where it lives in the engine's memory and in a chunk."""

    #: Index into the group's tensors (layer-major, K before V for a pair).
    tensor: int
    #: Elements from that tensor's first element to the unit's block 0, row 0, element 0.
    paged_offset: int
    #: Elements from the start of a part's buffer to the unit's first row.
    staged_offset: int


@dataclass(frozen=True)
class CopyGeometry:
    """A kernel group's chunk as units x blocks x rows x ``(outer, inner)`` elements.

    See the module docstring for the two address formulas; every stride is in elements
    of the group's dtype. The staged side is dense: rows of ``row_elems`` elements.
    """

    units: tuple[CopyUnit, ...]
    block_stride: int
    #: Rows a block holds: its tokens (``"tokens"``), or 1 (``"blocks"``: a block is a row).
    rows_per_block: int
    #: Chunk positions per row: 1, or the block size in ``"blocks"``.
    tokens_per_row: int
    row_stride: int
    outer: int
    outer_stride: int
    inner: int
    inner_stride: int

    @property
    def row_elems(self) -> int:
        """Elements of one row (one token of one plane, or one block of one unit)."""
        return self.outer * self.inner


def _layout_of(kg: KernelGroup) -> LayerLayout:
    return LayerLayout(
        kg.kv_format,
        kg.num_blocks,
        kg.block_size,
        kg.num_kv_heads,
        kg.head_size,
        kg.dtype,
        kg.layer_shape,
        kg.layer_stride,
    )


def _row(sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, int, int, int] | None:
    """``(outer, outer_stride, inner, inner_stride)`` of a row's dims, merged where contiguous."""
    dims = [(int(n), int(s)) for n, s in zip(sizes, strides, strict=True) if n != 1]
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if len(merged) > 2:
        return None
    while len(merged) < 2:
        merged.insert(0, (1, 0) if merged else (1, 1))
    (outer, outer_stride), (inner, inner_stride) = merged
    return outer, outer_stride, inner, inner_stride


def copy_geometry(
    kernel_group: KernelGroup, layers: Sequence[Sequence[torch.Tensor]], chunk_format: str
) -> CopyGeometry | None:
    """The copy geometry of ``kernel_group`` over ``layers`` (its layers' tensors, in order).

    ``chunk_format`` is ``"tokens"`` or ``"blocks"``. None when the group's tensors do not
    share one geometry (a K/V pair whose strides differ), or a block's content has more
    than two non-contiguous dims: such groups take the generic torch path.
    """
    kg = kernel_group
    layout = _layout_of(kg)
    num_tensors = FORMATS[kg.kv_format].tensors
    if any(len(layer) != num_tensors for layer in layers):
        raise ValueError(f"kernel group {kg.index}: each layer has {num_tensors} tensor(s) in {kg.kv_format}")
    if chunk_format == "tokens":
        return _token_geometry(kg, layout, layers)
    if chunk_format == "blocks":
        return _block_geometry(kg, layout, layers)
    raise ValueError(f"unknown chunk format {chunk_format!r}")


def _token_geometry(
    kg: KernelGroup, layout: LayerLayout, layers: Sequence[Sequence[torch.Tensor]]
) -> CopyGeometry | None:
    """Units are (layer, plane); a row is one token of one plane, ``[heads, head_size]``."""
    per_layer = [
        plane_views(layer[0] if len(layer) == 1 else (layer[0], layer[1]), layout) for layer in layers
    ]
    planes = len(per_layer[0])
    per_tensor = planes // len(layers[0])
    first = per_layer[0][0]
    strides = tuple(first.stride())
    if any(tuple(p.stride()) != strides for views in per_layer for p in views):
        return None
    row = _row(first.shape[2:], strides[2:])
    if row is None:
        return None
    outer, outer_stride, inner, inner_stride = row
    slot_plane = kg.tokens_per_slot * kg.hidden_dim  # staging is [kv, layers, tokens, hidden]
    units = tuple(
        CopyUnit(
            tensor=li * len(layer) + p // per_tensor,
            paged_offset=int(views[p].storage_offset()) - int(layer[p // per_tensor].storage_offset()),
            staged_offset=(p * len(layers) + li) * slot_plane,
        )
        for li, (layer, views) in enumerate(zip(layers, per_layer, strict=True))
        for p in range(planes)
    )
    return CopyGeometry(
        units=units,
        block_stride=strides[0],
        rows_per_block=kg.block_size,
        tokens_per_row=1,
        row_stride=strides[1],
        outer=outer,
        outer_stride=outer_stride,
        inner=inner,
        inner_stride=inner_stride,
    )


def _block_geometry(
    kg: KernelGroup, layout: LayerLayout, layers: Sequence[Sequence[torch.Tensor]]
) -> CopyGeometry | None:
    """Units are (layer, tensor, outer index) of the block form; a row is one whole block.

    The payload is dense ``[layers, tensors, *outer, blocks_per_slot, *inner]``, as
    :class:`~.blocks.BlockMover` lays it out.
    """
    forms = [[_block_form(t, layout) for t in layer] for layer in layers]
    view, names = forms[0][0]
    b = names.index("block")
    shape, strides = tuple(int(n) for n in view.shape), tuple(int(st) for st in view.stride())
    if any(tuple(f.shape) != shape or tuple(f.stride()) != strides for layer in forms for f, _ in layer):
        return None
    row = _row(shape[b + 1 :], strides[b + 1 :])
    if row is None:
        return None
    outer, outer_stride, inner, inner_stride = row
    outer_sizes, outer_strides = shape[:b], strides[:b]
    per_unit = (kg.tokens_per_slot // kg.block_size) * outer * inner
    units: list[CopyUnit] = []
    for li, (layer, layer_forms) in enumerate(zip(layers, forms, strict=True)):
        for ti, (t, (form, _)) in enumerate(zip(layer, layer_forms, strict=True)):
            base = int(form.storage_offset()) - int(t.storage_offset())
            for index in itertools.product(*(range(n) for n in outer_sizes)):
                offset = base + sum(i * s for i, s in zip(index, outer_strides, strict=True))
                units.append(CopyUnit(li * len(layer) + ti, offset, len(units) * per_unit))
    return CopyGeometry(
        units=tuple(units),
        block_stride=strides[b],
        rows_per_block=1,
        tokens_per_row=kg.block_size,
        row_stride=0,
        outer=outer,
        outer_stride=outer_stride,
        inner=inner,
        inner_stride=inner_stride,
    )

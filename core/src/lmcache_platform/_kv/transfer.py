"""Chunk transfer plans and their generic torch implementation.

A :class:`ChunkTransfer` is what :meth:`BaseCacheContext.store_chunk` and
``retrieve_chunk`` hand to a backend's ``store``/``retrieve`` after validation:
per kernel group, the staged block ids, the chunk positions moved and the staging
view. A native kernel needs nothing else (plus the group's pointer tensor and
:class:`~lmcache_platform._kv.groups.KernelGroup` geometry).

:class:`GroupMover` is the portable implementation: ``index_select``/``index_copy_``
over whole blocks and ``copy_`` for partial edge blocks, on canonical
``[kv, blocks, block_size, heads, head_size]`` views, so one code path serves every
format. Two measures keep it near memory bandwidth without a native kernel:

* When a kernel group's layers are equally spaced views into one allocation, they
  are stacked into a single strided view, so each step is one op for all layers.
  Otherwise it is one op per layer.
* Data moves as opaque wide words (``int64`` for gathers, ``complex128`` for
  scatters, narrower where a layout demands): bit-exact for any dtype (fp8
  included) and far fewer elements for the index kernels to walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GroupTransfer:
    """One kernel group's share of a chunk transfer.

    The group moves chunk positions ``[first_token, first_token + num_tokens)``;
    they sit at staging positions ``[0, num_tokens)`` of ``buffer``. ``block_ids``
    lists the blocks holding those positions: chunk position ``p`` lives in block
    ``block_ids[p // block_size - first_token // block_size]`` at offset
    ``p % block_size``. ``block_ids`` is a staged int64 tensor on the transfer
    device; ``block_id_list`` the same ids as Python ints.
    """

    kernel_group_idx: int
    first_token: int
    num_tokens: int
    block_ids: torch.Tensor
    block_id_list: tuple[int, ...]
    #: Staging view ``[kv, layers, tokens_per_slot, hidden]`` of the group's dtype.
    buffer: torch.Tensor


@dataclass(frozen=True)
class ChunkTransfer:
    """A validated store or retrieve of one chunk: slot, token count, per-group parts."""

    slot: int
    num_tokens: int
    groups: tuple[GroupTransfer, ...]


#: Element types tried for moving bytes, first fit wins: for gathers (``index_select``)
#: and for scatters (``index_copy_``), each ordered by what runs fastest in torch.
GATHER_WORD_DTYPES: tuple[str, ...] = ("int64", "int32", "int16", "uint8")
SCATTER_WORD_DTYPES: tuple[str, ...] = ("complex128", "int64", "int32", "int16", "uint8")


def _word_ratio(tensors: Sequence[torch.Tensor], width: int) -> bool:
    """Can every tensor be reinterpreted with ``width``-byte elements along its last dim?"""
    for t in tensors:
        item = t.element_size()
        if t.stride(-1) != 1:
            return False
        if width <= item:
            if item % width:
                return False
            continue
        if width % item:
            return False
        r = width // item
        if t.size(-1) % r or t.storage_offset() % r or any(st % r for st in t.stride()[:-1]):
            return False
    return True


def word_views(tensors: Sequence[torch.Tensor], dtype_names: Sequence[str]) -> list[torch.Tensor]:
    """Reinterpret ``tensors`` with the widest element type in ``dtype_names`` all admit.

    Falls back to the tensors as they are when none fits (a non-dense last dim).
    """
    import torch

    for name in dtype_names:
        dtype = getattr(torch, name)
        width = torch.empty((), dtype=dtype).element_size()
        if _word_ratio(tensors, width):
            return [t.view(dtype) for t in tensors]
    return list(tensors)


def stack_layers(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[layers, *shape]`` view over equally spaced same-shape layer views, or None."""
    if len(views) < 2:
        return None
    first = views[0]
    base = first.untyped_storage().data_ptr()
    if any(v.untyped_storage().data_ptr() != base for v in views):
        return None
    step = views[1].storage_offset() - first.storage_offset()
    if step <= 0:
        return None
    for i, v in enumerate(views):
        if v.storage_offset() != first.storage_offset() + i * step:
            return None
        if v.shape != first.shape or v.stride() != first.stride():
            return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


def _split(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """View dim ``dim`` of ``t`` as ``(n, size // n)``."""
    shape = t.shape
    return t.view(*shape[:dim], n, shape[dim] // n, *shape[dim + 1 :])


def _segments(first: int, count: int, block_size: int) -> list[tuple[int, int, int, int]]:
    """Split chunk positions ``[first, first + count)`` into block-aligned pieces.

    Each piece is ``(block_pos, num_blocks, in_block_offset, length)`` with
    ``block_pos`` relative to the first block touched: at most a partial head
    block, a run of whole blocks (``in_block_offset`` 0, ``length`` a multiple of
    ``block_size``), and a partial tail block.
    """
    out = []
    base = first // block_size
    pos, end = first, first + count
    while pos < end:
        blk, off = divmod(pos, block_size)
        if off == 0 and end - pos >= block_size:
            n = (end - pos) // block_size
            out.append((blk - base, n, 0, n * block_size))
        else:
            out.append((blk - base, 1, off, min(block_size - off, end - pos)))
        pos += out[-1][3]
    return out


class _Views:
    """A kernel group's paged and staging views, reinterpreted with one word type.

    Stacked: paged ``[L, kv, blocks, B, H, D]`` with staging ``[L, kv, tokens, H, D]``;
    otherwise one pair per layer, ``[kv, blocks, B, H, D]`` with ``[kv, tokens, H, D]``.
    The paged block dim and the staging token dim have the same index, ``dim``.
    """

    #: Cached staging views per (slot, position, blocks); chunks repeat few shapes.
    MAX_CACHED = 256

    def __init__(
        self,
        layer_views: Sequence[torch.Tensor],
        slots: Sequence[torch.Tensor],
        block_size: int,
        word_dtypes: Sequence[str],
    ) -> None:
        words = word_views([*layer_views, *slots], word_dtypes)
        layers, staged = words[: len(layer_views)], words[len(layer_views) :]
        stacked = stack_layers(layers)
        self.stacked = stacked is not None
        self.pages: list[torch.Tensor] = [stacked] if stacked is not None else list(layers)
        self.stage: list[list[torch.Tensor]] = [
            [s.transpose(0, 1)] if stacked is not None else [s[:, i] for i in range(len(layers))]
            for s in staged
        ]
        self.dim = self.pages[0].dim() - 4
        self.block_size = block_size
        self._runs: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def runs(self, slot: int, pos: int, n: int) -> list[torch.Tensor]:
        """Staging views ``[..., n, block_size, H, D]`` of ``n`` whole blocks at ``pos``."""
        key = (slot, pos, n)
        views = self._runs.get(key)
        if views is None:
            if len(self._runs) >= self.MAX_CACHED:
                self._runs.clear()
            d, length = self.dim, n * self.block_size
            views = [_split(x.narrow(d, pos, length), d, n) for x in self.stage[slot]]
            self._runs[key] = views
        return views


class GroupMover:
    """Generic gather/scatter for one kernel group between paged layers and staging.

    ``layer_views`` are the group's canonical layer views
    ``[kv, blocks, block_size, heads, head_size]``; ``slot_buffers`` its staging
    views ``[kv, layers, tokens, hidden]``, one per slot. Gather and scatter each use
    their own word types: torch's ``index_select`` is fastest on 8-byte words and
    ``index_copy_`` on 16-byte ones.
    """

    def __init__(
        self,
        layer_views: Sequence[torch.Tensor],
        slot_buffers: Sequence[torch.Tensor],
        *,
        block_size: int,
        num_kv_heads: int,
        gather_words: Sequence[str] = GATHER_WORD_DTYPES,
        scatter_words: Sequence[str] = SCATTER_WORD_DTYPES,
    ) -> None:
        self.block_size = block_size
        # Staging as [kv, layers, tokens, heads, head_size], matching the layer views.
        slots = [_split(b, b.dim() - 1, num_kv_heads) for b in slot_buffers]
        self._gather = _Views(layer_views, slots, block_size, gather_words)
        self._scatter = _Views(layer_views, slots, block_size, scatter_words)
        self.stacked = self._gather.stacked

    def gather(self, slot: int, part: GroupTransfer) -> None:
        """Copy the part's tokens from the paged blocks into staging slot ``slot``."""
        import torch

        v = self._gather
        d, pos = v.dim, 0
        for blk, n, off, length in _segments(part.first_token, part.num_tokens, self.block_size):
            if off == 0 and length == n * self.block_size:
                ids = part.block_ids[blk : blk + n]
                for src, out in zip(v.pages, v.runs(slot, pos, n), strict=True):
                    torch.index_select(src, d, ids, out=out)
            else:
                block = part.block_id_list[blk]
                for src, dst in zip(v.pages, v.stage[slot], strict=True):
                    dst.narrow(d, pos, length).copy_(src.select(d, block).narrow(d, off, length))
            pos += length

    def scatter(self, slot: int, part: GroupTransfer) -> None:
        """Copy staging slot ``slot`` back into the part's paged blocks."""
        v = self._scatter
        d, pos = v.dim, 0
        for blk, n, off, length in _segments(part.first_token, part.num_tokens, self.block_size):
            if off == 0 and length == n * self.block_size:
                ids = part.block_ids[blk : blk + n]
                for dst, data in zip(v.pages, v.runs(slot, pos, n), strict=True):
                    dst.index_copy_(d, ids, data)
            else:
                block = part.block_id_list[blk]
                for dst, src in zip(v.pages, v.stage[slot], strict=True):
                    dst.select(d, block).narrow(d, off, length).copy_(src.narrow(d, pos, length))
            pos += length

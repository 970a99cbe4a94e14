"""Chunk transfer plans and their generic torch implementation.

A :class:`ChunkTransfer` is what :meth:`BaseCacheContext.store_chunk`,
``retrieve_chunk``, ``read_chunk`` and ``write_chunk`` hand to a backend's
``store``/``retrieve`` after validation: per kernel group, the staged block ids, the
chunk positions moved and the buffer to move them to or from (a staging slot's view,
or on the host the caller's own chunk tensors: ``ChunkTransfer.staged``). A native
kernel needs nothing else (plus the group's pointer tensor and
:class:`~lmcache_platform._kv.groups.KernelGroup` geometry). Plans of the ``"blocks"``
chunk format are moved by :class:`~lmcache_platform._kv.blocks.BlockMover`.

:class:`GroupMover` is the portable implementation, on canonical
``[kv, blocks, block_size, heads, head_size]`` views so one code path serves every
format (CUDA included: only generic torch ops). Measures that keep it near memory
bandwidth without a native kernel:

* When a kernel group's layers are equally spaced views into one allocation, they
  are stacked into a single strided view, so each step is one op for all layers.
  Otherwise it is one op per layer (or plane).
* Store gathers whole blocks with ``index_select``: torch copies slice by slice
  with one reused iterator, a ``copy_`` per block without Python overhead.
* Retrieve scatters whole blocks with ``index_copy_``, which walks element by
  element: fine where a block's plane is one contiguous run on both sides. For a
  stacked view whose blocks are short runs (vLLM's K/V-interleaved pages) it is
  one ``copy_`` per run of consecutive block ids instead (few large ops), per plane
  when the paged token/head order is the transpose of staging's.
* Data moves as opaque wide words (``int64`` for gathers, ``complex128`` for
  scatters, narrower where a layout demands): bit-exact for any dtype (fp8
  included) and far fewer elements for the index kernels to walk.
* Partial edge blocks use ``copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GroupTransfer:
    """One kernel group's share of a chunk transfer (a retrieve may have several).

    The group moves chunk positions ``[first_token, first_token + num_tokens)``;
    they sit at staging positions ``[staging_offset, staging_offset + num_tokens)``
    of ``buffer``. ``block_ids``
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
    #: The group's region of the chunk: ``[kv, layers, tokens_per_slot, hidden]`` of the
    #: group's dtype in the ``"tokens"`` format; in ``"blocks"`` the same bytes as a 1-D
    #: tensor of that dtype (see :mod:`~lmcache_platform._kv.blocks` for their order).
    buffer: torch.Tensor
    #: Staging position of ``first_token``: 0 but in a retrieve that skips blocks
    #: (:data:`SKIP_BLOCK`), which moves each run of real blocks as a part of its own.
    staging_offset: int = 0


@dataclass(frozen=True)
class ChunkTransfer:
    """A validated store or retrieve of one chunk: slot, token count, per-group parts."""

    slot: int
    num_tokens: int
    groups: tuple[GroupTransfer, ...]
    #: Whether the parts' buffers are staging slot ``slot``'s; False when they are the
    #: caller's host tensors (``read_chunk``/``write_chunk`` on a host context).
    staged: bool = True
    #: The context's chunk format: ``"tokens"`` (token-major) or ``"blocks"`` (whole blocks).
    chunk_format: str = "tokens"


#: A block id a retrieve may carry for positions it must not write (vLLM's null blocks).
SKIP_BLOCK = -1

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


def _stack(views: Sequence[torch.Tensor], steps: Sequence[int], counts: Sequence[int]) -> torch.Tensor | None:
    """One ``[*counts, *shape]`` view over same-shape views placed at ``steps`` apart, or None.

    ``views`` are in row-major order over ``counts``; every step must be positive and
    every view must sit exactly where the steps put it, in one storage.
    """
    first = views[0]
    base = first.untyped_storage().data_ptr()
    if any(st <= 0 for st in steps):
        return None
    for flat, v in enumerate(views):
        if v.untyped_storage().data_ptr() != base or v.shape != first.shape or v.stride() != first.stride():
            return None
        offset, rest = first.storage_offset(), flat
        for count, step in zip(reversed(counts), reversed(steps), strict=True):
            rest, index = divmod(rest, count)
            offset += index * step
        if v.storage_offset() != offset:
            return None
    return first.as_strided((*counts, *first.shape), (*steps, *first.stride()), first.storage_offset())


def stack_planes(planes: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Views with leading ``[layers, planes]`` dims, as few as the memory allows.

    ``planes[l][p]`` is plane ``p`` of layer ``l``. Layers at a constant step whose
    planes are at a constant step become one ``[L, P, ...]`` view (one op moves the
    whole kernel group); otherwise each layer whose planes are evenly spaced becomes
    a ``[1, P, ...]`` view, and each remaining plane a ``[1, 1, ...]`` view.
    """
    num_layers, num_planes = len(planes), len(planes[0])
    flat = [v for layer in planes for v in layer]
    layer_step = _step(flat[0], flat[num_planes]) if num_layers > 1 else 1
    plane_step = _step(flat[0], flat[1]) if num_planes > 1 else 1
    whole = _stack(flat, [layer_step, plane_step], [num_layers, num_planes])
    if whole is not None:
        return [whole]
    out = []
    for layer in planes:
        one = _stack(layer, [1, _step(layer[0], layer[1]) if num_planes > 1 else 1], [1, num_planes])
        out.extend([one] if one is not None else [v.unsqueeze(0).unsqueeze(0) for v in layer])
    return out


def _step(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements from ``a``'s start to ``b``'s in their storage."""
    return int(b.storage_offset()) - int(a.storage_offset())


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


def _common_run(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements per innermost run that is contiguous in both same-shape views."""
    run = 1
    for size, sa, sb in zip(reversed(a.shape), reversed(a.stride()), reversed(b.stride()), strict=True):
        if size > 1 and (sa != run or sb != run):
            break
        run *= size
    return run


def _block_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first id, length)`` per run of consecutive ids (in chunk order)."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, b, 1))
    return out


class _Views:
    """A kernel group's paged and staging views, reinterpreted with one word type.

    Paged views ``[l, p, blocks, B, H, D]`` pair with staging views ``[l, p, tokens, H,
    D]`` over the same layers and planes (``l``/``p`` all of them when the memory
    stacks, else one layer or one plane each; see :func:`stack_planes`). The paged
    block dim and the staging token dim are both dim 2.
    """

    #: Cached staging views per (slot, position, blocks); chunks repeat few shapes.
    MAX_CACHED = 256
    dim = 2

    def __init__(
        self,
        planes: Sequence[Sequence[torch.Tensor]],
        slots: Sequence[torch.Tensor],
        block_size: int,
        word_dtypes: Sequence[str],
    ) -> None:
        num_planes = len(planes[0])
        flat = [v for layer in planes for v in layer]
        words = word_views([*flat, *slots], word_dtypes)
        #: The word type the staging views took (the group's dtype when none fitted).
        self.word = words[-1].dtype
        paged = [words[i * num_planes : (i + 1) * num_planes] for i in range(len(planes))]
        self.pages = stack_planes(paged)
        self.stacked = len(self.pages) == 1 and len(planes) > 1
        # Which (first layer, layers, first plane, planes) of staging each paged view covers.
        self.spans: list[tuple[int, int, int, int]] = []
        for view in self.pages:
            nl, np_ = int(view.shape[0]), int(view.shape[1])
            done = sum(s[1] * s[3] for s in self.spans)
            layer, plane = divmod(done, num_planes)
            self.spans.append((layer, nl, plane, np_))
        self.stage: list[list[torch.Tensor]] = [self.stage_of(s) for s in slots]
        self.block_size = block_size
        self._runs: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        # Block-wise copy_ (see GroupMover) pays off for one paged view whose blocks are
        # not one contiguous run per plane on both sides (and when a whole block fits a slot).
        page = self.pages[0].select(self.dim, 0)
        self.copy_blocks = (
            len(self.pages) == 1
            and self.stage[0][0].size(self.dim) >= block_size
            and _common_run(page, self.runs(0, 0, 1)[0].select(self.dim, 0)) < page[0, 0].numel()
        )
        # Token/head order transposed against staging's: an op over both planes would
        # iterate them as its second loop (two rows a step); one op per plane instead.
        self.split_planes = page.size(1) > 1 and page.stride(2) < page.stride(3) and page.size(3) > 1

    def stage_of(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """One staging-side view per paged view, of a ``[kv, layers, tokens, H, D]`` buffer."""
        words = buffer.view(self.word)
        return [words.transpose(0, 1)[lo : lo + nl, po : po + np_] for lo, nl, po, np_ in self.spans]

    def runs(self, slot: int, pos: int, n: int) -> list[torch.Tensor]:
        """Staging views ``[l, p, n, block_size, H, D]`` of ``n`` whole blocks at ``pos``."""
        key = (slot, pos, n)
        views = self._runs.get(key)
        if views is None:
            if len(self._runs) >= self.MAX_CACHED:
                self._runs.clear()
            views = self.runs_of(self.stage[slot], pos, n)
            self._runs[key] = views
        return views

    def runs_of(self, stage: Sequence[torch.Tensor], pos: int, n: int) -> list[torch.Tensor]:
        """:meth:`runs` of any buffer's :meth:`stage_of` views (not cached)."""
        d, length = self.dim, n * self.block_size
        return [_split(x.narrow(d, pos, length), d, n) for x in stage]


class GroupMover:
    """Generic gather/scatter for one kernel group between paged layers and staging.

    ``planes[l][p]`` is plane ``p`` (K, V, or MLA's latent) of the group's layer ``l``,
    a strided view ``[blocks, block_size, heads, head_size]`` of the engine's memory
    (:func:`~.layout.plane_views`); ``slot_buffers`` the group's staging views
    ``[kv, layers, tokens, hidden]``, one per slot. Gather and scatter each use
    their own word types: torch's ``index_select`` is fastest on 8-byte words and
    ``index_copy_`` on 16-byte ones. Which whole-block scatter runs is fixed here,
    from the strides (see the module docstring).
    """

    def __init__(
        self,
        planes: Sequence[Sequence[torch.Tensor]],
        slot_buffers: Sequence[torch.Tensor],
        *,
        block_size: int,
        num_kv_heads: int,
        gather_words: Sequence[str] = GATHER_WORD_DTYPES,
        scatter_words: Sequence[str] = SCATTER_WORD_DTYPES,
    ) -> None:
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        # Staging as [kv, layers, tokens, heads, head_size], matching the layer views.
        slots = [_split(b, b.dim() - 1, num_kv_heads) for b in slot_buffers]
        self._gather = _Views(planes, slots, block_size, gather_words)
        self._scatter = _Views(planes, slots, block_size, scatter_words)
        self.stacked = self._gather.stacked

    def gather(self, slot: int | None, part: GroupTransfer) -> None:
        """Copy the part's tokens from the paged blocks into staging slot ``slot``.

        ``slot`` None: into ``part.buffer`` instead (a caller's host tensor; its views are
        built for this call, where a slot's are cached).
        """
        self._move(slot, part, to_staging=True)

    def scatter(self, slot: int | None, part: GroupTransfer) -> None:
        """Copy staging slot ``slot`` (None: ``part.buffer``) back into the part's paged blocks."""
        self._move(slot, part, to_staging=False)

    def _move(self, slot: int | None, part: GroupTransfer, *, to_staging: bool) -> None:
        """Whole blocks with index ops or block-wise ``copy_``, partial edge blocks with ``copy_``."""
        import torch

        v = self._gather if to_staging else self._scatter
        if slot is None:
            stage = v.stage_of(_split(part.buffer, part.buffer.dim() - 1, self.num_kv_heads))
        else:
            stage = v.stage[slot]
        d, pos = v.dim, part.staging_offset
        for blk, n, off, length in _segments(part.first_token, part.num_tokens, self.block_size):
            if off == 0 and length == n * self.block_size:
                runs = v.runs(slot, pos, n) if slot is not None else v.runs_of(stage, pos, n)
                if not to_staging and v.copy_blocks:
                    self._copy_blocks(v, runs, part.block_id_list[blk : blk + n])
                else:
                    ids = part.block_ids[blk : blk + n]
                    for pages, run in zip(v.pages, runs, strict=True):
                        if to_staging:
                            torch.index_select(pages, d, ids, out=run)
                        else:
                            pages.index_copy_(d, ids, run)
            else:
                for pages, staging in zip(v.pages, stage, strict=True):
                    paged = pages.select(d, part.block_id_list[blk]).narrow(d, off, length)
                    staged = staging.narrow(d, pos, length)
                    (staged if to_staging else paged).copy_(paged if to_staging else staged)
            pos += length

    @staticmethod
    def _copy_blocks(v: _Views, runs: Sequence[torch.Tensor], ids: Sequence[int]) -> None:
        """Scatter whole blocks (``runs``: their staging views) with one ``copy_`` per id run."""
        d = v.dim
        (pages,) = v.pages
        (run,) = runs
        for i, first, n in _block_runs(ids):
            dst, src = pages.narrow(d, first, n), run.narrow(d, i, n)
            if v.split_planes:
                for p in range(int(dst.size(1))):
                    dst.select(1, p).copy_(src.select(1, p))
            else:
                dst.copy_(src)

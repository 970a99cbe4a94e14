"""Checking a chunk's block ids and turning them into the tensor blocks each group moves.

Bookkeeping over the layer groups (``groups.py``). The cache context asks it before
anything is copied, so a bad request is refused whole (:class:`TransferError`); what
passed is a :class:`CheckedChunk`, moved as it is and never checked again. Its runs
become a :class:`~lmcache_platform.ChunkTransfer` (:meth:`ChunkPlanner.transfer`), the
one step that touches tensors: the buffers the context hands it and one copy of ids.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import TransferError
from .transfer import SKIP_BLOCK, ChunkTransfer, GroupTransfer

if TYPE_CHECKING:
    import torch

    from .groups import KernelGroup, KVLayerGroupsManager


@dataclass(frozen=True, eq=False)
class CheckedChunk:
    """One chunk's block ids after every check, for the context and direction that checked it.

    :meth:`BaseCacheContext.check_chunks <lmcache_platform.BaseCacheContext.check_chunks>`
    makes them; every transfer call takes one wherever it takes block ids and moves it
    without checking again. A store's rules and a retrieve's differ (a retrieve may skip
    blocks and writes each block once), so it serves the direction it was checked for.
    """

    num_tokens: int
    #: Per engine group, the block ids as ints.
    ids: tuple[tuple[int, ...], ...]
    retrieve: bool
    checker: ChunkPlanner = field(repr=False)


#: One chunk's block ids per engine group, as checked or still to check.
ChunkIds = CheckedChunk | Sequence[Sequence[int]]


class Run(NamedTuple):
    """Consecutive kept positions of one kernel group held by real (not skipped) blocks."""

    kernel_group: KernelGroup
    first_token: int
    num_tokens: int
    tensor_ids: list[int]
    #: Where ``first_token`` lands in the group's region of a chunk.
    staging_offset: int


class ChunkPlanner:
    """The rules a chunk transfer's arguments must meet, for one context's groups."""

    def __init__(self, manager: KVLayerGroupsManager, *, chunk_format: str) -> None:
        self.manager = manager
        #: Per engine group, the engine block ids all its kernel groups can address.
        self.engine_group_blocks = [
            min(kg.num_engine_blocks for kg in manager.kernel_groups if kg.engine_group_idx == eg.index)
            for eg in manager.engine_groups
        ]
        self.chunk_format = chunk_format
        self.tokens_per_chunk = manager.tokens_per_chunk

    @property
    def block_ids_per_chunk(self) -> int:
        """Engine block ids a full chunk names, over all engine groups."""
        return sum(-(-self.tokens_per_chunk // eg.block_size) for eg in self.manager.engine_groups)

    @property
    def tensor_ids_per_chunk(self) -> int:
        """Tensor block ids a full chunk's runs hold at most, over all kernel groups."""
        return sum(
            -(-self.tokens_per_chunk // kg.engine_block_size) * kg.blocks_per_engine_block
            for kg in self.manager.kernel_groups
        )

    def validate_ids(
        self, block_ids_per_group: Sequence[Sequence[int]], *, skip: bool = False
    ) -> list[list[int]]:
        """Per engine group, the ids as ints, each checked against the group's block space.

        With ``skip`` (a retrieve), :data:`SKIP_BLOCK` is accepted too: positions of no block.
        """
        n_groups = self.manager.num_engine_groups
        if len(block_ids_per_group) != n_groups:
            raise TransferError(
                f"expected block ids for {n_groups} engine group(s), got {len(block_ids_per_group)}"
            )
        out = []
        for g, ids in enumerate(block_ids_per_group):
            try:
                values = [operator.index(x) for x in _as_list(ids)]
            except TypeError as exc:
                raise TransferError(f"engine group {g}: block ids must be ints ({exc})") from None
            limit = self.engine_group_blocks[g]
            for pos, value in enumerate(values):
                if value == SKIP_BLOCK and not skip:
                    raise TransferError(
                        f"engine group {g}: block id {SKIP_BLOCK} (skip) at position {pos} is allowed "
                        "only in a retrieve; a store reads every block it names"
                    )
                if not 0 <= value < limit and not (skip and value == SKIP_BLOCK):
                    raise TransferError(
                        f"engine group {g}: block id {value} at position {pos} is out of range 0..{limit - 1}"
                    )
            out.append(values)
        return out

    def checked(self, chunk: ChunkIds, num_tokens: int | None, *, retrieve: bool) -> CheckedChunk:
        """``chunk`` checked: as it is when this planner checked it for this direction, else :meth:`check`."""
        if not isinstance(chunk, CheckedChunk):
            return self.check(chunk, num_tokens, retrieve=retrieve)
        if chunk.checker is not self:
            raise TransferError("these block ids were checked by another cache context; check them here")
        if chunk.retrieve != retrieve:
            done, want = ("a retrieve", "a store") if chunk.retrieve else ("a store", "a retrieve")
            raise TransferError(f"these block ids were checked for {done}, not {want}")
        if num_tokens is not None and num_tokens != chunk.num_tokens:
            raise TransferError(f"num_tokens {num_tokens!r}, but the ids were checked for {chunk.num_tokens}")
        return chunk

    def check(
        self, block_ids_per_group: Sequence[Sequence[int]], num_tokens: int | None, *, retrieve: bool
    ) -> CheckedChunk:
        """Validate one chunk's arguments completely."""
        chunk = self.tokens_per_chunk
        if num_tokens is None:
            num_tokens = chunk
        if not is_int(num_tokens) or not 1 <= num_tokens <= chunk:
            raise TransferError(f"num_tokens must be an int in 1..{chunk}, got {num_tokens!r}")
        manager = self.manager
        if self.chunk_format == "blocks":
            for kg in manager.kernel_groups:
                if num_tokens % kg.block_size:
                    raise TransferError(
                        f"chunk_format 'blocks' moves whole blocks: num_tokens {num_tokens} is not a "
                        f"multiple of kernel group {kg.index}'s block size {kg.block_size}"
                    )
        ids = self.validate_ids(block_ids_per_group, skip=retrieve)
        for eg, group_ids in zip(manager.engine_groups, ids, strict=True):
            want = -(-num_tokens // eg.block_size)
            if len(group_ids) != want:
                raise TransferError(
                    f"engine group {eg.index}: {num_tokens} tokens with block size "
                    f"{eg.block_size} need {want} block ids, got {len(group_ids)}"
                )
            if retrieve:
                kgs = [kg for kg in manager.kernel_groups if kg.engine_group_idx == eg.index]
                first = min(manager.kept_range(num_tokens, kg.index)[0] for kg in kgs)
                written = [b for b in group_ids[first // eg.block_size :] if b != SKIP_BLOCK]
                if len(set(written)) != len(written):
                    raise TransferError(
                        f"engine group {eg.index}: retrieve would write block ids {written} "
                        f"and some repeat; every written block must be distinct"
                    )
        return CheckedChunk(num_tokens, tuple(tuple(g) for g in ids), retrieve, self)

    def transfer(
        self,
        chunk: CheckedChunk,
        *,
        slot: int,
        buffers: Sequence[torch.Tensor],
        ids_buffer: torch.Tensor,
        staged: bool,
    ) -> ChunkTransfer:
        """``chunk``'s runs as a :class:`ChunkTransfer`, their ids on the device in one copy.

        ``buffers[k]`` is kernel group ``k``'s region of the chunk: staging slot ``slot``'s
        (``staged``), or a view of the caller's host tensors. ``ids_buffer`` is the device
        buffer the tensor block ids are copied into (:attr:`tensor_ids_per_chunk` fit).
        """
        blocks = self.chunk_format == "blocks"
        runs = self.runs(chunk.num_tokens, chunk.ids)
        on_device = to_device(ids_buffer, [run.tensor_ids for run in runs])
        parts = [
            GroupTransfer(
                kernel_group_idx=kg.index,
                first_token=first,
                num_tokens=count,
                block_ids=ids,
                block_id_list=tuple(tensor_ids),
                buffer=buffers[kg.index].reshape(-1) if blocks else buffers[kg.index],
                staging_offset=offset,
            )
            for (kg, first, count, tensor_ids, offset), ids in zip(runs, on_device, strict=True)
        ]
        return ChunkTransfer(
            slot=slot,
            num_tokens=chunk.num_tokens,
            groups=tuple(parts),
            staged=staged,
            chunk_format=self.chunk_format,
        )

    def runs(self, num_tokens: int, ids: Sequence[Sequence[int]]) -> list[Run]:
        """Per kernel group, its kept positions and the tensor blocks holding them.

        Engine block ``b`` of a group split into ``r`` kernel blocks is tensor blocks
        ``b * r .. b * r + r - 1``; skipped blocks split a group's positions into runs.
        """
        out = []
        for kg in self.manager.kernel_groups:
            first, count = self.manager.kept_range(num_tokens, kg.index)
            r = kg.blocks_per_engine_block
            engine_ids = ids[kg.engine_group_idx]
            held = [SKIP_BLOCK if b == SKIP_BLOCK else b * r + j for b in engine_ids for j in range(r)]
            for start, n, run_ids in _unskipped(first, count, kg.block_size, held[first // kg.block_size :]):
                out.append(Run(kg, start, n, run_ids, start - first))
        return out


def _unskipped(
    first: int, count: int, block_size: int, ids: Sequence[int]
) -> Iterator[tuple[int, int, list[int]]]:
    """Split positions ``[first, first + count)``, held by ``ids`` from the block of
    ``first`` on, into runs of real blocks: ``(first position, positions, ids)`` each.

    The one place :data:`SKIP_BLOCK` takes effect: its positions are in no run, so
    nothing reads or writes them. Without skips it yields ``(first, count, ids)`` once.
    """
    base, end = first // block_size, first + count
    run: list[int] = []
    run_start = run_end = first
    for i, block in enumerate(ids):
        lo, hi = max(first, (base + i) * block_size), min(end, (base + i + 1) * block_size)
        if lo >= hi:
            break
        if block == SKIP_BLOCK:
            if run:
                yield run_start, run_end - run_start, run
            run = []
            continue
        if not run:
            run_start = lo
        run.append(block)
        run_end = hi
    if run:
        yield run_start, run_end - run_start, run


def to_device(buffer: torch.Tensor, groups: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Copy ``groups`` of ids to the start of ``buffer`` in one copy, not waited for; a view each."""
    import torch

    flat = [x for group in groups for x in group]
    staged = buffer[: len(flat)]
    # pinned for a device: an asynchronous copy from pageable memory may wait for the stream
    ids = torch.tensor(flat, dtype=torch.int64, pin_memory=buffer.device.type == "cuda")
    staged.copy_(ids, non_blocking=True)
    views, start = [], 0
    for group in groups:
        views.append(staged.narrow(0, start, len(group)))
        start += len(group)
    return views


def is_int(value: object) -> bool:
    """An int index, but not a bool (``True`` is never meant as slot 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _as_list(ids: Sequence[int]) -> list[Any]:
    tolist = getattr(ids, "tolist", None)
    return list(tolist() if callable(tolist) else ids)

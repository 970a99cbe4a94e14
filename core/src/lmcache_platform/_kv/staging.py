"""Byte layout of the staging buffer: slots -> object groups -> kernel groups.

One flat uint8 buffer holds ``num_slots`` chunk slots back to back. Inside a slot,
object groups follow each other (each starting on an ``align``-byte boundary), and
inside an object group its kernel groups are packed with no gap, so the object
group's flat view covers exactly its kernel groups' regions. Each kernel-group
region is a dense ``[kv, layers, tokens_per_slot, hidden]`` array of the group's
dtype. Pure arithmetic; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .groups import KVLayerGroupsManager

#: Alignment of slots and object groups: enough for any vector load and for DMA engines.
STAGING_ALIGN = 256


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class StagingLayout:
    """Where every (slot, kernel group) and (slot, object group) region lives, in bytes."""

    num_slots: int
    slot_nbytes: int
    #: Byte offset and size of each kernel group's region within a slot.
    kernel_group_spans: tuple[tuple[int, int], ...]
    #: Byte offset and size of each object group's region within a slot.
    object_group_spans: tuple[tuple[int, int], ...]

    @property
    def total_nbytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    @classmethod
    def build(
        cls, manager: KVLayerGroupsManager, num_slots: int, align: int = STAGING_ALIGN
    ) -> StagingLayout:
        kg_spans: list[tuple[int, int]] = [(0, 0)] * manager.num_kernel_groups
        og_spans = []
        offset = 0
        for og in manager.object_groups:
            offset = _round_up(offset, align)
            start = offset
            for k in og.kernel_group_indices:
                kg = manager.kernel_groups[k]
                nbytes = kg.tokens_per_slot * kg.bytes_per_token
                # Kernel groups are ordered by decreasing element size, so this holds.
                assert offset % kg.itemsize == 0
                kg_spans[k] = (offset, nbytes)
                offset += nbytes
            og_spans.append((start, offset - start))
        return cls(num_slots, _round_up(offset, align), tuple(kg_spans), tuple(og_spans))

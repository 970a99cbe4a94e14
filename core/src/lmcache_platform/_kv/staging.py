"""Byte layout of the staging buffer: slots -> object groups -> kernel groups.

One flat uint8 buffer holds ``num_slots`` chunk slots back to back. Inside a slot,
object groups follow each other (each starting on an ``align``-byte boundary), and
inside an object group its kernel groups are packed with no gap, so the object
group's flat view covers exactly its kernel groups' regions. Each kernel-group
region is a dense ``[kv, layers, tokens_per_slot, hidden]`` array of the group's
dtype. The layout is arithmetic; its methods cut typed views out of a buffer laid
out by it (the staging buffer, or one chunk's host tensors) and check such buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import TransferError
from .groups import KVLayerGroupsManager

if TYPE_CHECKING:
    import torch

    from .groups import KernelGroup

#: Alignment of slots and object groups: enough for any vector load and for DMA engines.
STAGING_ALIGN = 256
#: Alignment the staging buffer's start must have (torch's allocators give at least this).
STAGING_BASE_ALIGN = 64


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

    def kernel_group_views(
        self, buffer: torch.Tensor, manager: KVLayerGroupsManager
    ) -> list[list[torch.Tensor]]:
        """Per slot, per kernel group, its typed region ``[kv, layers, tokens_per_slot, hidden]``."""
        return [
            [
                _typed(buffer.narrow(0, s * self.slot_nbytes + off, nbytes), kg)
                for kg, (off, nbytes) in zip(manager.kernel_groups, self.kernel_group_spans, strict=True)
            ]
            for s in range(self.num_slots)
        ]

    def object_group_view(self, buffer: torch.Tensor, slot: int, og: int) -> torch.Tensor:
        """Slot ``slot``'s flat uint8 region of object group ``og``."""
        off, nbytes = self.object_group_spans[og]
        return buffer.narrow(0, slot * self.slot_nbytes + off, nbytes)

    def host_view(self, host: Sequence[torch.Tensor], kg: KernelGroup) -> torch.Tensor:
        """Kernel group ``kg``'s region of one chunk's host tensors (one per object group), typed."""
        og_offset = self.object_group_spans[kg.object_group_idx][0]
        offset, nbytes = self.kernel_group_spans[kg.index]
        return _typed(host[kg.object_group_idx].narrow(0, offset - og_offset, nbytes), kg)

    def check_buffer(self, buffer: torch.Tensor, device: torch.device, owner: str) -> None:
        """Refuse a staging buffer this layout cannot use (``owner``: who allocated it)."""
        import torch

        nbytes = self.total_nbytes
        if (
            buffer.dtype != torch.uint8
            or buffer.dim() != 1
            or buffer.numel() < nbytes
            or buffer.device != device
            or buffer.data_ptr() % STAGING_BASE_ALIGN
        ):
            raise TypeError(
                f"{owner} must return a 1-D uint8 tensor of at least {nbytes} bytes on {device}, "
                f"{STAGING_BASE_ALIGN}-byte aligned; got {buffer.dtype} {tuple(buffer.shape)} "
                f"on {buffer.device} at {buffer.data_ptr():#x}"
            )

    def check_host(self, host: Sequence[torch.Tensor]) -> bool:
        """Check one chunk's host tensors; True when they start aligned like a slot's.

        Each must be a contiguous 1-D uint8 host tensor of its object group's size
        (:class:`TransferError` names the first that is not). Aligned ones can be moved
        in place: the movers' word types assume a slot's alignment.
        """
        import torch

        sizes = [nbytes for _, nbytes in self.object_group_spans]
        if len(host) != len(sizes):
            raise TransferError(f"expected {len(sizes)} host tensors (one per object group), got {len(host)}")
        for og, (t, nbytes) in enumerate(zip(host, sizes, strict=True)):
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.uint8
                or t.dim() != 1
                or t.numel() != nbytes
                or t.device.type != "cpu"
                or not t.is_contiguous()
            ):
                got = (
                    f"{t.dtype} {tuple(t.shape)} on {t.device}"
                    if isinstance(t, torch.Tensor)
                    else type(t).__name__
                )
                raise TransferError(
                    f"object group {og}: expected a contiguous 1-D uint8 host tensor of {nbytes} "
                    f"bytes, got {got}"
                )
        return all(t.storage_offset() % STAGING_ALIGN == 0 for t in host)


def _typed(region: torch.Tensor, kg: KernelGroup) -> torch.Tensor:
    return region.view(kg.dtype).view(kg.kv_size, kg.num_layers, kg.tokens_per_slot, kg.hidden_dim)

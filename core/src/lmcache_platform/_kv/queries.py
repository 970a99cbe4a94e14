"""The seed API's per-group queries of a cache context: shapes, block counts, staging views.

Upstream LMCache's platform layer named these; a server built on it asks them per kernel or
object group. :class:`GroupQueries` is a base of ``BaseCacheContext``, which holds what they
read (the groups, the pointer tables, the staging views) and checks slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import TransferError
from .plan import is_int

if TYPE_CHECKING:
    import torch

    from .._types import KVFormat
    from .groups import KernelGroup, KVLayerGroupsManager


class GroupQueries:
    """Per-group answers over a context's groups, pointers and staging views."""

    _manager: KVLayerGroupsManager
    _kv_pointers: list[torch.Tensor]
    _slot_kg_views: list[list[torch.Tensor]]

    def _check_open(self) -> None:
        raise NotImplementedError  # BaseCacheContext's

    def _slot(self, slot: int) -> int:
        raise NotImplementedError  # BaseCacheContext's

    def _object_group_view(self, slot: int, og: int) -> torch.Tensor:
        raise NotImplementedError  # BaseCacheContext's

    def _kg(self, kernel_group_idx: int) -> int:
        n = self._manager.num_kernel_groups
        if not is_int(kernel_group_idx) or not 0 <= kernel_group_idx < n:
            raise TransferError(f"kernel group {kernel_group_idx!r} out of range 0..{n - 1}")
        return kernel_group_idx

    def _kernel_group(self, kernel_group_idx: int) -> KernelGroup:
        return self._manager.kernel_groups[self._kg(kernel_group_idx)]

    def get_kernel_group_kv_pointers(self, kernel_group_idx: int) -> torch.Tensor:
        """1-D int64 tensor of the group's layer base addresses, on :attr:`device`."""
        self._check_open()
        return self._kv_pointers[self._kg(kernel_group_idx)]

    def get_engine_kv_format(self, kernel_group_idx: int) -> KVFormat:
        """The KV format of the group's layers, as discovered from the engine's tensors."""
        return self._kernel_group(kernel_group_idx).kv_format

    def tokens_kept_per_chunk(self, kernel_group_idx: int) -> int:
        """Tokens of a full chunk the group keeps (fewer than a chunk for a trimmed window)."""
        return self._kernel_group(kernel_group_idx).tokens_per_slot

    def get_slots_per_chunk_in_sw(self, kernel_group_idx: int) -> int:
        """Upstream LMCache's name for :meth:`tokens_kept_per_chunk` (it counts tokens, not
        staging slots); kept so ported code runs."""
        return self.tokens_kept_per_chunk(kernel_group_idx)

    def get_kernel_group_shape_dtype(
        self, num_tokens: int, kernel_group_idx: int
    ) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of ``num_tokens`` tokens of the group in chunk layout.

        The shape is ``[kv, layers, kept, hidden]``: ``kv`` is 2 (1 for MLA), and
        ``kept`` the tokens the group keeps when ``num_tokens`` is cut into chunks
        (all of them, unless the group is a trimmed sliding window).
        """
        import torch

        kg = self._kernel_group(kernel_group_idx)
        if not is_int(num_tokens) or num_tokens < 0:
            raise TransferError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        kept = self._manager.kept_tokens(num_tokens, kg.index)
        return torch.Size((kg.kv_size, kg.num_layers, kept, kg.hidden_dim)), kg.dtype

    def calculate_num_blocks(self, num_tokens: int, kernel_group_idx: int) -> int:
        """Block ids covering a chunk of ``num_tokens`` tokens in the group's engine group."""
        self._kg(kernel_group_idx)
        if not is_int(num_tokens) or num_tokens < 0:
            raise TransferError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return self._manager.blocks_for(num_tokens, kernel_group_idx)

    def get_temp_kernel_group_buffer(self, slot: int, kernel_group_idx: int) -> torch.Tensor:
        """Typed staging view ``[kv, layers, tokens_per_slot, hidden]`` of one group in a slot.

        In the ``"blocks"`` chunk format the same bytes hold the group's whole blocks
        (``[layers, tensors, *outer, blocks, *inner]``; see ``report_status()``'s ``block_order``).
        """
        return self._slot_kg_views[self._slot(slot)][self._kg(kernel_group_idx)]

    def get_temp_object_group_buffer(self, slot: int, object_group_idx: int) -> torch.Tensor:
        """Flat uint8 view spanning exactly the object group's kernel-group regions in a slot."""
        n = self._manager.num_object_groups
        if not is_int(object_group_idx) or not 0 <= object_group_idx < n:
            raise TransferError(f"object group {object_group_idx!r} out of range 0..{n - 1}")
        return self._object_group_view(self._slot(slot), object_group_idx)

    def cache_size_per_token(self) -> int:
        """Bytes one token occupies in the engine's paged caches, over all layers."""
        return sum(kg.bytes_per_token for kg in self._manager.kernel_groups)

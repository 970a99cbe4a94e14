"""``HostMemoryCacheContext``: the base cache context, checking host memory before each transfer."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from .._kv.context import BaseCacheContext
from ._wrapper import HostMemoryIPCWrapper

if TYPE_CHECKING:
    from .._kv.transfer import ChunkTransfer


class HostMemoryCacheContext(BaseCacheContext):
    """The base cache context over host memory, checking the memory before each transfer.

    Before every store and retrieve it calls :meth:`HostMemoryIPCWrapper.verify` on each
    of its wrappers, so memory that another process truncated is refused with
    ``DescriptorError`` instead of crashing the server with SIGBUS. Everything else is
    the base's generic torch machinery, which is what host memory needs.
    """

    device_type: ClassVar[str] = "cpu"

    def verify_memory(self) -> None:
        """Raise ``DescriptorError`` if any wrapper's memory shrank since it was mapped."""
        for wrapper in self.kv_caches:
            if isinstance(wrapper, HostMemoryIPCWrapper):
                wrapper.verify()

    def store(self, plan: ChunkTransfer) -> None:
        self.verify_memory()
        super().store(plan)

    def retrieve(self, plan: ChunkTransfer) -> None:
        self.verify_memory()
        super().retrieve(plan)

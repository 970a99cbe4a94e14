"""``HostMemoryCacheContext``: the base cache context, checking host memory before each transfer."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, ClassVar

from .._kv.context import BaseCacheContext
from .._libc import populate
from ._filemap import FileMapIPCWrapper
from ._wrapper import HostMemoryIPCWrapper

if TYPE_CHECKING:
    from .._kv.transfer import ChunkTransfer


class HostMemoryCacheContext(BaseCacheContext):
    """The base cache context over host memory, checking the memory before each transfer.

    Before every store and retrieve it calls :meth:`HostMemoryIPCWrapper.verify` on each
    of its wrappers, so memory that another process truncated is refused with
    ``DescriptorError`` instead of crashing the server with SIGBUS. Everything else is
    the base's generic torch machinery, which is what host memory needs.
    :meth:`prefault_memory` maps every page of the engine's memory into this process.
    """

    device_type: ClassVar[str] = "cpu"
    #: Held for each populated piece; :meth:`close` takes it, so none outlives the mapping.
    _populate_lock: threading.Lock
    _populate_stopped: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._populate_lock = threading.Lock()  # before the base __init__: its hooks may close
        self._populate_stopped = False
        super().__init__(*args, **kwargs)

    def verify_memory(self) -> None:
        """Raise ``DescriptorError`` if any wrapper's memory shrank since it was mapped."""
        for wrapper in self.kv_caches:
            if isinstance(wrapper, (HostMemoryIPCWrapper, FileMapIPCWrapper)):
                wrapper.verify()

    def prefault_memory(self) -> int:
        """Map every page of the engine's memory into this process, writable; bytes mapped.

        Otherwise each page faults in when a transfer first touches it, inside that
        transfer. One ``madvise(MADV_POPULATE_WRITE)`` per 16 MiB, no byte changed; it
        stops at the next piece once :meth:`close` begins. Raises
        :class:`~lmcache_platform.hostmem.PopulateUnsupported` before Linux 5.14.
        """
        spans = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.kv_tensors}
        lock = self._populate_lock
        return sum(
            populate(address, nbytes, lock=lock, stopped=lambda: self._populate_stopped or self.closed)
            for address, nbytes in spans.items()
        )

    def close(self) -> None:
        """Stop prefaulting (waiting for a piece under way), then close as the base does."""
        self._populate_stopped = True
        with self._populate_lock:  # no piece starts after this one
            pass
        super().close()

    def store(self, plan: ChunkTransfer) -> None:
        self.verify_memory()
        super().store(plan)

    def retrieve(self, plan: ChunkTransfer) -> None:
        self.verify_memory()
        super().retrieve(plan)

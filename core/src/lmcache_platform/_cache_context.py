"""``BaseCacheContext``: server-side view of one engine's registered KV caches.

Contract with backends (stable within an API major):

* The constructor is ``cls(kv_caches, config)``: the list of IPC wrappers (one per
  layer) and a frozen :class:`CacheContextConfig`. Backends never see a positional
  argument list, so new config fields do not break them.
* Transfers: :meth:`store_chunk` gathers one chunk from paged blocks into a staging
  slot; :meth:`retrieve_chunk` scatters a slot back into blocks.

(The full machinery lands with the CPU-backend issue.)
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ._ipc_wrapper import DeviceIPCWrapper
    from ._types import CacheContextConfig


class BaseCacheContext(abc.ABC):
    """Base of every backend's cache context."""

    #: torch device type served by this class; must match the backend's entry-point name.
    device_type: ClassVar[str] = ""

    def __init__(self, kv_caches: Sequence[DeviceIPCWrapper], config: CacheContextConfig) -> None:
        self.kv_caches = list(kv_caches)
        self.config = config
        self.lmcache_tokens_per_chunk = config.lmcache_tokens_per_chunk

    def close(self) -> None:
        """Release buffers and close every wrapper. Idempotent."""
        for wrapper in self.kv_caches:
            wrapper.close()

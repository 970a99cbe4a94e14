"""The CUDA backend's typed errors about virtual memory: each says what to change.

All are :class:`lmcache_platform.DescriptorError` subclasses, so code that handles
descriptor errors in general keeps working; an engine integration (the vLLM
connector) can catch one kind to explain it better.
"""

from __future__ import annotations

from lmcache_platform import DescriptorError

#: How to share memory from CUDA virtual memory management, for the legacy kinds' refusals.
VMM_HINT = (
    "memory from CUDA virtual memory management (vLLM's extensible KV cache, "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, vLLM sleep mode / CuMemAllocator) "
    "has no legacy IPC handle; share it with the VMM kind: LMCACHE_PLATFORM_CUDA_IPC=auto "
    "(the default) or vmm in the engine"
)
#: How to make an engine's VMM memory exportable, for VmmNotExportableError.
EXPORT_HINT = (
    "the engine must create its KV cache with exportable handles: the vLLM connector declares "
    "kv_cache_access() -> KVCacheAccess.EXPORTS_FD; or turn vLLM's extensible KV cache off "
    "(--no-enable-extensible-kv-cache, CacheConfig.enable_extensible_kv_cache=False) and share "
    "the allocator's memory with a legacy kind (LMCACHE_PLATFORM_CUDA_IPC=torch or raw)"
)


class VmmMemoryError(DescriptorError):
    """A legacy IPC kind (torch, raw) was asked to share CUDA virtual memory."""


class NotVmmMemoryError(DescriptorError):
    """The VMM kind was asked to share memory that CUDA virtual memory did not map."""


class VmmNotExportableError(DescriptorError):
    """CUDA virtual memory whose allocation was created without a POSIX-fd handle type."""


class VmmUnsupportedError(DescriptorError):
    """This driver or device cannot import the memory: no VMM, no POSIX-fd handles, or a
    granularity the descriptor's segments do not respect."""

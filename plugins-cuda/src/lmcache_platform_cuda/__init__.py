"""The CUDA backend of lmcache-platform: KV tensors shared through CUDA IPC.

Importing the package is cheap (no torch); the public names load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_platform import lazy_exports

if TYPE_CHECKING:
    from ._auto import CudaAutoIPCWrapper
    from ._cache_context import GPUCacheContext
    from ._config import IPC_ENV, selected_ipc_kind
    from ._errors import NotVmmMemoryError, VmmMemoryError, VmmNotExportableError, VmmUnsupportedError
    from ._event import CudaEvent
    from ._raw_ipc import RawCudaIPCWrapper
    from ._torch_ipc import CudaIPCWrapper
    from ._vmm_ipc import CudaVmmIPCWrapper, is_vmm_memory

__all__ = [
    "IPC_ENV",
    "CudaAutoIPCWrapper",
    "CudaEvent",
    "CudaIPCWrapper",
    "CudaVmmIPCWrapper",
    "GPUCacheContext",
    "NotVmmMemoryError",
    "RawCudaIPCWrapper",
    "VmmMemoryError",
    "VmmNotExportableError",
    "VmmUnsupportedError",
    "is_vmm_memory",
    "selected_ipc_kind",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "._auto": ["CudaAutoIPCWrapper"],
        "._cache_context": ["GPUCacheContext"],
        "._config": ["IPC_ENV", "selected_ipc_kind"],
        "._errors": ["NotVmmMemoryError", "VmmMemoryError", "VmmNotExportableError", "VmmUnsupportedError"],
        "._event": ["CudaEvent"],
        "._raw_ipc": ["RawCudaIPCWrapper"],
        "._torch_ipc": ["CudaIPCWrapper"],
        "._vmm_ipc": ["CudaVmmIPCWrapper", "is_vmm_memory"],
    },
)

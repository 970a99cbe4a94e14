"""The CUDA backend of lmcache-platform: KV tensors shared through CUDA IPC.

Importing the package is cheap (no torch); the public names load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

_LAZY = {
    "CudaIPCWrapper": "._torch_ipc",
    "RawCudaIPCWrapper": "._raw_ipc",
    "CudaVmmIPCWrapper": "._vmm_ipc",
    "CudaAutoIPCWrapper": "._auto",
    "is_vmm_memory": "._vmm_ipc",
    "selected_ipc_kind": "._config",
    "VmmMemoryError": "._errors",
    "NotVmmMemoryError": "._errors",
    "VmmNotExportableError": "._errors",
    "VmmUnsupportedError": "._errors",
    "GPUCacheContext": "._cache_context",
    "CudaEvent": "._event",
    "IPC_ENV": "._config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)

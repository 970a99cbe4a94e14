"""The CUDA backend of lmcache-platform: KV tensors shared through CUDA IPC.

Importing the package is cheap (no torch); the public classes load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._cache_context import GPUCacheContext
    from ._config import IPC_ENV
    from ._event import CudaEvent
    from ._raw_ipc import RawCudaIPCWrapper
    from ._torch_ipc import CudaIPCWrapper

__all__ = ["IPC_ENV", "CudaEvent", "CudaIPCWrapper", "GPUCacheContext", "RawCudaIPCWrapper"]

_LAZY = {
    "CudaIPCWrapper": "._torch_ipc",
    "RawCudaIPCWrapper": "._raw_ipc",
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

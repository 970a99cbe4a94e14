"""Hook implementations of the ``cuda`` backend (entry point ``cuda``).

Imported at discovery, so it imports nothing heavy: torch and the wrapper modules
load inside the hooks, which core calls once per process when ``cuda`` is resolved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_platform import hookimpl

if TYPE_CHECKING:
    from lmcache_platform import Availability, BaseCacheContext, DeviceEvent, DeviceIPCWrapper

DEVICE_TYPE = "cuda"
#: The backend-API major this code was written against: a literal, never
#: ``lmcache_platform.API_VERSION``, so that a core speaking another major refuses it.
TARGET_API = 1


@hookimpl
def lmcache_platform_api_version() -> int:
    return TARGET_API


@hookimpl
def lmcache_platform_probe(device_type: str) -> Availability | None:
    if device_type != DEVICE_TYPE:
        return None
    from ._probe import probe

    return probe()


@hookimpl
def lmcache_platform_cache_context_class(device_type: str) -> type[BaseCacheContext] | None:
    if device_type != DEVICE_TYPE:
        return None
    from ._cache_context import GPUCacheContext

    return GPUCacheContext


@hookimpl
def lmcache_platform_ipc_wrapper_class(device_type: str) -> type[DeviceIPCWrapper] | None:
    """The kind ``LMCACHE_PLATFORM_CUDA_IPC`` names; ``auto`` (default) picks one per tensor."""
    if device_type != DEVICE_TYPE:
        return None
    from ._config import ipc_kind

    kind = ipc_kind()
    if kind == "raw":
        from ._raw_ipc import RawCudaIPCWrapper

        return RawCudaIPCWrapper
    if kind == "vmm":
        from ._vmm_ipc import CudaVmmIPCWrapper

        return CudaVmmIPCWrapper
    if kind == "torch":
        from ._torch_ipc import CudaIPCWrapper

        return CudaIPCWrapper
    from ._auto import CudaAutoIPCWrapper

    return CudaAutoIPCWrapper


@hookimpl
def lmcache_platform_wire_classes(device_type: str) -> Sequence[type[DeviceIPCWrapper]] | None:
    """Every kind, whatever the engine chose: the receiver must accept each."""
    if device_type != DEVICE_TYPE:
        return None
    from ._raw_ipc import RawCudaIPCWrapper
    from ._torch_ipc import CudaIPCWrapper
    from ._vmm_ipc import CudaVmmIPCWrapper

    return (CudaIPCWrapper, RawCudaIPCWrapper, CudaVmmIPCWrapper)


@hookimpl
def lmcache_platform_device_event_class(device_type: str) -> type[DeviceEvent] | None:
    """``CudaEvent``: servers order their copies after the engine's kernels without a device sync."""
    if device_type != DEVICE_TYPE:
        return None
    from ._event import CudaEvent

    return CudaEvent

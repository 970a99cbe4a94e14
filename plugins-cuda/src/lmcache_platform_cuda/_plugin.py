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
    """``CudaIPCWrapper``, or ``RawCudaIPCWrapper`` when ``LMCACHE_PLATFORM_CUDA_IPC=raw``."""
    if device_type != DEVICE_TYPE:
        return None
    from ._config import ipc_kind

    if ipc_kind() == "raw":
        from ._raw_ipc import RawCudaIPCWrapper

        return RawCudaIPCWrapper
    from ._torch_ipc import CudaIPCWrapper

    return CudaIPCWrapper


@hookimpl
def lmcache_platform_wire_classes(device_type: str) -> Sequence[type[DeviceIPCWrapper]] | None:
    """Both kinds, whatever the engine chose: the receiver must accept either."""
    if device_type != DEVICE_TYPE:
        return None
    from ._raw_ipc import RawCudaIPCWrapper
    from ._torch_ipc import CudaIPCWrapper

    return (CudaIPCWrapper, RawCudaIPCWrapper)


@hookimpl
def lmcache_platform_device_event_class(device_type: str) -> type[DeviceEvent] | None:
    """``CudaEvent``: servers order their copies after the engine's kernels without a device sync."""
    if device_type != DEVICE_TYPE:
        return None
    from ._event import CudaEvent

    return CudaEvent

"""lmcache-platform: the device-platform plugin layer for LLM KV caches."""

from ._cache_context import BaseCacheContext
from ._errors import (
    AmbiguousBackendError,
    ApiVersionError,
    BackendLoadError,
    BackendNotFoundError,
    BackendSelectionError,
    BackendUnavailableError,
    DescriptorError,
    LayoutError,
    LMCachePlatformError,
    TransferError,
    WireFormatError,
    WrapError,
)
from ._hookspecs import hookimpl
from ._ipc_wrapper import DeviceIPCWrapper, WireField
from ._types import (
    Availability,
    CacheContextConfig,
    EngineGroupInfo,
    EngineType,
    KVFormat,
    LayoutHints,
)
from ._version import API_VERSION, __version__

__all__ = [
    "API_VERSION",
    "AmbiguousBackendError",
    "ApiVersionError",
    "Availability",
    "BackendLoadError",
    "BackendNotFoundError",
    "BackendSelectionError",
    "BackendUnavailableError",
    "BaseCacheContext",
    "CacheContextConfig",
    "DescriptorError",
    "DeviceIPCWrapper",
    "EngineGroupInfo",
    "EngineType",
    "KVFormat",
    "LMCachePlatformError",
    "LayoutError",
    "LayoutHints",
    "TransferError",
    "WireField",
    "WireFormatError",
    "WrapError",
    "__version__",
    "hookimpl",
]

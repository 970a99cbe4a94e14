"""``CudaAutoIPCWrapper``: ``LMCACHE_PLATFORM_CUDA_IPC=auto``, a kind per tensor.

CUDA memory comes in two kinds that share differently: the caching allocator's
blocks (legacy IPC; the torch kind) and virtual memory, vLLM 0.34's KV cache among
it (POSIX fds; the VMM kind). This class is what the backend's hook returns for
``auto``; core's :func:`lmcache_platform.wrap_kv_caches` asks its
:meth:`~lmcache_platform.DeviceIPCWrapper.wrapper_class_for` which kind wraps each
tensor. It is a torch-kind class itself (same wire tag), so that anything built
from it directly is a working torch descriptor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._torch_ipc import CudaIPCWrapper
from ._vmm_ipc import CudaVmmIPCWrapper, is_vmm_memory

if TYPE_CHECKING:
    import torch

    from lmcache_platform import DeviceIPCWrapper


class CudaAutoIPCWrapper(CudaIPCWrapper):
    """The torch kind for allocator memory, the VMM kind for CUDA virtual memory."""

    @classmethod
    def wrapper_class_for(cls, tensor: torch.Tensor) -> type[DeviceIPCWrapper]:
        return CudaVmmIPCWrapper if is_vmm_memory(tensor) else CudaIPCWrapper

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> DeviceIPCWrapper:  # type: ignore[override]
        """The chosen kind's descriptor, for callers of the bare factory (``get_kv_wrapper_factory``)."""
        return cls.wrapper_class_for(tensor).wrap(tensor)

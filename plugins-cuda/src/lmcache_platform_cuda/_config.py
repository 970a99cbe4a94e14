"""Operator switches of the CUDA backend: the IPC kind, and the transfer path.

``LMCACHE_PLATFORM_CUDA_IPC`` picks how an engine exports its KV cache: ``auto``
(default) chooses per tensor, the VMM kind for CUDA virtual memory and the torch kind
for the caching allocator's memory; ``torch``, ``raw`` and ``vmm`` force one kind. It
is read each time the backend is asked for its wrapper class, never at import, so a
test or launcher can set it late. The receiving side accepts every kind whatever the
variable says. ``LMCACHE_PLATFORM_CUDA_KERNELS`` picks how a server's context moves
chunks: the fused Triton kernels (default) or the generic torch ops.
"""

from __future__ import annotations

from typing import Literal

from lmcache_platform import env_choice

IPC_ENV = "LMCACHE_PLATFORM_CUDA_IPC"
IpcKind = Literal["auto", "torch", "raw", "vmm"]
_KINDS: tuple[IpcKind, ...] = ("auto", "torch", "raw", "vmm")


def ipc_kind() -> IpcKind:
    """The IPC kind selected by :data:`IPC_ENV` (``auto`` when unset or empty).

    Any other value raises :class:`lmcache_platform.EnvironmentValueError`.
    """
    return env_choice(IPC_ENV, _KINDS, "auto", what="a CUDA IPC kind")


KERNELS_ENV = "LMCACHE_PLATFORM_CUDA_KERNELS"
KernelsKind = Literal["triton", "torch"]
_KERNELS: tuple[KernelsKind, ...] = ("triton", "torch")


def kernels_choice() -> KernelsKind:
    """How a ``GPUCacheContext`` moves chunks, by :data:`KERNELS_ENV`: ``triton`` (default;
    the fused kernels where they apply) or ``torch`` (the generic torch ops everywhere).

    Read when a context makes its first transfer. Any other value raises
    :class:`lmcache_platform.EnvironmentValueError`.
    """
    return env_choice(KERNELS_ENV, _KERNELS, "triton", what="a CUDA transfer path")


def selected_ipc_kind() -> str:
    """What this process's engine side exports with: ``auto``, ``torch``, ``raw`` or ``vmm``.

    Read from :data:`IPC_ENV` now. An engine integration asks it to say how it will
    reach the KV cache (vLLM: ``kv_cache_access()`` is ``EXPORTS_FD`` for ``auto`` and
    ``vmm``, so that vLLM creates its virtual memory exportable). Raises
    :class:`lmcache_platform.EnvironmentValueError` for a value that is no kind.
    """
    return ipc_kind()

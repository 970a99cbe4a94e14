"""Operator switches of the CUDA backend: the IPC kind, and the transfer path.

``LMCACHE_PLATFORM_CUDA_IPC`` picks the wrapper an engine exports with: ``torch``
(default; PyTorch storage IPC) or ``raw`` (driver-level ``cuIpc*`` handles, for
processes in separate containers). It is read each time the backend is asked for
its wrapper class, never at import, so a test or launcher can set it late. The
receiving side accepts both kinds whatever the variable says.
``LMCACHE_PLATFORM_CUDA_KERNELS`` picks how a server's context moves chunks: the fused
Triton kernels (default) or the generic torch ops.
"""

from __future__ import annotations

from typing import Literal

from lmcache_platform import env_choice

IPC_ENV = "LMCACHE_PLATFORM_CUDA_IPC"
IpcKind = Literal["torch", "raw"]
_KINDS: tuple[IpcKind, ...] = ("torch", "raw")


def ipc_kind() -> IpcKind:
    """The IPC kind selected by :data:`IPC_ENV` (``torch`` when unset or empty).

    Any other value raises :class:`lmcache_platform.EnvironmentValueError`.
    """
    return env_choice(IPC_ENV, _KINDS, "torch", what="a CUDA IPC kind")


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

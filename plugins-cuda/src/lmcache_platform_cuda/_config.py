"""Operator switch between the two CUDA IPC kinds.

``LMCACHE_PLATFORM_CUDA_IPC`` picks the wrapper an engine exports with: ``torch``
(default; PyTorch storage IPC) or ``raw`` (driver-level ``cuIpc*`` handles, for
processes in separate containers). It is read each time the backend is asked for
its wrapper class, never at import, so a test or launcher can set it late. The
receiving side accepts both kinds whatever the variable says.
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

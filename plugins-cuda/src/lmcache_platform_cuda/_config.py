"""Operator switch between the two CUDA IPC kinds.

``LMCACHE_PLATFORM_CUDA_IPC`` picks the wrapper an engine exports with: ``torch``
(default; PyTorch storage IPC) or ``raw`` (driver-level ``cuIpc*`` handles, for
processes in separate containers). It is read each time the backend is asked for
its wrapper class, never at import, so a test or launcher can set it late. The
receiving side accepts both kinds whatever the variable says.
"""

from __future__ import annotations

import os
from typing import Literal

from lmcache_platform import BackendLoadError

IPC_ENV = "LMCACHE_PLATFORM_CUDA_IPC"
IpcMode = Literal["torch", "raw"]
_MODES: tuple[IpcMode, ...] = ("torch", "raw")


def ipc_mode() -> IpcMode:
    """The IPC kind selected by :data:`IPC_ENV` (``torch`` when unset or empty)."""
    raw = os.environ.get(IPC_ENV, "")
    value = raw.strip().lower() or "torch"
    for mode in _MODES:
        if value == mode:
            return mode
    raise BackendLoadError(
        f"{IPC_ENV}={raw!r} is not a CUDA IPC kind; use one of: {', '.join(_MODES)}",
        backend="cuda",
        distribution="lmcache-platform-cuda",
    )

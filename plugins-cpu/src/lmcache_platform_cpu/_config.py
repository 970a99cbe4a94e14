"""Operator switch between the two CPU IPC kinds.

``LMCACHE_PLATFORM_CPU_IPC`` picks the wrapper an engine exports with: ``memfd``
(default; sealed memfds found through /proc) or ``shm`` (named POSIX segments in
/dev/shm, for processes in different pid namespaces that share /dev/shm). It is read
each time the backend is asked for its wrapper class, never at import, so a test or
launcher can set it late. The receiving side accepts both kinds whatever it says.
"""

from __future__ import annotations

import os
from typing import Literal

from lmcache_platform import BackendLoadError

IPC_ENV = "LMCACHE_PLATFORM_CPU_IPC"
IpcKind = Literal["memfd", "shm"]
_KINDS: tuple[IpcKind, ...] = ("memfd", "shm")


def ipc_kind() -> IpcKind:
    """The IPC kind selected by :data:`IPC_ENV` (``memfd`` when unset or empty)."""
    raw = os.environ.get(IPC_ENV, "")
    value = raw.strip().lower() or "memfd"
    for kind in _KINDS:
        if value == kind:
            return kind
    raise BackendLoadError(
        f"{IPC_ENV}={raw!r} is not a CPU IPC kind; use one of: {', '.join(_KINDS)}",
        backend="cpu",
        distribution="lmcache-platform-cpu",
    )

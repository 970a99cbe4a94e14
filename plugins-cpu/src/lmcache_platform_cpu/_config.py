"""Operator switch between the two CPU IPC kinds.

``LMCACHE_PLATFORM_CPU_IPC`` picks the wrapper an engine exports with: ``memfd``
(default; sealed memfds found through /proc) or ``shm`` (named POSIX segments in
/dev/shm, for processes in different pid namespaces that share /dev/shm). It is read
each time the backend is asked for its wrapper class, never at import, so a test or
launcher can set it late. The receiving side accepts both kinds whatever it says.
"""

from __future__ import annotations

from typing import Literal

from lmcache_platform import env_choice

IPC_ENV = "LMCACHE_PLATFORM_CPU_IPC"
IpcKind = Literal["memfd", "shm"]
_KINDS: tuple[IpcKind, ...] = ("memfd", "shm")


def ipc_kind() -> IpcKind:
    """The IPC kind selected by :data:`IPC_ENV` (``memfd`` when unset or empty).

    Any other value raises :class:`lmcache_platform.EnvironmentValueError`.
    """
    return env_choice(IPC_ENV, _KINDS, "memfd", what="a CPU IPC kind")

"""Hook implementations of the ``cpu`` backend (the entry point's target).

Kept light: importing this module imports neither torch nor the memory code; each
hook imports what it returns.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_platform import Availability, hookimpl

if TYPE_CHECKING:
    from lmcache_platform import BaseCacheContext, DeviceIPCWrapper, DoctorFinding

DEVICE_TYPE = "cpu"
#: The backend-API major this code was written against: a literal, never
#: ``lmcache_platform.API_VERSION``, so that a core speaking another major refuses it.
TARGET_API = 1


@hookimpl
def lmcache_platform_api_version() -> int:
    return TARGET_API


@hookimpl
def lmcache_platform_cache_context_class(device_type: str) -> type[BaseCacheContext] | None:
    if device_type != DEVICE_TYPE:
        return None
    from ._cache_context import CPUCacheContext

    return CPUCacheContext


@hookimpl
def lmcache_platform_ipc_wrapper_class(device_type: str) -> type[DeviceIPCWrapper] | None:
    """``CpuMemfdIPCWrapper``, or ``CpuShmIPCWrapper`` when ``LMCACHE_PLATFORM_CPU_IPC=shm``."""
    if device_type != DEVICE_TYPE:
        return None
    from ._config import ipc_kind

    if ipc_kind() == "shm":
        from ._wrapper import CpuShmIPCWrapper

        return CpuShmIPCWrapper
    from ._wrapper import CpuMemfdIPCWrapper

    return CpuMemfdIPCWrapper


@hookimpl
def lmcache_platform_wire_classes(device_type: str) -> Sequence[type[DeviceIPCWrapper]] | None:
    """Both kinds, whatever this process exports: the receiver must accept either.

    Also core's file mappings shared by fd (vLLM's native offloading region).
    """
    if device_type != DEVICE_TYPE:
        return None
    from lmcache_platform.hostmem import FileMapIPCWrapper

    from ._wrapper import CpuMemfdIPCWrapper, CpuShmIPCWrapper

    return (CpuMemfdIPCWrapper, CpuShmIPCWrapper, FileMapIPCWrapper)


@hookimpl
def lmcache_platform_probe(device_type: str) -> Availability | None:
    """Usable on Linux: with memfds and a readable /proc (``memfd``), or a writable /dev/shm (``shm``)."""
    if device_type != DEVICE_TYPE:
        return None
    from ._config import ipc_kind

    kind = ipc_kind()
    if not sys.platform.startswith("linux"):
        return Availability.no(f"the cpu backend's {kind} export needs Linux, not {sys.platform}")
    if kind == "memfd":
        if not hasattr(os, "memfd_create"):
            return Availability.no("this Python has no os.memfd_create; set LMCACHE_PLATFORM_CPU_IPC=shm")
        if not os.access("/proc/self/fd", os.R_OK | os.X_OK):
            return Availability.no("/proc is not mounted or not readable; set LMCACHE_PLATFORM_CPU_IPC=shm")
        return Availability.yes()
    from . import _shm  # needs CPython's _posixshmem, present on Linux

    if not os.path.isdir(_shm.SHM_DIR):
        return Availability.no(f"{_shm.SHM_DIR} does not exist; mount a tmpfs there")
    if not os.access(_shm.SHM_DIR, os.W_OK | os.X_OK):
        return Availability.no(f"{_shm.SHM_DIR} is not writable by uid {os.geteuid()}")
    return Availability.yes()


@hookimpl
def lmcache_platform_gc(dry_run: bool) -> list[str]:
    """Segments of this user's dead producers in /dev/shm (removed unless ``dry_run``).

    Named segments only: a memfd export needs no collection, since the kernel frees it
    with the last process that holds it.
    """
    from ._gc import reclaim_stale_segments
    from ._shm import SHM_DIR

    return [f"{SHM_DIR}/{name}" for name in reclaim_stale_segments(dry_run=dry_run)]


@hookimpl
def lmcache_platform_doctor(device_type: str) -> list[DoctorFinding] | None:
    """Where the KV caches of the export kind in use live, and whether there is room."""
    if device_type != DEVICE_TYPE:
        return None
    from ._doctor import findings

    return findings()

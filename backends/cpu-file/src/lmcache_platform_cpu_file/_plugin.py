"""Hook implementations of the ``cpu.file`` backend (the entry point's target).

Importing this module loads neither torch nor the wrapper: each hook imports what
it returns, when core resolves the ``cpu`` device type.
"""

from __future__ import annotations

import os
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
    from ._cache_context import CpuFileCacheContext

    return CpuFileCacheContext


@hookimpl
def lmcache_platform_ipc_wrapper_class(device_type: str) -> type[DeviceIPCWrapper] | None:
    if device_type != DEVICE_TYPE:
        return None
    from ._wrapper import CpuFileIPCWrapper

    return CpuFileIPCWrapper


@hookimpl
def lmcache_platform_probe(device_type: str) -> Availability | None:
    """Usable once ``LMCACHE_PLATFORM_CPU_FILE_DIR`` names a private, writable directory.

    Unset means "not configured": the backend then stays out of the way of ``cpu``.
    """
    if device_type != DEVICE_TYPE:
        return None
    if os.name != "posix":
        return Availability.no(f"KV files need a POSIX system, not {os.name}")
    from . import _store

    try:
        d = _store.directory()
    except _store.DirectoryError as exc:
        return Availability.no(str(exc))
    if d.read_only:
        return Availability.no(f"{_store.ENV_DIR}={d.path} is on a read-only file system")
    return Availability.yes()


@hookimpl
def lmcache_platform_gc(dry_run: bool) -> list[str]:
    """KV files of this user's dead producers (removed unless ``dry_run``)."""
    from ._gc import reclaim_stale_files

    return reclaim_stale_files(dry_run=dry_run)


@hookimpl
def lmcache_platform_doctor(device_type: str) -> list[DoctorFinding] | None:
    """Where the KV files live and how much room is left there (``lmcache-platform doctor``)."""
    if device_type != DEVICE_TYPE:
        return None
    from lmcache_platform import DoctorFinding, format_bytes

    from . import _store

    d = _store.directory()  # doctor asks only when the probe said yes: it is configured
    free = d.free_bytes()
    found = [DoctorFinding.info(f"KV files in {d.path}: {format_bytes(free)} free")]
    if free < 1 << 30:
        found.append(
            DoctorFinding.warning(
                f"{d.path} has less than 1 GiB free: free it, or point "
                f"{_store.ENV_DIR} at a larger file system"
            )
        )
    return found

"""The ``cpu`` backend's lines in ``lmcache-platform doctor``: where its memory lives.

Only the export kind in use is reported: /dev/shm matters to the ``shm`` kind alone, a
memfd export never touches it.
"""

from __future__ import annotations

import os

from lmcache_platform import DoctorFinding, format_bytes

#: Below this, a real model's KV cache does not fit (Docker's default /dev/shm is 64 MiB).
MIN_BYTES = 1 << 30
#: How to get room for CPU KV caches when /dev/shm is small or missing.
SHM_FIX = (
    "enlarge it (Docker: `--shm-size=16g`; Kubernetes: an emptyDir volume with medium: Memory "
    "on /dev/shm), or unset LMCACHE_PLATFORM_CPU_IPC to export sealed memfds, which /dev/shm "
    "does not limit"
)


def findings() -> list[DoctorFinding]:
    from ._config import ipc_kind

    if ipc_kind() == "memfd":
        return [
            DoctorFinding.info(
                "exports CPU KV caches as sealed memfds (anonymous shared memory: "
                "the container's memory limit applies, /dev/shm does not)"
            )
        ]
    from ._shm import SHM_DIR

    return shm_findings(SHM_DIR)


def shm_findings(path: str) -> list[DoctorFinding]:
    """What the ``shm`` export kind needs from ``path``: room for the KV caches."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return [DoctorFinding.warning(f"{path} is not usable ({exc.strerror or exc}): {SHM_FIX}")]
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    size, room = format_bytes(total), f"{format_bytes(free)} free of {format_bytes(total)}"
    out = [DoctorFinding.info(f"exports CPU KV caches as {path} segments: {room}")]
    if total < MIN_BYTES:
        out.append(DoctorFinding.warning(f"{path} is only {size} (CPU KV caches live there): {SHM_FIX}"))
    elif free < MIN_BYTES:
        out.append(DoctorFinding.warning(f"{path} has only {room}: free it or {SHM_FIX}"))
    return out

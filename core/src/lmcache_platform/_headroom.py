"""How much more anonymous shared memory this process may take: its memory cgroups, then the host.

A memfd or a ``/dev/shm`` page counts against the memory cgroup of the process that
touches it first, not against any file system; stores check :func:`memory_headroom`
before they create memory, so a full cgroup is an error naming the limit rather than
the OOM killer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._units import format_bytes

#: Where cgroup file systems are mounted (Linux).
CGROUP_ROOT = "/sys/fs/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 says "no limit" with a huge page-aligned number


@dataclass(frozen=True)
class Headroom:
    """How much more memory this process may take, and which limit says so."""

    #: Bytes that may still be allocated under ``limit``.
    free: int
    #: The binding limit (a cgroup file, or the host's memory), named in error messages.
    limit: str


def memory_headroom() -> Headroom | None:
    """The tightest memory limit on this process: its memory cgroups, then the host.

    Anonymous shared memory (a memfd, ``/dev/shm`` pages) counts against the memory
    cgroup of the process that touches it first, not against any file system. For
    each cgroup from this process's up to the root (v2: ``memory.max`` less
    ``memory.current``; v1: ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``),
    reclaimable file cache (``inactive_file``) counting as free, and for the host
    (``MemAvailable`` plus ``SwapFree``), the smallest headroom wins. None where none
    can be read (no /proc).
    """
    found = [h for h in (*_cgroup_headrooms(), _host_headroom()) if h is not None]
    return min(found, key=lambda h: h.free) if found else None


def _cgroup_headrooms() -> list[Headroom]:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out: list[Headroom] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            out += _walk(CGROUP_ROOT, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            out += _walk(
                os.path.join(CGROUP_ROOT, "memory"),
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
    return out


def _walk(root: str, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[Headroom]:
    """Headrooms of the cgroup at ``path`` under ``root`` and of its ancestors below ``root``.

    In a container the hierarchy is often mounted at the container's own cgroup, so a
    ``path`` that does not exist under ``root`` means ``root`` is that cgroup.
    """
    here = os.path.normpath(os.path.join(root, path.lstrip("/")))
    if not os.path.isdir(here):
        here = root
    out = []
    while True:
        limit, usage = _read_int(os.path.join(here, limit_file)), _read_int(os.path.join(here, usage_file))
        if limit is not None and usage is not None and limit < _UNLIMITED:
            usage -= min(usage, _stat_value(os.path.join(here, "memory.stat"), inactive_key))
            what = f"the memory cgroup limit {os.path.join(here, limit_file)}"
            out.append(
                Headroom(
                    max(0, limit - usage), f"{what} ({format_bytes(limit)}, {format_bytes(usage)} in use)"
                )
            )
        if here == root or not here.startswith(root + os.sep):
            return out
        here = os.path.dirname(here)


def _host_headroom() -> Headroom | None:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "SwapFree"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in values:
        return None
    free = values["MemAvailable"] + values.get("SwapFree", 0)
    return Headroom(free, "the host's available memory (MemAvailable + SwapFree in /proc/meminfo)")


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        return 0
    return 0

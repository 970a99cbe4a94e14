"""Reclaiming segments whose producer died without unlinking them (SIGKILL, OOM kill).

A producer unlinks its segments when their tensors die and at exit, but a killed
process runs no cleanup, and /dev/shm keeps its segments until reboot. Which
segments are stale is decided by :func:`lmcache_platform.hostmem.find_stale`: ours by
name, of the current user, made in this pid namespace, and whose producer is gone,
a zombie, or a reused pid. Anything uncertain counts as alive: ``gc`` may miss a
stale segment, never delete a live one. No torch here.
"""

from __future__ import annotations

from lmcache_platform import hostmem

from . import _shm

#: Kept as a module attribute so tests can probe the liveness rule directly.
_producer_alive = hostmem.producer_alive


def reclaim_stale_segments(dry_run: bool = True) -> list[str]:
    """Return the stale segments of dead producers, unlinking them unless ``dry_run``.

    Backs ``lmcache-platform gc`` (dry run by default; ``--yes`` deletes).
    """
    stale = hostmem.find_stale(_shm.SHM_DIR, _shm.NAMES)
    if not dry_run:
        for name in stale:
            _shm.unlink_any(name)
    return stale

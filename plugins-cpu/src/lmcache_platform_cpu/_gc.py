"""Reclaiming segments whose producer died without unlinking them (SIGKILL, OOM kill).

A producer unlinks its segments when their tensors die and at exit, but a killed
process runs no cleanup, and /dev/shm keeps its segments until reboot. A segment is
stale when, all of these holding:

* its name is ours (prefix and pattern) and it is a regular file of the current user;
* it was made in this pid namespace (another container sharing /dev/shm has its own
  pids, which this process cannot judge);
* its producer pid is gone, a zombie, or now names a process that started after the
  segment was last changed (the pid was reused).

Anything uncertain counts as alive: ``gc`` may miss a stale segment, never delete a
live one. No torch here.
"""

from __future__ import annotations

import os
import stat

from lmcache_platform import DescriptorError

from . import _shm


def reclaim_stale_segments(dry_run: bool = True) -> list[str]:
    """Return the stale segments of dead producers, unlinking them unless ``dry_run``.

    Backs ``lmcache-platform gc`` (dry run by default; ``--yes`` deletes).
    """
    try:
        entries = sorted(os.listdir(_shm.SHM_DIR))
    except FileNotFoundError:
        return []
    stale = []
    for name in entries:
        if not name.startswith(_shm.PREFIX):
            continue
        try:
            pidns, pid = _shm.parse_name(name)
        except DescriptorError:
            continue  # our prefix but not our pattern: not ours to judge
        if pidns != _shm.pid_namespace():
            continue
        try:
            st = os.lstat(os.path.join(_shm.SHM_DIR, name))
        except FileNotFoundError:
            continue  # unlinked meanwhile
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _producer_alive(pid, st.st_ctime):
            continue
        if not dry_run:
            _shm.unlink_any(name)
        stale.append(name)
    return stale


def _producer_alive(pid: int, segment_ctime: float) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else: maybe a reused pid, checked below
    info = _process_state_and_start(pid)
    if info is None:
        return True
    state, started = info
    if state in ("Z", "X"):  # zombie or dead: its cleanup will never run
        return False
    return started is None or started <= segment_ctime


def _process_state_and_start(pid: int) -> tuple[str, float | None] | None:
    """``(state letter, start time in epoch seconds)`` from /proc, or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return ("X", None)  # exited between kill() and here
    except OSError:
        return None
    state = fields[0] if fields else "?"
    boot = _boot_time()
    if boot is None or len(fields) < 20:
        return state, None
    # Field 22 (starttime, clock ticks after boot); fields[0] is field 3. The boot time
    # is truncated to whole seconds, which can only make a process look older: safe.
    return state, boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        return None  # no /proc: the caller falls back to "alive"
    return None

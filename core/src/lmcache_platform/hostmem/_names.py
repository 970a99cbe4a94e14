"""Names of shared memory that tell a garbage collector who made them, and whether they live.

:class:`SegmentNames` makes unguessable names carrying the producer's pid namespace and
pid; :func:`find_stale` and :func:`producer_alive` are the collector's liveness test.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

from .._errors import DescriptorError

_pidns: int | None = None


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 where it cannot be read).

    Part of every name, so a collector never judges a pid from another namespace
    (a sidecar container sharing the directory) against its own process table.
    """
    global _pidns
    if _pidns is None:
        try:
            _pidns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            _pidns = 0
    return _pidns


class SegmentNames:
    """Names ``<prefix><pid namespace>_<pid>_<128 random bits in hex>``.

    The random part makes a name unguessable: nobody can pre-create it (to make an
    exclusive create fail) or be pointed at memory it was not given. The pid lets
    :func:`find_stale` tell whether the producer is alive. The pattern admits no
    ``/``, ``..`` or other separator, so a parsed name can never address anything
    outside the store's directory.
    """

    def __init__(self, prefix: str, *, kind: str = "host-memory", noun: str = "segment") -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,47}_", prefix):
            raise ValueError(f"a name prefix is lowercase letters, digits and '_', ending in '_': {prefix!r}")
        self.prefix = prefix
        self.max_len = len(prefix) + 20 + 1 + 10 + 1 + 32
        self._kind, self._noun = kind, noun
        self._re = re.compile(rf"{prefix}([0-9]{{1,20}})_([0-9]{{1,10}})_[0-9a-f]{{32}}")  # ASCII only

    def new(self) -> str:
        """A fresh, unguessable name made by this process."""
        return f"{self.prefix}{pid_namespace()}_{os.getpid()}_{secrets.token_hex(16)}"

    def parse(self, name: str) -> tuple[int, int]:
        """Return ``(pid_namespace, pid)`` of a well-formed name, else raise ``DescriptorError``."""
        match = self._re.fullmatch(name) if len(name) <= self.max_len else None
        if match is None:
            raise DescriptorError(
                f"{self._kind} name {name[: self.max_len]!r} is not a {self._noun} of this project "
                f"(expected {self.prefix}<pidns>_<pid>_<32 hex digits>)"
            )
        return int(match.group(1)), int(match.group(2))


def find_stale(directory: str | int, names: SegmentNames) -> list[str]:
    """Names in ``directory`` (a path or an open directory fd) whose producer is gone.

    Only entries that match ``names``, were made in this pid namespace and are
    regular files of the current user count. Anything uncertain counts as alive: a
    collector may miss stale memory, never delete live memory. Deletes nothing.
    """
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    stale = []
    for name in entries:
        if not name.startswith(names.prefix):
            continue
        try:
            pidns, pid = names.parse(name)
        except DescriptorError:
            continue  # our prefix but not our pattern: not ours to judge
        if pidns != pid_namespace():
            continue
        try:
            if isinstance(directory, int):
                st = os.lstat(name, dir_fd=directory)
            else:
                st = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            continue  # removed meanwhile
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if not producer_alive(pid, segment_ctime=st.st_ctime):
            stale.append(name)
    return stale


def producer_alive(pid: int, segment_ctime: float) -> bool:
    """Whether process ``pid`` may still own memory last changed at ``segment_ctime``.

    False only when the pid is gone, a zombie, or names a process that started after
    the memory was last changed (the pid was reused); True when in doubt.
    """
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


def _after_fork_in_child() -> None:
    global _pidns
    _pidns = None  # a child may live in a pid namespace of its own (clone, unshare)


os.register_at_fork(after_in_child=_after_fork_in_child)

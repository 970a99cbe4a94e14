"""Sealed memfds: the default store behind the ``cpu`` backend (``CpuMemfdIPCWrapper``).

The producer creates anonymous memory with ``memfd_create``, reserves its pages and
seals its size (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): from then on no
process, the producer included, can truncate it, so a consumer's mapping can never
turn into a SIGBUS. The memory has no name in any file system, so nothing survives
the last process that holds it: a killed producer leaves nothing behind for ``gc``.

The handle says where to find the memory and what it must be: the producer's pid
namespace and pid, the fd number it keeps open, the inode and device numbers, and
the memfd's name, which carries 128 random bits. A consumer opens
``/proc/<pid>/fd/<fd>`` (the directory without following symlinks) and, before it
maps anything, checks each of these, then the type, owner, size and seals of what
it opened; a reused pid or fd number fails the inode or name check. No torch here.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Mapping

from lmcache_platform import DescriptorError, LMCachePlatformError, WireField, format_bytes
from lmcache_platform.hostmem import Handle, Headroom, memory_headroom, pid_namespace

PREFIX = "lmcache_platform_"
NAME_RE = re.compile(rf"{PREFIX}[0-9a-f]{{32}}")
#: What the producer seals; a consumer requires the first two.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
SWITCH = "switch both sides to named segments (LMCACHE_PLATFORM_CPU_IPC=shm)"
_U64 = (1 << 64) - 1
Refuse = Callable[[str, str], DescriptorError]

_lock = threading.Lock()
_owned: dict[int, int] = {}  # fd -> inode of the memfds this process created and still exports


class MemfdCapacityError(LMCachePlatformError, OSError):
    """The memory limit that a memfd counts against lacks the room; nothing was created.

    An ``OSError`` with ``errno.ENOMEM``; ``needed`` and ``free`` are in bytes, ``limit``
    names the binding limit (a memory cgroup's file, or the host's memory).
    """

    def __init__(self, needed: int, headroom: Headroom) -> None:
        if needed > headroom.free:
            what = (
                f"a memfd of {format_bytes(needed)} does not fit: {headroom.limit} leaves "
                f"{format_bytes(headroom.free)} (short by {format_bytes(needed - headroom.free)})"
            )
        else:  # the kernel refused although the limit said it fits: a race, or a limit we cannot see
            what = (
                f"the kernel refused to reserve {format_bytes(needed)} for a memfd although {headroom.limit} "
                f"leaves {format_bytes(headroom.free)} (another process took the memory meanwhile)"
            )
        super().__init__(
            errno.ENOMEM,
            f"{what}; nothing was created. memfd memory counts against the memory cgroup, not "
            "/dev/shm: raise the container's memory limit or give the engine a smaller KV cache.",
        )
        self.needed, self.free, self.limit = needed, headroom.free, headroom.limit


class MemfdStore:
    """Sealed memfds as a :class:`lmcache_platform.hostmem.HostMemoryStore`.

    Also an ``InPlaceStore`` (``create_in_place``, ``reserve``) and a ``SideBySideStore``
    (``open_fd``): memfds are on the system's pages, so the kit can do both.
    """

    handle_fields: Mapping[str, WireField] = {
        "memfd_pidns": WireField(int, lo=0, hi=_U64),
        "memfd_pid": WireField(int, lo=0, hi=1 << 22),  # PID_MAX_LIMIT
        "memfd_fd": WireField(int, lo=0, hi=(1 << 31) - 1),
        "memfd_dev": WireField(int, lo=0, hi=_U64),
        "memfd_ino": WireField(int, lo=0, hi=_U64),
        "memfd_name": WireField(str, max_len=len(PREFIX) + 32),
    }

    def check_handle(self, handle: Handle) -> None:
        name = handle["memfd_name"]
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise DescriptorError(
                f"memfd name {name!r} is not one of this project's (expected {PREFIX}<32 hex digits>)"
            )
        if handle["memfd_pid"] == 0:
            raise DescriptorError("memfd_pid 0 names no process")

    def check_capacity(self, nbytes: int) -> None:
        headroom = memory_headroom()
        if headroom is not None and nbytes > headroom.free:
            raise MemfdCapacityError(nbytes, headroom)

    def create(self, nbytes: int) -> tuple[Handle, mmap.mmap]:
        handle, fd = self._new(nbytes, reserve=True)
        try:
            return handle, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.release(handle)
            raise

    def create_in_place(self, nbytes: int) -> tuple[Handle, int]:
        """A memfd of ``nbytes`` with no pages reserved, and a duplicate of its fd (the caller's)."""
        handle, fd = self._new(nbytes, reserve=False)
        try:
            return handle, os.dup(fd)
        except BaseException:
            self.release(handle)
            raise

    def reserve(self, fd: int, offset: int, nbytes: int) -> None:
        """Reserve pages ``[offset, offset + nbytes)`` of a memfd made by :meth:`create_in_place`.

        The limit is checked first: in a full memory cgroup the kernel answers a
        reservation with the OOM killer rather than an error.
        """
        self.check_capacity(nbytes)
        try:
            os.posix_fallocate(fd, offset, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise MemfdCapacityError(nbytes, memory_headroom() or Headroom(0, "the kernel")) from exc
            raise

    def _new(self, nbytes: int, *, reserve: bool) -> tuple[Handle, int]:
        """A sealed memfd of ``nbytes`` owned by this process, its pages reserved or not."""
        if nbytes <= 0:
            raise ValueError(f"a memfd needs a positive size, got {nbytes}")
        name = PREFIX + secrets.token_hex(16)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)  # a memfd starts as 0777; the same user is all we trust
            os.ftruncate(fd, nbytes)
            if reserve:  # pages now, so that a full cgroup fails here rather than as a SIGBUS later
                self.reserve(fd, 0, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        with _lock:
            _owned[fd] = st.st_ino
        handle: dict[str, int | str] = {
            "memfd_pidns": pid_namespace(),
            "memfd_pid": os.getpid(),
            "memfd_fd": fd,
            "memfd_dev": st.st_dev,
            "memfd_ino": st.st_ino,
            "memfd_name": name,
        }
        return handle, fd

    def open_existing(self, handle: Handle, nbytes: int) -> mmap.mmap:
        own = self.open_fd(handle, nbytes)
        try:
            return mmap.mmap(own, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(own)

    def open_fd(self, handle: Handle, nbytes: int) -> int:
        """A new descriptor of the producer's memfd, once it is shown to be what the handle says."""
        pid, fd, name = handle["memfd_pid"], handle["memfd_fd"], handle["memfd_name"]
        where = f"memfd export {name!r} (fd {fd} of pid {pid})"

        def refuse(check: str, why: str) -> DescriptorError:
            return DescriptorError(f"{where} fails the {check} check: {why}; nothing was mapped")

        if handle["memfd_pidns"] != pid_namespace():
            raise refuse(
                "pid namespace",
                f"it was made in pid namespace {handle['memfd_pidns']}, this "
                f"process is in {pid_namespace()}, where that pid means nothing; {SWITCH}",
            )
        own = _open_fd(pid, fd, name, refuse)
        try:  # again, on what was opened: the producer may have swapped the fd in between
            _check_target(os.readlink(f"/proc/self/fd/{own}"), f"fd {fd} of pid {pid}", name, refuse)
            st = os.fstat(own)
            if not stat.S_ISREG(st.st_mode):
                raise refuse("file type", "not a regular file")
            if st.st_uid != os.geteuid():
                raise refuse("owner", f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
            said = (handle["memfd_dev"], handle["memfd_ino"])
            if (st.st_dev, st.st_ino) != said:
                raise refuse(
                    "inode",
                    f"it is inode {st.st_ino} on device {st.st_dev}, the descriptor says "
                    f"{said[1]} on {said[0]} (a reused fd or pid)",
                )
            if st.st_size != nbytes:
                raise refuse("size", f"it holds {st.st_size} bytes but the descriptor says {nbytes}")
            seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise refuse(
                    "seals",
                    f"its seals are {seals:#x}, not F_SEAL_SHRINK | F_SEAL_GROW: "
                    "its producer could truncate it under our mapping",
                )
        except BaseException:
            os.close(own)
            raise
        return own

    def release(self, handle: Handle) -> bool:
        fd, ino = handle["memfd_fd"], handle["memfd_ino"]
        with _lock:
            if handle["memfd_pid"] != os.getpid() or _owned.get(fd) != ino:
                return False  # not ours: another process's, or a parent's before fork
            del _owned[fd]
        os.close(fd)  # existing mappings, here and in every consumer, keep the memory
        return True


def _check_target(target: str, what: str, name: str, refuse: Refuse) -> None:
    """Refuse unless ``target`` (a ``/proc/.../fd/N`` link) is the memfd named ``name``."""
    if not target.startswith("/memfd:"):
        raise refuse("memfd", f"{what} is {target!r}, not a memfd")
    if target.removeprefix("/memfd:").removesuffix(" (deleted)") != name:
        raise refuse("name", f"{what} is another memfd ({target!r})")


def _open_fd(pid: int, fd: int, name: str, refuse: Refuse) -> int:
    """Open fd ``fd`` of process ``pid`` read-write through /proc, if it is the memfd ``name``.

    The directory is opened without following a symlink. The link is read before the
    open, so that nothing but a memfd of that name is ever opened (a device's open can
    have side effects); ``O_NOCTTY`` and ``O_NONBLOCK`` cover the race with a producer
    that swaps the fd meanwhile, which the caller's second look then refuses.
    """
    try:
        d = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise refuse("producer", f"no process {pid} exists in this pid namespace (it exited)") from None
    except PermissionError:
        raise refuse(
            "access",
            f"/proc/{pid}/fd is not readable here (/proc mounted with hidepid, another "
            f"user, or a producer that is not dumpable); {SWITCH}",
        ) from None
    try:
        _check_target(os.readlink(str(fd), dir_fd=d), f"fd {fd} of pid {pid}", name, refuse)
        return os.open(str(fd), os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK, dir_fd=d)
    except FileNotFoundError:
        raise refuse("fd", f"pid {pid} has no fd {fd} (it closed the export)") from None
    except PermissionError:
        raise refuse(
            "access",
            f"/proc/{pid}/fd/{fd} cannot be opened (a producer that is not "
            f"dumpable, or another user's memory); {SWITCH}",
        ) from None
    except OSError as exc:
        raise refuse("fd", f"/proc/{pid}/fd/{fd} cannot be opened read-write: {exc.strerror}") from None
    finally:
        os.close(d)


def owned() -> frozenset[int]:
    """Fds of the memfds this process created and still exports."""
    with _lock:
        return frozenset(_owned)


def _after_fork_in_child() -> None:
    global _lock, _owned
    _lock = threading.Lock()
    _owned = {}  # the inherited fds stay the parent's exports: never closed from here


os.register_at_fork(after_in_child=_after_fork_in_child)

#: The store ``CpuMemfdIPCWrapper`` keeps its memory in.
STORE = MemfdStore()

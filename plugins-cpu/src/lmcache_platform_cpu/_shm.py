"""POSIX shared-memory segments: the store behind ``CpuShmIPCWrapper``.

Naming, exclusive creation, checked opening and ownership; :data:`STORE` presents
them as a :class:`lmcache_platform.hostmem.HostMemoryStore`, and the generic
machinery of :mod:`lmcache_platform.hostmem` does the migrating and reopening.
No torch here. Built on CPython's private ``_posixshmem`` (what
``multiprocessing.shared_memory`` uses underneath) plus :mod:`mmap`, because the
stdlib ``SharedMemory`` class registers every segment it opens with the resource
tracker, which unlinks it when *any* process that opened it exits: a server closing
would delete the engine's KV cache.

Names are ``lmcache_platform_<pidns>_<pid>_<128 random bits in hex>``
(:class:`~lmcache_platform.hostmem.SegmentNames`). The pid (and its pid namespace)
let :mod:`._gc` tell whether the producer is alive; the random part makes names
unguessable, so no other process can pre-create a name (denial of service) or be
pointed at a segment it was not given. Segments are created with
``O_CREAT | O_EXCL`` and mode 0600, so only the same user can open them.

This process unlinks only the names it created (the *owned* registry): at exit, or
when the caller says so. A forked child starts with an empty registry, so it never
unlinks its parent's segments.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython private, no stub
import atexit
import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
from collections.abc import Mapping

from lmcache_platform import DescriptorError, LMCachePlatformError, WireField, format_bytes
from lmcache_platform import hostmem as _hostmem
from lmcache_platform.hostmem import Handle, SegmentNames

#: Every segment of this project starts with this; anything else is refused or ignored.
PREFIX = "lmcache_platform_"
#: Where Linux (glibc) keeps POSIX shared memory.
SHM_DIR = "/dev/shm"

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_owned: set[str] = set()


class ShmCapacityError(LMCachePlatformError, OSError):
    """/dev/shm lacks the room for a segment; nothing was created.

    An ``OSError`` with ``errno.ENOSPC``; ``needed`` and ``free`` are in bytes.
    """

    def __init__(self, needed: int, free: int) -> None:
        if needed > free:
            what = (
                f"{SHM_DIR} has {format_bytes(free)} free but a segment of {format_bytes(needed)} is needed "
                f"(short by {format_bytes(needed - free)})"
            )
        else:  # the kernel refused although statvfs said it fits: a cgroup limit, or a race
            what = (
                f"the kernel refused to reserve {format_bytes(needed)} in {SHM_DIR} although "
                f"{format_bytes(free)} are reported free (a memory-cgroup limit on tmpfs pages, or "
                "another process took the space)"
            )
        super().__init__(
            errno.ENOSPC,
            f"{what}; nothing was created. Enlarge {SHM_DIR} "
            "(Docker: --shm-size, Kubernetes: an emptyDir with medium Memory) or reclaim "
            "segments of dead producers with `lmcache-platform gc --yes`.",
        )
        self.needed = needed
        self.free = free


# -- names ------------------------------------------------------------------------

NAMES = SegmentNames(PREFIX, kind="shared-memory", noun="segment")
#: Length of a well-formed name (prefix, two numbers, 32 hex digits, separators).
MAX_NAME_LEN = NAMES.max_len
#: Inode of this process's pid namespace (0 where it cannot be read); part of every name.
pid_namespace = _hostmem.pid_namespace


def new_name() -> str:
    """A fresh, unguessable segment name for this process."""
    return NAMES.new()


def parse_name(name: str) -> tuple[int, int]:
    """Return ``(pid_namespace, pid)`` of a well-formed name, else raise ``DescriptorError``.

    The pattern admits no ``/``, ``..`` or other separator, so a name can never
    address a file outside the shared-memory directory.
    """
    return NAMES.parse(name)


# -- capacity ---------------------------------------------------------------------


def free_bytes() -> int | None:
    """Bytes an unprivileged user may still allocate in /dev/shm, or None if unknown."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_capacity(nbytes: int) -> None:
    """Raise :class:`ShmCapacityError` if /dev/shm cannot hold ``nbytes`` more bytes."""
    free = free_bytes()
    if free is not None and nbytes > free:
        raise ShmCapacityError(nbytes, free)


# -- create, open, unlink -----------------------------------------------------------


def create(nbytes: int) -> tuple[str, mmap.mmap]:
    """Create, size and map a new segment owned by this process; return its name and map.

    The space is reserved up front (``posix_fallocate``), so a full /dev/shm is an
    ``ShmCapacityError`` here rather than a SIGBUS on first write. On any failure
    the segment is unlinked before the error propagates.
    """
    if nbytes <= 0:
        raise ValueError(f"a segment needs a positive size, got {nbytes}")
    check_capacity(nbytes)
    name = new_name()
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with _lock:
        _owned.add(name)
    try:
        os.fchmod(fd, 0o600)  # the umask may only have removed bits; make the mode exact
        _reserve(fd, nbytes)
        _verify(name, os.fstat(fd), nbytes)
        return name, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def create_in_place(nbytes: int) -> tuple[str, int]:
    """Create and size a new segment with no pages reserved; return its name and an open fd."""
    if nbytes <= 0:
        raise ValueError(f"a segment needs a positive size, got {nbytes}")
    name = new_name()
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with _lock:
        _owned.add(name)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        _verify(name, os.fstat(fd), nbytes)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    return name, fd


def _reserve(fd: int, nbytes: int, offset: int = 0) -> None:
    """Reserve ``[offset, offset + nbytes)`` (the file is at least that long afterwards)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # not on macOS: the size is all we can set
        os.ftruncate(fd, max(os.fstat(fd).st_size, offset + nbytes))
        return
    try:
        fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise ShmCapacityError(nbytes, free_bytes() or 0) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, max(os.fstat(fd).st_size, offset + nbytes))  # a filesystem without fallocate


def open_existing(name: str, nbytes: int) -> mmap.mmap:
    """Map the existing segment ``name`` read-write after checking what it really is.

    Refused with ``DescriptorError`` (before mapping): see :func:`open_fd`.
    """
    fd = open_fd(name, nbytes)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def open_fd(name: str, nbytes: int) -> int:
    """A new read-write descriptor of the existing segment ``name``, after checking what it is.

    Refused with ``DescriptorError``: a malformed name, a missing segment, a symlink,
    anything but a regular file, a segment of another user or one readable by group
    or others, and a size other than ``nbytes``.
    """
    parse_name(name)
    try:
        fd: int = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_NOFOLLOW, 0)
    except FileNotFoundError as exc:
        raise DescriptorError(
            f"shared-memory segment {name!r} does not exist (its producer exited or released it)"
        ) from exc
    except OSError as exc:
        raise DescriptorError(f"cannot open shared-memory segment {name!r}: {exc}") from exc
    try:
        _verify(name, os.fstat(fd), nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _verify(name: str, st: os.stat_result, nbytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise DescriptorError(f"shared-memory segment {name!r} is not a regular file")
    if st.st_uid != os.geteuid():
        raise DescriptorError(
            f"shared-memory segment {name!r} belongs to uid {st.st_uid}, not to this "
            f"user (uid {os.geteuid()})"
        )
    if st.st_mode & 0o077:
        raise DescriptorError(
            f"shared-memory segment {name!r} has mode {stat.S_IMODE(st.st_mode):04o}; "
            "only 0600 segments are trusted"
        )
    if st.st_size != nbytes:
        raise DescriptorError(
            f"shared-memory segment {name!r} holds {st.st_size} bytes but the descriptor says {nbytes}"
        )


def unlink(name: str) -> bool:
    """Unlink ``name`` if this process created it; return whether it did.

    Names created by another process (a parent before ``fork``, say) are never
    touched. Idempotent: a name already gone counts as done.
    """
    with _lock:
        if name not in _owned:
            return False
        _owned.discard(name)
    unlink_any(name)
    return True


def unlink_any(name: str) -> None:
    """Unlink a segment by name, whoever created it; a missing name is fine."""
    parse_name(name)
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def owned() -> frozenset[str]:
    """Names this process created and has not unlinked yet."""
    with _lock:
        return frozenset(_owned)


def _unlink_all_owned() -> None:
    with _lock:
        names = sorted(_owned)
    for name in names:
        try:
            unlink(name)
        except OSError:  # exiting: report, keep going; `gc` can still reclaim it
            _log.warning("could not unlink %s at exit", name, exc_info=True)


def _after_fork_in_child() -> None:
    global _lock, _owned
    _lock = threading.Lock()
    _owned = set()  # the parent's names stay the parent's


class ShmStore:
    """/dev/shm as a :class:`lmcache_platform.hostmem.HostMemoryStore`: the handle is the name.

    Also an ``InPlaceStore`` and a ``SideBySideStore``, like the memfd store.

    Each method looks its module function up when called, so the module stays the
    one place (and the one thing tests patch) for the shared-memory rules.
    """

    handle_fields: Mapping[str, WireField] = {"shm_name": WireField(str, max_len=MAX_NAME_LEN)}

    def check_handle(self, handle: Handle) -> None:
        parse_name(handle["shm_name"])

    def check_capacity(self, nbytes: int) -> None:
        check_capacity(nbytes)

    def create(self, nbytes: int) -> tuple[Handle, mmap.mmap]:
        name, mm = create(nbytes)
        return {"shm_name": name}, mm

    def create_in_place(self, nbytes: int) -> tuple[Handle, int]:
        name, fd = create_in_place(nbytes)
        return {"shm_name": name}, fd

    def reserve(self, fd: int, offset: int, nbytes: int) -> None:
        check_capacity(nbytes)
        _reserve(fd, nbytes, offset)

    def open_existing(self, handle: Handle, nbytes: int) -> mmap.mmap:
        return open_existing(handle["shm_name"], nbytes)

    def open_fd(self, handle: Handle, nbytes: int) -> int:
        return open_fd(handle["shm_name"], nbytes)

    def release(self, handle: Handle) -> bool:
        return unlink(handle["shm_name"])


#: The store ``CpuShmIPCWrapper`` keeps its memory in.
STORE = ShmStore()


atexit.register(_unlink_all_owned)
os.register_at_fork(after_in_child=_after_fork_in_child)

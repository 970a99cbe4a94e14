"""KV files in one operator-chosen directory: a :class:`~lmcache_platform.hostmem.HostMemoryStore`.

It is also a :class:`~lmcache_platform.hostmem.SideBySideStore` (``open_fd``), so a
server maps the separate files of an engine's layers side by side in one range.

The directory (``LMCACHE_PLATFORM_CPU_FILE_DIR``) is where the KV caches live: a large
tmpfs, a hugetlbfs mount or local NVMe, for containers whose /dev/shm is tiny.

Security, all enforced here:

* The directory belongs to this user and has mode 0700; anything else is refused
  (it is created 0700 if missing). It is opened once, without following a symlink,
  and every file operation is relative to that open descriptor (``dir_fd``), so
  swapping the path afterwards cannot redirect anything.
* Files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 under
  unguessable names (:class:`~lmcache_platform.hostmem.SegmentNames`).
* A consumer accepts names only (the pattern admits no ``/`` or ``..``), opens
  with ``O_NOFOLLOW`` and checks type, owner, mode and size before mapping.

A file is exactly as large as the storage it holds, except where the file
system's block is larger than a page (hugetlbfs maps whole huge pages only): there
sizes are rounded up to the block, and the size check compares rounded sizes. The
kit reads the page size from the open file, so side-by-side places start on huge
page boundaries there.
This process unlinks only the files it created: when their last tensor or wrapper
goes, and at exit. No torch here.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from lmcache_platform import DescriptorError, LMCachePlatformError, WireField, format_bytes
from lmcache_platform.hostmem import Handle, SegmentNames

#: The environment variable naming the directory; both processes must agree on it.
ENV_DIR = "LMCACHE_PLATFORM_CPU_FILE_DIR"
NAMES = SegmentNames("lmcache_cpu_file_", kind="cpu.file", noun="KV file")

_log = logging.getLogger(__name__)


class DirectoryError(LMCachePlatformError, OSError):
    """The KV-file directory is unset, missing, or not private to this user."""


class FileCapacityError(LMCachePlatformError, OSError):
    """The KV-file directory lacks the room for a file; nothing was created.

    An ``OSError`` with ``errno.ENOSPC``; ``needed`` and ``free`` are in bytes.
    """

    def __init__(self, path: str, needed: int, free: int) -> None:
        if needed > free:
            what = (
                f"{path} has {format_bytes(free)} free but {format_bytes(needed)} are needed "
                f"(short by {format_bytes(needed - free)})"
            )
        else:  # the file system refused although statvfs said it fits: a quota, or a race
            what = (
                f"{path} refused to reserve {format_bytes(needed)} although {format_bytes(free)} are "
                "reported free (a quota, a memory-cgroup limit on tmpfs pages, or a race)"
            )
        super().__init__(
            errno.ENOSPC,
            f"{what}; nothing was created. Give {ENV_DIR} a larger file system or reclaim files of "
            "dead producers with `lmcache-platform gc --yes`.",
        )
        self.needed = needed
        self.free = free


@dataclass(frozen=True)
class Directory:
    """The checked directory, held open for the process's lifetime."""

    path: str
    fd: int
    #: File sizes are rounded up to this: 1 (exact sizes) unless the file system's
    #: block is larger than a page, as on hugetlbfs, which maps whole huge pages only.
    block: int

    def file_size(self, nbytes: int) -> int:
        return -(-nbytes // self.block) * self.block

    def free_bytes(self) -> int:
        st = os.fstatvfs(self.fd)
        return st.f_bavail * st.f_frsize

    @property
    def read_only(self) -> bool:
        return bool(os.fstatvfs(self.fd).f_flag & os.ST_RDONLY)


_lock = threading.Lock()
_dirs: dict[str, Directory] = {}  # path -> its open directory; one fd per path used
_owned: dict[str, Directory] = {}  # names this process created and has not unlinked


def directory() -> Directory:
    """The directory ``LMCACHE_PLATFORM_CPU_FILE_DIR`` names, checked (and created if missing).

    Raises :class:`DirectoryError` saying what is wrong and how to fix it.
    """
    raw = os.environ.get(ENV_DIR, "")
    if not raw:
        raise DirectoryError(
            f"{ENV_DIR} is not set; point it at a private directory (mode 0700) on a large "
            "tmpfs, a hugetlbfs mount or local NVMe"
        )
    path = os.path.abspath(raw)
    with _lock:
        found = _dirs.get(path)
        if found is None:
            found = _dirs[path] = _open_directory(path)
        return found


def _open_directory(path: str) -> Directory:
    where = f"{ENV_DIR}={path}"
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise DirectoryError(f"{where}: cannot create the directory: {exc.strerror}") from exc
    try:
        # O_NOFOLLOW refuses a symlink (Linux says ENOTDIR with O_DIRECTORY, so lstat names it).
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            what = "is a symlink; name the real directory"
        elif exc.errno == errno.ENOTDIR:
            what = "is not a directory"
        else:
            what = f"cannot be opened: {exc.strerror}"
        raise DirectoryError(f"{where} {what}") from exc
    try:
        if created:
            os.fchmod(fd, 0o700)  # the umask may have removed bits; make the mode exact
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise DirectoryError(
                f"{where} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
                "use a directory of your own"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode != 0o700:
            raise DirectoryError(f"{where} has mode {mode:04o}; it must be 0700 (chmod 700 {path})")
        bsize = os.fstatvfs(fd).f_bsize
        return Directory(path, fd, bsize if bsize > mmap.PAGESIZE else 1)
    except BaseException:
        os.close(fd)
        raise


# -- the store ------------------------------------------------------------------------


class FileStore:
    """KV files in :func:`directory`, as ``CpuFileIPCWrapper`` uses them: the handle is the name."""

    handle_fields: Mapping[str, WireField] = {"file_name": WireField(str, max_len=NAMES.max_len)}

    def check_handle(self, handle: Handle) -> None:
        NAMES.parse(handle["file_name"])

    def check_capacity(self, nbytes: int) -> None:
        d = directory()
        free = d.free_bytes()
        if d.file_size(nbytes) > free:
            raise FileCapacityError(d.path, d.file_size(nbytes), free)

    def create(self, nbytes: int) -> tuple[Handle, mmap.mmap]:
        if nbytes <= 0:
            raise ValueError(f"a KV file needs a positive size, got {nbytes}")
        d = directory()
        self.check_capacity(nbytes)
        size = d.file_size(nbytes)
        name = NAMES.new()
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=d.fd)
        with _lock:
            _owned[name] = d
        try:
            os.fchmod(fd, 0o600)  # the umask may only have removed bits; make the mode exact
            _reserve(d, fd, size)
            _verify(d, name, os.fstat(fd), size)
            handle = {"file_name": name}
            return handle, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.release({"file_name": name})
            raise
        finally:
            os.close(fd)

    def open_existing(self, handle: Handle, nbytes: int) -> mmap.mmap:
        fd = self.open_fd(handle, nbytes)
        try:
            size = directory().file_size(nbytes)
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def open_fd(self, handle: Handle, nbytes: int) -> int:
        """The checks of :meth:`open_existing`, then the open file (``SideBySideStore``)."""
        name: str = handle["file_name"]
        NAMES.parse(name)
        d = directory()
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d.fd)
        except FileNotFoundError as exc:
            raise DescriptorError(
                f"KV file {name!r} does not exist in {d.path} (its producer exited or released it, "
                f"or the two processes set {ENV_DIR} differently)"
            ) from exc
        except OSError as exc:
            what = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
            raise DescriptorError(f"KV file {name!r} in {d.path} {what}") from exc
        try:
            _verify(d, name, os.fstat(fd), d.file_size(nbytes))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self, handle: Handle) -> bool:
        name: str = handle["file_name"]
        with _lock:
            d = _owned.pop(name, None)
        if d is None:
            return False  # not ours (another process's, or a parent's before fork)
        _unlink_in(d, name)
        return True


def _reserve(d: Directory, fd: int, size: int) -> None:
    """Allocate the file's blocks now, so a full file system fails here, not as a SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            raise FileCapacityError(d.path, size, d.free_bytes()) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate


def _verify(d: Directory, name: str, st: os.stat_result, size: int) -> None:
    where = f"KV file {name!r} in {d.path}"
    if not stat.S_ISREG(st.st_mode):
        raise DescriptorError(f"{where} is not a regular file")
    if st.st_uid != os.geteuid():
        raise DescriptorError(f"{where} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise DescriptorError(f"{where} has mode {stat.S_IMODE(st.st_mode):04o}; only 0600 files are trusted")
    if st.st_size != size:
        raise DescriptorError(f"{where} holds {st.st_size} bytes but the descriptor implies {size}")


def _unlink_in(d: Directory, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=d.fd)


def unlink_any(d: Directory, name: str) -> None:
    """Remove a well-formed KV file by name, whoever created it; a missing one is fine."""
    NAMES.parse(name)
    _unlink_in(d, name)


def owned() -> frozenset[str]:
    """Names this process created and has not unlinked yet."""
    with _lock:
        return frozenset(_owned)


def _unlink_all_owned() -> None:
    with _lock:
        items = sorted(_owned.items())
        _owned.clear()
    for name, d in items:
        try:
            _unlink_in(d, name)
        except OSError:  # exiting: report, keep going; `gc` can still reclaim it
            _log.warning("could not unlink %s/%s at exit", d.path, name, exc_info=True)


def _after_fork_in_child() -> None:
    global _lock, _owned
    _lock = threading.Lock()
    _owned = {}  # the parent's files stay the parent's


atexit.register(_unlink_all_owned)
os.register_at_fork(after_in_child=_after_fork_in_child)

"""One file per entry in a directory: a remote store that outlives every server process.

``file:///absolute/dir[?max_bytes=64G][&direct=auto|1|0]``. What makes it safe to share and to crash:

* **Atomic entries.** A value is written to a temporary file in the same directory and
  renamed over the entry's name: a reader sees the old entry or the new one, never a
  part. A writer killed mid-write leaves a temporary file, never an entry (temporary
  files older than :data:`STALE_TMP_S` are removed at open). What is inside an entry is
  core's checksummed format: damage the file system lets through (a disk error, a
  power loss before the data reached the disk) is refused by the server's tier, which
  then deletes the entry (:meth:`FileStore.delete_many`).
* **A bound.** ``max_bytes`` (default: half the file system's size) caps the entries'
  bytes; past it the least recently used entries go (a read touches its entry's mtime)
  until 90 % is left. The count is taken from the directory itself, so servers sharing
  it (one host's restarts, or hosts on a shared file system) evict by one measure.
* **Several writers.** Renames are atomic on POSIX file systems, unlinks of a file
  another process still reads leave its open descriptor valid, and a file that vanished
  between a listing and a read is a miss.
* **A private directory.** It must be a real directory owned by this user and writable
  by nobody else (a missing one is created 0700); entries are created 0600. Nothing
  read is unpickled or evaluated: a file is a header (:data:`MAGIC`, an expiry) and
  bytes. A directory this process cannot write into (a read-only file system) is refused
  at open, by a real write: a disk tier that persists nothing must not start.
* **The disk's speed.** A batch's files are read and written by :data:`IO_THREADS`
  threads at once (the system calls release the GIL), each file read into the buffer
  handed back (no intermediate ``bytes``) or written with one ``writev`` of the header
  and the caller's buffers (:meth:`FileStore.put_many_gather`: the tier's entry as its
  header and views of the chunk's tensors, no copy). By default (``direct=auto``) a
  read takes what the page cache holds and reads the rest with ``O_DIRECT``, straight
  into the caller's page-aligned memory (the chunk's tensors start on a page boundary in
  the file for that; memory that cannot take it in place is read through the page
  cache): an entry written a moment ago comes from memory, a cold one at the disk's
  speed without a copy out of the page cache. ``direct=1`` always reads past
  the page cache (without evicting the engine host's other pages), ``direct=0`` always
  through it; where the file system refuses ``O_DIRECT``, reads are buffered (said
  once). Errors are logged once per kind per :data:`LOG_PERIOD_S`, not per file.

Each file starts with :data:`MAGIC`, the entry's expiry (Unix time in ns, 0: none), so
``ttl`` works without a clock of the store's own, and where the value starts (zeros up
to there); an expired or foreign file is a miss. Files of the first layout
(:data:`MAGIC_V1`: the value right after the expiry) are still read.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Final, TypeVar

from lmcache_platform import parse_bytes
from lmcache_platform.remote import (
    Buffer,
    RemoteConfigError,
    RemoteOptions,
    RemotePartialError,
    RemoteTimeout,
    RemoteUnavailable,
    RemoteURL,
)

from . import _io

logger = logging.getLogger(__name__)

#: The first bytes of every entry file, then its expiry and where its value starts
#: (``<8s Q I``), then zeros up to there (see :func:`_lead`).
MAGIC: Final = b"LMCFS\x00\x02\x00"
_HEADER = struct.Struct("<8sQI")
_LONE_START = 24  # a lone value's start: after the header, 8-aligned
#: Files of the first layout (``<8s Q``, the value right after) are still read.
MAGIC_V1: Final = b"LMCFS\x00\x01\x00"
_HEADER_V1 = struct.Struct("<8sQ")
#: Temporary files of writers that died are removed at open once this old.
STALE_TMP_S: Final = 600.0
#: What eviction leaves, as a share of ``max_bytes``.
LOW_WATER: Final = 0.9
_KEY_RE = re.compile(rb"^[A-Za-z0-9._:\-]{1,400}$")
_ENTRY_PREFIXES = ("e.", "h.")
#: Threads reading or writing one batch's files at once.
IO_THREADS: Final = 8
#: At most one log line per kind of I/O error (an errno, per read or write) in this period.
LOG_PERIOD_S: Final = 60.0
_T = TypeVar("_T")
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_R = TypeVar("_R")


@dataclass(frozen=True)
class FileStoreConfig:
    """The directory and the bound, from a ``file://`` URL (no host: the file system is local)."""

    directory: str
    max_bytes: int | None
    url: str
    #: How entries are read: ``auto`` (the page cache where it holds the entry, else ``O_DIRECT``),
    #: ``1`` (always ``O_DIRECT``: past the page cache), ``0`` (always buffered). Where the file
    #: system refuses ``O_DIRECT``, buffered.
    direct: str = "auto"

    @classmethod
    def from_url(cls, url: RemoteURL, options: RemoteOptions | None = None) -> FileStoreConfig:
        if url.hosts:
            meant = (
                "/".join(p for p in (url.hosts[0][0], url.path) if p)
                if len(url.hosts) == 1
                else "absolute/dir"
            )
            raise RemoteConfigError(
                f"remote URL {url.text}: a file store takes no host: file:///{meant} (three slashes; "
                "a shared file system is mounted, not addressed)"
            )
        if not url.path:
            raise RemoteConfigError(f"remote URL {url.text}: name a directory: file:///absolute/dir")
        unknown = sorted(set(url.query) - {"max_bytes", "direct"})
        if unknown or (options is not None and options.settings):
            names = ", ".join(unknown or sorted(options.settings if options else ()))
            raise RemoteConfigError(
                f"remote URL {url.text}: the file store knows direct and max_bytes, not {names}"
            )
        direct = url.query.get("direct", "auto")
        if direct not in ("0", "1", "auto"):
            raise RemoteConfigError(f"remote URL {url.text}: direct is auto, 0 or 1, not {direct!r}")
        max_bytes = None
        if "max_bytes" in url.query:
            try:
                max_bytes = parse_bytes(url.query["max_bytes"])
            except ValueError as exc:
                raise RemoteConfigError(f"remote URL {url.text}: max_bytes: {exc}") from None
            if max_bytes <= 0:
                raise RemoteConfigError(f"remote URL {url.text}: max_bytes must be positive")
        return cls("/" + url.path.lstrip("/"), max_bytes, url.text, direct)


class FileStore:
    """A :class:`~lmcache_platform.remote.RemoteStore` in one directory (see the module docstring)."""

    #: Items of a batch are independent local files: the tier may read them one by one from
    #: several threads and check each entry while the next one is read.
    parallel_items: Final = True

    def __init__(self, config: FileStoreConfig) -> None:
        self.config = config
        self.directory = config.directory
        self._dir_fd = _open_private_dir(config.directory)
        if config.max_bytes is not None:
            self.max_bytes = config.max_bytes
        else:
            vfs = os.fstatvfs(self._dir_fd)
            self.max_bytes = vfs.f_blocks * vfs.f_frsize // 2
        self._lock = threading.Lock()
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None
        #: Whether reads may use ``O_DIRECT``; ``False`` once the file system refused it.
        self._direct = config.direct != "0" and _io.O_DIRECT != 0
        modes = {"0": _io.BUFFERED, "1": _io.DIRECT, "auto": _io.CACHE_FIRST}
        self._mode = modes[config.direct] if self._direct else _io.BUFFERED
        self._last_log: dict[str, float] = {}
        self._log_lock = threading.Lock()  # not _lock: eviction logs under it
        self._probe_writable()
        self._remove_stale_tmp()
        self._used = sum(size for _, size, _ in self._entries())
        self.evicted = 0

    # -- the protocol ----------------------------------------------------------------------

    def get_many(self, keys: Sequence[bytes], *, timeout: float) -> list[Buffer | None]:
        end = self._start(timeout)
        now = time.time_ns()

        def read(name: str, _: None) -> Buffer | None:
            return self._read(name, now)

        return self._read_each(read, keys, [None] * len(keys), end)

    def get_many_into(
        self, keys: Sequence[bytes], into: Sequence[Sequence[Buffer]], *, timeout: float
    ) -> list[int | None]:
        """Read each key's value into its buffers (``into[i]``, filled in order): the length of
        each value, ``None`` where absent. A value whose length is not the buffers' total is
        not read (its length says so): the caller reads it with :meth:`get_many`. One
        ``preadv`` per file, into the caller's memory (the server's chunk memory)."""
        end = self._start(timeout)
        now = time.time_ns()
        views = [[memoryview(b).cast("B") for b in bufs] for bufs in into]
        return self._read_each(lambda name, bufs: self._read_into(name, bufs, now), keys, views, end)

    def _read_each(
        self,
        read: Callable[[str, _T], _R],
        keys: Sequence[bytes],
        extra: Sequence[_T],
        end: float,
    ) -> list[_R | None]:
        """``read(file name, extra[i])`` for each key on the I/O threads; a file that cannot be
        read is ``None`` in a :class:`RemotePartialError` (the others' answers kept), logged."""

        def one(job: tuple[str, _T]) -> _R | OSError:
            try:
                return read(*job)
            except OSError as exc:
                self._warn("read", exc, f"cannot read {job[0]}")
                return exc

        got = self._each(one, [(_name(k), x) for k, x in zip(keys, extra, strict=True)], end, "get")
        out = [None if isinstance(g, OSError) else g for g in got]
        failed = [i for i, g in enumerate(got) if isinstance(g, OSError)]
        if failed:
            raise RemotePartialError(
                f"{self.config.url}: {len(failed)} of {len(keys)} reads failed", results=out, failed=failed
            )
        return out

    def exists_many(self, keys: Sequence[bytes], *, timeout: float) -> list[bool]:
        end = self._start(timeout)
        now = time.time_ns()
        out = []
        for key in keys:
            self._check_time(end, "exists")
            out.append(self._live(_name(key), now))
        return out

    def put_many(
        self, items: Sequence[tuple[bytes, Buffer]], *, ttl: float | None, timeout: float
    ) -> list[bool]:
        return self.put_many_gather([(key, [value]) for key, value in items], ttl=ttl, timeout=timeout)

    def put_many_gather(
        self, items: Sequence[tuple[bytes, Sequence[Buffer]]], *, ttl: float | None, timeout: float
    ) -> list[bool]:
        """:meth:`put_many` with each value given as the buffers it is made of, in order: one
        ``writev`` per file from the caller's memory (the tier's entries without a copy)."""
        end = self._start(timeout)
        expires = time.time_ns() + int(ttl * 1e9) if ttl else 0
        named = [(_name(key), [memoryview(p).cast("B") for p in parts]) for key, parts in items]
        return self._each(lambda item: self._write(item[0], item[1], expires), named, end, "put")

    def delete_many(self, keys: Sequence[bytes], *, timeout: float) -> list[bool]:
        """Remove each entry (a damaged one, refused by the server's tier); ``True`` where removed."""
        end = self._start(timeout)
        out = []
        for key in keys:
            self._check_time(end, "delete")
            out.append(self._unlink(_name(key)))
        return out

    def ping(self, *, timeout: float) -> None:
        self._start(timeout)
        try:
            st = os.stat(self.directory)
        except OSError as exc:
            raise RemoteUnavailable(f"{self.config.url}: the directory is gone: {exc}") from None
        if not os.path.samestat(st, os.fstat(self._dir_fd)):
            raise RemoteUnavailable(f"{self.config.url}: {self.directory} was replaced since it was opened")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        os.close(self._dir_fd)

    def _each(self, fn: Callable[[_T], _R], items: Sequence[_T], end: float, what: str) -> list[_R]:
        """``fn`` of each item, on the I/O threads when there are several, by ``end``."""
        if len(items) <= 1:
            self._check_time(end, what)
            return [fn(item) for item in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="lmcache-file-store")
            pool = self._pool
        futures = [pool.submit(fn, item) for item in items]
        try:
            return [f.result(timeout=max(end - time.monotonic(), 0.0)) for f in futures]
        except FutureTimeout:
            for f in futures:
                f.cancel()
            raise RemoteTimeout(f"{self.config.url}: {what} timed out") from None

    def _warn(self, kind: str, exc: OSError, what: str) -> None:
        """One WARNING per kind of error (``kind`` and errno) per :data:`LOG_PERIOD_S`."""
        tag = f"{kind}:{exc.errno}"
        now = time.monotonic()
        with self._log_lock:
            if now - self._last_log.get(tag, -LOG_PERIOD_S) < LOG_PERIOD_S:
                return
            self._last_log[tag] = now
        logger.warning(
            "file store %s: %s: %s (more such errors in the next %g s are not logged)",
            self.directory, what, exc.strerror or exc, LOG_PERIOD_S,
        )  # fmt: skip

    def _probe_writable(self) -> None:
        """Write, and remove, a small file: a directory nothing can be written to is refused."""
        tmp = f".tmp.{os.getpid()}.probe.{secrets.token_hex(4)}"
        try:
            self._write_file(tmp, [_lead(0, [memoryview(b"")])])
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # writable, only full: the tier copes
                self._unlink(tmp)
                return
            os.close(self._dir_fd)
            raise RemoteConfigError(
                f"file store directory {self.directory} is not writable ({exc.strerror or exc}): "
                "give a directory on a read-write file system this user can write"
            ) from None
        self._unlink(tmp)

    # -- entries ---------------------------------------------------------------------------

    def _read(self, name: str, now: int) -> Buffer | None:
        fd = self._open(name)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            view = memoryview(bytearray(size + _io.BLOCK))  # the allocator's memory: calloc, no fill pass
            skip = -_io.address(view) % _io.BLOCK  # page-aligned, as O_DIRECT reads straight into it
            view = view[skip : skip + size]
            got = self._fill(fd, [view], 0, size)
        finally:
            os.close(fd)
        start = self._value_start(name, view[:got], now)
        return None if start is None else view[start:got]  # no copy: the buffer is this call's own

    def _read_into(self, name: str, bufs: list[memoryview], now: int) -> int | None:
        fd = self._open(name)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            want = sum(len(b) for b in bufs)
            start = _start([b for b in bufs if len(b)])  # where this store wrote such a value
            head = memoryview(bytearray(start))
            placed = False
            if size - start == want:  # likely the layout asked for: header, padding, value at once
                got = self._fill(fd, [head, *bufs], 0, size)
                parsed = _header(head[: min(got, start)])
                placed = parsed is not None and parsed[1] == start
            if placed:
                size = got
            else:  # another layout (an older file): its header first, then the value
                head = memoryview(bytearray(min(size, _io.BLOCK)))
                got = self._fill(fd, [head], 0, size)
                parsed = _header(head[:got])
                if parsed is not None and size - parsed[1] == want:
                    got = parsed[1] + self._fill(fd, bufs, parsed[1], size)
                    size = got
        finally:
            os.close(fd)
        value_start = self._value_start(name, head[: min(got, len(head))], now)
        return None if value_start is None else max(size - value_start, 0)

    def _open(self, name: str) -> int | None:
        try:
            return os.open(name, _READ_FLAGS, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None

    def _fill(self, fd: int, pieces: list[memoryview], offset: int, size: int) -> int:
        """:func:`~._io.read_into` in this store's mode; buffered from now on where the file
        system refuses the mode (said once)."""
        try:
            return _io.read_into(fd, pieces, offset, size, self._mode)
        except _io.Unsupported as exc:
            self._no_direct(exc)
            return _io.read_into(fd, pieces, offset, size, _io.BUFFERED)

    def _value_start(self, name: str, head: Buffer, now: int) -> int | None:
        """Where the value starts in a file that begins with ``head``; ``None`` for a miss: a
        file that is not ours (said), an expired entry (removed). Touches a live entry."""
        parsed = _header(head)
        if parsed is None:
            logger.warning("file store %s: %s is not an entry of this store; ignored", self.directory, name)
            return None
        expires, start = parsed
        if expires and expires <= now:
            self._unlink(name)
            return None
        self._touch(name)
        return start

    def _touch(self, name: str) -> None:
        try:
            os.utime(name, dir_fd=self._dir_fd)  # least recently used goes first
        except FileNotFoundError:  # evicted by another server meanwhile: what was read is whole
            pass
        except OSError as exc:  # a read-only file system: the entry is still good to read
            self._warn("touch", exc, f"cannot mark {name} as recently used")

    def _no_direct(self, exc: OSError) -> None:
        """The file system refuses ``O_DIRECT`` (or ``RWF_NOWAIT``): buffered reads from now on, said once."""
        if self._direct:
            self._direct = False
            self._mode = _io.BUFFERED
            logger.info(
                "file store %s: the file system does not take %s; reading through the page cache",
                self.directory, exc.strerror or exc,
            )  # fmt: skip

    def _live(self, name: str, now: int) -> bool:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return False
        try:
            head = _header(os.pread(fd, _HEADER.size, 0))
        finally:
            os.close(fd)
        if head is None:
            return False
        if head[0] and head[0] <= now:
            self._unlink(name)
            return False
        return True

    def _write(self, name: str, parts: list[memoryview], expires: int) -> bool:
        tmp = f".tmp.{os.getpid()}.{secrets.token_hex(8)}"
        lead = _lead(expires, [p for p in parts if len(p)] or [memoryview(b"")])
        for attempt in (0, 1):
            try:
                self._write_file(tmp, [lead, *parts])
                break
            except OSError as exc:
                self._unlink(tmp)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and attempt == 0:
                    self._evict(self._used)  # the file system is fuller than the bound: make room
                    continue
                self._warn("write", exc, f"cannot write {name}")
                return False
        size = len(lead) + sum(len(p) for p in parts)
        try:
            old = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False).st_size
        except FileNotFoundError:
            old = 0
        try:
            os.replace(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError as exc:
            self._unlink(tmp)
            self._warn("write", exc, f"cannot write {name}")
            return False
        with self._lock:
            self._used += size - old
            over = self._used > self.max_bytes
        if over:
            self._evict(int(self.max_bytes * LOW_WATER))
        return True

    def _write_file(self, tmp: str, parts: list[memoryview]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self._dir_fd)
        try:
            left = [p for p in parts if len(p)]
            while left:  # one writev, from the caller's buffers; again for what a short write left
                done = os.writev(fd, left[:_IOV_MAX])
                while left and done >= len(left[0]):
                    done -= len(left[0])
                    left.pop(0)
                if left and done:
                    left[0] = left[0][done:]
        finally:
            os.close(fd)

    def _unlink(self, name: str) -> bool:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:  # a read-only file system: the entry stays, the caller goes on
            self._warn("unlink", exc, f"cannot remove {name}")
            return False

    def _entries(self) -> list[tuple[int, int, str]]:
        """``(mtime_ns, size, name)`` of every entry file, read from the directory now."""
        out = []
        with os.scandir(self._dir_fd) as it:
            for e in it:
                if not e.name.startswith(_ENTRY_PREFIXES):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append((st.st_mtime_ns, st.st_size, e.name))
        return out

    def _evict(self, target: int) -> None:
        """Remove least recently used entries until at most ``target`` bytes are left."""
        with self._lock:
            entries = sorted(self._entries())
            used = sum(size for _, size, _ in entries)
            gone = 0
            for _, size, name in entries:
                if used <= target:
                    break
                if self._unlink(name):
                    gone += 1
                used -= size
            self._used = used
            self.evicted += gone
        if gone:
            logger.info(
                "file store %s: evicted %d least recently used entries (%d bytes left, bound %d)",
                self.directory, gone, used, self.max_bytes,
            )  # fmt: skip

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        with os.scandir(self._dir_fd) as it:
            for e in it:
                if e.name.startswith(".tmp."):
                    try:
                        if now - e.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                            os.unlink(e.name, dir_fd=self._dir_fd)
                    except FileNotFoundError:
                        continue

    # -- calls -------------------------------------------------------------------------------

    def _start(self, timeout: float) -> float:
        if self._closed:
            raise RemoteUnavailable(f"{self.config.url}: the store is closed")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        return time.monotonic() + timeout

    def _check_time(self, end: float, what: str) -> None:
        if time.monotonic() > end:
            raise RemoteTimeout(f"{self.config.url}: {what} timed out")


def _name(key: bytes) -> str:
    """The entry's file name: the key itself where it fits a name, else its SHA-256."""
    if not _KEY_RE.match(key):
        raise RemoteConfigError(f"remote key {key[:60]!r}: expected 1-400 of A-Z a-z 0-9 . _ : -")
    if len(key) <= 200:
        return "e." + key.decode("ascii")
    return "h." + hashlib.sha256(key).hexdigest()


def _header(data: Buffer) -> tuple[int, int] | None:
    """The expiry (0: none) and where the value starts, from an entry's first bytes; ``None``
    when they are not ours. Files of :data:`MAGIC_V1` are still read (their value at 16)."""
    if len(data) >= _HEADER_V1.size and bytes(memoryview(data)[:8]) == MAGIC_V1:
        return int(_HEADER_V1.unpack_from(data)[1]), _HEADER_V1.size
    if len(data) < _HEADER.size:
        return None
    magic, expires, start = _HEADER.unpack_from(data)
    return (int(expires), int(start)) if magic == MAGIC and start >= _HEADER.size else None


def _lead(expires: int, parts: Sequence[memoryview]) -> memoryview:
    """A file's header and padding before ``parts``: the second part (a chunk's first tensor,
    after the entry's header) starts on a :data:`~._io.BLOCK` boundary, so that a read straight
    from the disk lands in the chunk's page-aligned memory (a lone part needs no padding: it is
    read with the whole file into fresh page-aligned memory)."""
    start = _start(parts)
    lead = bytearray(start)
    _HEADER.pack_into(lead, 0, MAGIC, expires, start)
    return memoryview(lead)


def _start(parts: Sequence[memoryview]) -> int:
    """Where :func:`_lead` puts a value of these (non-empty) parts."""
    if len(parts) > 1:
        return _HEADER.size + (-(_HEADER.size + len(parts[0])) % _io.BLOCK)
    return _LONE_START


def _open_private_dir(path: str) -> int:
    """An fd on ``path``, created 0700 if missing; refuses anything others could write into.

    Only the last level is created (as ``serve`` does its socket's directory): a missing
    parent, a symlink or something that is not a directory stops the store with the fix.
    """
    if not os.path.isabs(path):
        raise RemoteConfigError(f"file store directory {path!r}: give an absolute path (file:///abs/dir)")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        parent = os.path.dirname(path)
        raise RemoteConfigError(
            f"file store directory {path}: its parent {parent} does not exist; create it first: "
            f"mkdir -m 700 -p {path}"
        ) from None
    except OSError as exc:
        raise RemoteConfigError(f"file store directory {path}: {exc.strerror or exc}") from None
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(path)
            raise RemoteConfigError(
                f"file store directory {path} is a symlink (to {target}); symlinks are refused, so that "
                f"entries land where the URL says: name the directory itself, file://{target}"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise RemoteConfigError(
                f"file store directory {path} exists and is not a directory; name a directory "
                "(a missing one is created 0700)"
            )
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise RemoteConfigError(f"file store directory {path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    problem = None
    if st.st_uid != os.geteuid():
        problem = f"owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"writable by others (mode {stat.S_IMODE(st.st_mode):o}): chmod go-w {path}"
    if problem:
        os.close(fd)
        raise RemoteConfigError(f"file store directory {path} is {problem}; another user could plant entries")
    return fd

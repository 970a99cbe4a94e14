"""The server's listening socket: a private directory, one live server per path.

The socket is created with mode 0600 (no window with looser rights) inside a
directory that must be owned by this user with mode 0700. A lock file next to the
socket (``<socket>.lock``, held with ``flock`` for the server's lifetime) makes "is a
server serving this path?" a question the kernel answers, so two servers started at
once cannot both take the path. A socket file left by a server that died is
replaced; one a live server answers on is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
import struct
import threading
import time

from .._errors import ServerError

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0


def check_private_dir(path: str) -> None:
    """``path`` must be a directory owned by this user that nobody else may enter."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"socket directory {path} must be owned by this user with mode 0700")


class Listener:
    """A bound, listening UNIX socket and the lock that says it is ours."""

    def __init__(self, socket_path: str, *, backlog: int = 16) -> None:
        self.path = socket_path
        self.lock_path = socket_path + ".lock"
        self._fds_logged = -1e9  # when running out of fds was last logged
        check_private_dir(os.path.dirname(socket_path) or ".")
        self._lock_fd = _take_lock(self.lock_path, socket_path)
        try:
            _clear_stale(socket_path)
            self.sock = _bind(socket_path)
            self.sock.listen(backlog)
        except BaseException:
            self._release_lock()
            raise

    def accept(self, wait: threading.Event) -> socket.socket | None:
        """The next client, or None: the poll timed out, or no fd was left to accept it with.

        Out of fds, the server says so naming the limit (at most every 10 s) and waits a
        moment on ``wait`` (its stop event); the client stays in the backlog meanwhile.
        """
        try:
            client, _ = self.sock.accept()
        except TimeoutError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self._out_of_fds(exc)
            wait.wait(0.05)
            return None
        return client

    def _out_of_fds(self, exc: OSError) -> None:
        from ..protocol._frames import RAISE_FD_LIMIT, fd_usage
        from ._log import log_event

        now = time.monotonic()
        if now - self._fds_logged < 10.0:
            return
        self._fds_logged = now
        open_now, soft = fd_usage()
        log_event(
            logging.WARNING,
            "out_of_fds",
            f"cannot accept a connection ({exc.strerror}): {open_now} files open of the limit of "
            f"{soft} (RLIMIT_NOFILE); {RAISE_FD_LIMIT}",
            open=open_now,
            limit=soft,
        )

    def close(self) -> None:
        """Stop listening and remove the socket and the lock file. Idempotent."""
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):  # unlink while holding it: see _take_lock
            os.unlink(self.lock_path)
        os.close(self._lock_fd)
        self._lock_fd = -1


def _take_lock(lock_path: str, socket_path: str) -> int:
    """Hold ``lock_path`` exclusively, or raise :class:`ServerError` if a server holds it."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ServerError(f"another server is serving {socket_path} (it holds {lock_path})") from None
        except BaseException:
            os.close(fd)
            raise
        # A server that stopped between our open() and flock() unlinked the file we
        # locked; the lock only counts on the file the path names now.
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _clear_stale(socket_path: str) -> None:
    """Remove a socket file nobody answers on; refuse anything else at the path."""
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServerError(f"{socket_path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: a dead server's socket
        except OSError as exc:
            raise ServerError(f"cannot tell whether a server listens on {socket_path}: {exc}") from exc
        else:
            raise ServerError(f"a server is already listening on {socket_path}")
    os.unlink(socket_path)
    logger.warning(
        "replaced the stale socket %s left by a server that is gone",
        socket_path,
        extra={"event": "stale_socket", "fields": {"socket": socket_path}},
    )


def _bind(socket_path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(socket_path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(socket_path, 0o600)
    return sock


_PEERCRED = struct.Struct("3i")


def peer_of(sock: socket.socket) -> tuple[str, int]:
    """``("pid N uid M", M)`` of the process at the other end (Linux); uid -1 when unknown."""
    try:
        pid, uid, _gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except (AttributeError, OSError):  # not Linux, or the peer is already gone
        return "unknown peer", -1
    return f"pid {pid} uid {uid}", uid

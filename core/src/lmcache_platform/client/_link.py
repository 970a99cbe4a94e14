"""One connection of an :class:`~lmcache_platform.server.AsyncClient`, and its small helpers.

A client keeps two (data and control), each with its own buffers and unanswered
requests; ``on_connect`` gets a blocking client over the data connection for that call
only.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._errors import ServerError
from ._client import ServerClient
from ._pending import Pending


@dataclass
class Link:
    """One connection to the server, with its output buffer and unanswered requests."""

    kind: str  # "data" or "control"
    sock: socket.socket
    out: bytearray = field(default_factory=bytearray)
    inbuf: bytearray = field(default_factory=bytearray)
    queued: int = 0  # bytes ever queued on it
    sent: int = 0  # bytes ever sent
    pending: dict[int, Pending[Any]] = field(default_factory=dict)
    zombie: bool = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class SessionClient(ServerClient):
    """The blocking client ``on_connect`` gets: the data connection, deadline-bounded, that call only."""

    def __init__(self, sock: socket.socket, deadline_ms: float, ids: Iterator[int]) -> None:
        self._setup(sock, deadline_ms)
        self._ids = ids
        self._usable = True

    def _check_usable(self) -> None:
        if not self._usable:
            raise ServerError("the client given to on_connect is valid only while on_connect runs")
        self._next_id = next(self._ids)  # ids unique across both links: replies are matched by them

    def close(self) -> None:  # the AsyncClient owns the socket
        self._usable = False


def socket_identity(path: str) -> tuple[int, int] | None:
    """``(inode, creation time)`` of the socket at ``path``; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def why(exc: BaseException) -> str:
    """What went wrong with a connect or a link, in words for the log line."""
    if isinstance(exc, TimeoutError):  # socket.timeout too
        return "no answer in time (a hung server, or a full listen backlog)"
    if isinstance(exc, ServerError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} (errno {exc.errno})"
    return f"{type(exc).__name__}: {exc}"

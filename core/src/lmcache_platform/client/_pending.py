"""What a caller of :class:`~lmcache_platform.client.AsyncClient` holds: futures of typed
results (:class:`Pending`) and fresh lease ids.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from ..protocol._ops import Json

R = TypeVar("R")


def new_lease_id() -> int:
    """A fresh lease id for a leased ``lookup``: 63 random bits, never 0."""
    return secrets.randbits(63) or 1


class Pending(Future[R], Generic[R]):
    """A submitted request: a :class:`concurrent.futures.Future` of its typed result.

    ``result()`` raises :class:`~lmcache_platform.ServerError` (``remote_type`` names the
    server's error, ``"DeadlineExceeded"`` for a request it dropped as late) or
    :class:`~lmcache_platform.server.ServerUnavailable` (no answer in time, not sent,
    or the client closed). It cannot be cancelled. :attr:`resolved` is set once the
    server can no longer act on the request (see the module docstring); it may be set
    after the future is done, never before the request's outcome is known to the server.
    """

    def __init__(self, op: str, request_id: int, deadline_ns: int, *, control: bool) -> None:
        super().__init__()
        self.op = op
        self.request_id = request_id
        #: ``time.monotonic_ns()`` past which the server drops it and the future fails.
        self.deadline_ns = deadline_ns
        #: Sent on the control connection.
        self.control = control
        #: Set when the server answered, the connection died, or it was never sent.
        self.resolved = threading.Event()
        #: ``time.monotonic()`` when its outcome was set (None while pending): a transfer's
        #: time without the caller's polling delay.
        self.finished_at: float | None = None
        self._frame_end = 0  # where its frame ends in its link's byte stream
        #: Turns the reply's result map into the typed result (set when it is sent).
        self._decode: Callable[[Json], R] | None = None
        self.set_running_or_notify_cancel()  # only the client settles it

    @property
    def future(self) -> Future[R]:
        """The future itself (a :class:`Pending` is one)."""
        return self

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return (
            f"<Pending {self.op} #{self.request_id} {state}{' resolved' if self.resolved.is_set() else ''}>"
        )


def settle(pending: Pending[Any], outcome: Any) -> None:
    """Set the future's result or exception once; later outcomes are dropped."""
    if pending.done():
        return
    pending.finished_at = time.monotonic()
    if isinstance(outcome, BaseException):
        pending.set_exception(outcome)
    else:
        pending.set_result(outcome)

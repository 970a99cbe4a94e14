"""Calls with a hard deadline: client work runs on a bounded pool, the caller waits no longer.

The valkey client's timeouts bound each socket operation, not a whole call (a connect, a
topology refresh, a pipeline of many replies), and a hung server can keep a call inside
the client far longer than the engine waits. So each call runs on a worker thread and
the caller waits for it until its deadline only; a call still running then is abandoned
(it ends at the client's socket timeout and frees its slot). Slots are bounded: when
every one is taken, a new call fails at once instead of queueing behind hung ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from lmcache_platform.remote import RemoteTimeout, RemoteUnavailable

T = TypeVar("T")


class Calls:
    """At most ``limit`` calls in flight on worker threads named after ``name``."""

    def __init__(self, limit: int, name: str) -> None:
        self.name = name
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="lmcache-valkey")
        self._closed = False

    def run(
        self, tasks: Sequence[Callable[[], T]], timeout: float, *, first: bool = False
    ) -> list[T | BaseException]:
        """Run ``tasks`` in parallel; each one's result, or the exception it raised or timed out with.

        ``first``: return once one task has returned (a ping of every node: one answer is
        enough); the tasks still running then count as timed out.
        """
        futures: list[Future[T] | BaseException] = []
        for task in tasks:
            if self._closed:
                futures.append(RemoteUnavailable(f"{self.name}: the store is closed"))
            elif not self._slots.acquire(blocking=False):
                futures.append(
                    RemoteTimeout(f"{self.name}: {self.limit} calls already in flight (a hung server?)")
                )
            else:
                try:
                    futures.append(self._pool.submit(self._slot, task))
                except RuntimeError:  # the pool shut down meanwhile
                    self._slots.release()
                    futures.append(RemoteUnavailable(f"{self.name}: the store is closed"))
        pending = [f for f in futures if isinstance(f, Future)]
        if pending and not first:
            wait(pending, timeout=max(timeout, 0.0))
        deadline = time.monotonic() + max(timeout, 0.0)
        while pending and first:  # until one returns, every one failed, or the deadline
            done, waiting = wait(
                pending, timeout=max(deadline - time.monotonic(), 0.0), return_when=FIRST_COMPLETED
            )
            if not done or any(f.exception() is None for f in done):
                break
            pending = list(waiting)
        out: list[T | BaseException] = []
        for f in futures:
            if not isinstance(f, Future):
                out.append(f)
            elif not f.done():
                out.append(RemoteTimeout(f"{self.name}: no answer within {timeout * 1e3:.0f} ms"))
            elif f.exception() is not None:
                exc = f.exception()
                assert exc is not None
                out.append(exc)
            else:
                out.append(f.result())
        return out

    def _slot(self, task: Callable[[], T]) -> T:
        try:
            return task()
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

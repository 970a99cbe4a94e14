"""Per-node guards of a cluster: a dead or hung node costs its keys, not everyone's time.

A node whose own call failed (refused, or its socket timed out) is *resting*: its items
fail at once instead of each call waiting on it again (the write-behind thread would
otherwise pay the socket timeout per batch), for :data:`REST_S`, doubling with each
failure up to :data:`REST_MAX_S`, until it answers (a ping asks resting nodes too).

A node may hold at most ``share`` of the store's call slots: calls a caller gave up on
keep running until the socket timeout, and a hung node asked often would otherwise take
every slot, so that calls to the healthy nodes, and the pings that tell slow from down,
failed for want of one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from lmcache_platform.remote import RemoteUnavailable

T = TypeVar("T")

#: Seconds a node whose call failed is skipped before it is asked again; doubling to the most.
REST_S = 1.0
REST_MAX_S = 30.0


class NodeGuard:
    """Resting nodes and each node's calls in flight, for one store."""

    def __init__(self, name: str, share: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.share = share
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._resting: dict[str, _Rest] = {}

    def refusal(self, node: str, *, probe: bool = False) -> RemoteUnavailable | None:
        """Why ``node`` is not asked now, or ``None``; a ``probe`` asks a resting node too."""
        with self._lock:
            running = self._running.get(node, 0)
            rest = self._resting.get(node)
        if running >= self.share:
            return self._full(node, running)
        left = rest.until - self._clock() if rest is not None else 0.0
        if not probe and left > 0:
            return RemoteUnavailable(f"{self.name}: node {node} failed; asked again in {left:.1f} s")
        return None

    def call(self, node: str, task: Callable[[], T]) -> Callable[[], T]:
        """``task``, counted among ``node``'s calls in flight while it runs (refused when the
        node has its share already). Its end, however long after its caller gave up, tells
        about the node: an answer ends a rest; a refused connection or a socket timeout
        starts one, or doubles the last, unless the call began before the node's rest did
        (the calls in flight when a node dies all fail: that is one failure, not many)."""

        def counted() -> T:
            with self._lock:
                running = self._running.get(node, 0)
                if running >= self.share:
                    raise self._full(node, running)
                self._running[node] = running + 1
                began = self._clock()
            try:
                out = task()
            except BaseException as exc:
                if _node_failed(exc):
                    self._rest(node, began)
                raise
            else:
                with self._lock:
                    self._resting.pop(node, None)
                return out
            finally:
                with self._lock:
                    self._running[node] -= 1

        return counted

    def _rest(self, node: str, began: float) -> None:
        with self._lock:
            last = self._resting.get(node)
            if last is not None and began < last.since:
                return
            seconds = REST_S if last is None else min(last.seconds * 2, REST_MAX_S)
            now = self._clock()
            self._resting[node] = _Rest(since=now, until=now + seconds, seconds=seconds)

    def _full(self, node: str, running: int) -> RemoteUnavailable:
        return RemoteUnavailable(f"{self.name}: node {node} has {running} calls in flight (hung?)")


class _Rest(NamedTuple):
    since: float
    until: float
    seconds: float


def _node_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says the node failed (refused, reset, timed out), not the call's data."""
    if isinstance(exc, OSError):
        return True
    import valkey.exceptions as vx

    return isinstance(exc, vx.ConnectionError | vx.TimeoutError)

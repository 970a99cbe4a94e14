"""Process-wide table of imported IPC resources, opened once per key and refcounted.

Both CUDA IPC kinds need it. The driver maps an allocation once per process and one
unmap tears it down for every user, and PyTorch's ref counter counts one consumer
per share: so every wrapper in this process that names the same handle must share
one open. Each wrapper holds at most one reference; ``release`` drops it.

A released resource is only *weakly* kept: tensors built on it keep it alive, and
its own finaliser (torch's storage deleter, or the raw mapping's) unmaps when the
last of them dies. Closing a wrapper therefore never pulls memory from under a live
tensor, and a re-import while such a tensor lives reuses the open instead of
mapping (or counting) it twice.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class _Entry(Generic[V]):
    resource: V
    refs: int


class OpenTable(Generic[V]):
    """``key -> resource`` with a strong refcount per holder and a weak tail."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Hashable, _Entry[V]] = {}
        self._alive: weakref.WeakValueDictionary[Hashable, V] = weakref.WeakValueDictionary()

    def acquire(self, key: Hashable, open_resource: Callable[[], V]) -> V:
        """Take one reference to the resource for ``key``, opening it if none is alive."""
        with self._lock:
            entry = self._held.get(key)
            if entry is not None:
                entry.refs += 1
                return entry.resource
            resource = self._alive.get(key)
            if resource is None:
                resource = open_resource()  # serialised: opens are rare and must not race
                self._alive[key] = resource
            self._held[key] = _Entry(resource, 1)
            return resource

    def release(self, key: Hashable) -> None:
        """Drop one reference; the last one leaves the resource to its finaliser."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                raise KeyError(key)
            entry.refs -= 1
            if not entry.refs:
                del self._held[key]

    def refs(self, key: Hashable) -> int:
        """Strong references held for ``key`` (0 when only tensors keep it alive)."""
        with self._lock:
            entry = self._held.get(key)
            return 0 if entry is None else entry.refs

    def alive(self, key: Hashable) -> bool:
        """Whether the resource for ``key`` still exists (held or kept by tensors)."""
        with self._lock:
            return key in self._held or self._alive.get(key) is not None

"""Leases: chunks a ``lookup`` found, pinned against eviction until the engine loads them.

A scheduler looks chunks up long before a worker loads them; in between, a busy cache
could evict them. A lookup with ``lease`` (an id the client chose) and ``lease_ms``
pins the chunks it counted, in every namespace it asked about, and the lease lasts
until the first of:

* it expires (``lease_ms`` after the lookup);
* a ``release`` request names it (the scheduler dropped its plan);
* a ``get`` naming it has read a namespace's chunks: that namespace's share goes, and
  the lease with its last share;
* the connection that took it closes (leases belong to their connection).

Expired leases are swept on every request the server handles (:meth:`LeaseTable.sweep`
is cheap when nothing is due) and by one thread that sleeps until the next expiry, so
no pin outlives its lease by more than a scheduling delay. Nothing here copies bytes.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ._index import ChunkIndex, StoredChunk


@dataclass(eq=False)
class _Lease:
    lease: int
    owner: object
    expires_ns: int
    #: namespace -> the chunks pinned there, until that share is released.
    shares: dict[Hashable, list[StoredChunk]] = field(default_factory=dict)


class LeaseTable:
    """Live leases over one :class:`ChunkIndex`; every method is thread-safe."""

    def __init__(self, index: ChunkIndex) -> None:
        self._index = index
        self._cond = threading.Condition()
        self._leases: dict[int, _Lease] = {}
        self._expiry: list[tuple[int, int]] = []  # (expires_ns, lease), stale entries skipped
        self._taken = 0
        self._expired = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- requests ----------------------------------------------------------------------

    def lookup(
        self,
        owner: object,
        namespaces: Sequence[Hashable],
        keys: Sequence[Hashable],
        *,
        lease: int = 0,
        lease_ms: int = 0,
    ) -> int:
        """Leading ``keys`` stored in every namespace; with ``lease``, pin them in each.

        A live lease of the same id is replaced when ``owner`` took it, refused
        (:class:`ValueError`) when another connection did.
        """
        spaces = list(dict.fromkeys(namespaces))  # a namespace twice would pin twice
        if not lease:
            return self._index.lookup_many(spaces, keys)[0]
        with self._cond:
            old = self._leases.get(lease)
            if old is not None and old.owner is not owner:
                raise ValueError(f"lease {lease} is held by another connection; choose a fresh id")
            hits, pinned = self._index.lookup_many(spaces, keys, pin=True)
            if old is not None:
                self._end(old)
            expires = time.monotonic_ns() + lease_ms * 1_000_000
            self._leases[lease] = _Lease(lease, owner, expires, dict(zip(spaces, pinned, strict=True)))
            self._taken += 1
            if len(self._expiry) > 4 * len(self._leases) + 1024:  # mostly ended leases: compact
                self._expiry = [(x.expires_ns, x.lease) for x in self._leases.values()]
                heapq.heapify(self._expiry)
            heapq.heappush(self._expiry, (expires, lease))
            if self._expiry[0][1] == lease:  # the sweeper may sleep past this one: wake it
                self._cond.notify()
            return hits

    def release(self, lease: int) -> bool:
        """End a lease now; ``False`` if it is gone already (expired, read or released)."""
        with self._cond:
            found = self._leases.get(lease)
            if found is not None:
                self._end(found)
            return found is not None

    def release_share(self, lease: int, namespace: Hashable) -> None:
        """A ``get`` in ``namespace`` read what the lease pinned there: unpin that share."""
        with self._cond:
            found = self._leases.get(lease)
            if found is None:
                return
            share = found.shares.pop(namespace, None)
            if share is not None:
                self._index.unpin(share)
            if not found.shares:
                del self._leases[lease]

    def drop_owner(self, owner: object) -> int:
        """End every lease ``owner`` took (its connection closed); return how many."""
        with self._cond:
            doomed = [lease for lease in self._leases.values() if lease.owner is owner]
            for lease in doomed:
                self._end(lease)
            return len(doomed)

    def sweep(self, now_ns: int | None = None) -> int:
        """End the leases that expired by ``now_ns`` (default: now); return how many."""
        with self._cond:
            return self._sweep(time.monotonic_ns() if now_ns is None else now_ns)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "leases": len(self._leases),
                "leases_taken": self._taken,
                "lease_expired": self._expired,
                "lease_pins": sum(len(s) for lease in self._leases.values() for s in lease.shares.values()),
            }

    # -- the sweeper thread ------------------------------------------------------------

    def start(self) -> None:
        """Start the thread that ends leases as they expire (sleeping until the next one)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="lmcache-leases", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and end every lease (the server is stopping)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self._cond:
            for lease in list(self._leases.values()):
                self._end(lease)

    def _run(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic_ns()
                self._sweep(now)
                timeout = (self._expiry[0][0] - now) / 1e9 if self._expiry else None
                self._cond.wait(timeout)

    # -- under the condition's lock ----------------------------------------------------

    def _sweep(self, now: int) -> int:
        ended = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires, lease = heapq.heappop(self._expiry)
            found = self._leases.get(lease)
            if found is not None and found.expires_ns == expires:  # else replaced or gone
                self._end(found)
                self._expired += 1
                ended += 1
        return ended

    def _end(self, lease: _Lease) -> None:
        del self._leases[lease.lease]
        for share in lease.shares.values():
            self._index.unpin(share)
        lease.shares.clear()

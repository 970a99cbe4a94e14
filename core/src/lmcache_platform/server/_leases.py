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

A lease is named by its connection and its id: two engines that drew the same id (the
ids are random, but an engine seeding a shared generator once made every engine draw the
same sequence) hold two leases, and neither is refused. A ``get`` arrives on a worker's
connection, not the scheduler's that took the lease, so it releases its namespace's
share of a lease by id alone, from whichever lease of that id pinned that namespace.

Expired leases are swept on every request the server handles (:meth:`LeaseTable.sweep`
is cheap when nothing is due) and by one thread that sleeps until the next expiry, so
no pin outlives its lease by more than a scheduling delay. Nothing here copies bytes.
"""

from __future__ import annotations

import heapq
import itertools
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

    @property
    def key(self) -> tuple[object, int]:
        return self.owner, self.lease


class LeaseTable:
    """Live leases over one :class:`ChunkIndex`; every method is thread-safe."""

    def __init__(self, index: ChunkIndex) -> None:
        self._index = index
        self._cond = threading.Condition()
        self._leases: dict[tuple[object, int], _Lease] = {}  # by (owner, id)
        self._by_id: dict[int, list[_Lease]] = {}  # for gets, which name the id alone
        #: (expires_ns, sequence, lease): stale entries are skipped.
        self._expiry: list[tuple[int, int, _Lease]] = []
        self._seq = itertools.count()
        self._taken = 0
        self._expired = 0
        self._unread = 0  # pins of leases that expired or lost their connection before a get
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

        A live lease ``owner`` took with the same id is replaced; another connection's
        lease of that id is another lease.
        """
        spaces = list(dict.fromkeys(namespaces))  # a namespace twice would pin twice
        if not lease:
            return self._index.lookup_many(spaces, keys)[0]
        with self._cond:
            old = self._leases.get((owner, lease))
            hits, pinned = self._index.lookup_many(spaces, keys, pin=True)
            if old is not None:
                self._end(old)
            expires = time.monotonic_ns() + lease_ms * 1_000_000
            new = _Lease(lease, owner, expires, dict(zip(spaces, pinned, strict=True)))
            self._leases[new.key] = new
            self._by_id.setdefault(lease, []).append(new)
            self._taken += 1
            if len(self._expiry) > 4 * len(self._leases) + 1024:  # mostly ended leases: compact
                self._expiry = [(x.expires_ns, next(self._seq), x) for x in self._leases.values()]
                heapq.heapify(self._expiry)
            heapq.heappush(self._expiry, (expires, next(self._seq), new))
            if self._expiry[0][2] is new:  # the sweeper may sleep past this one: wake it
                self._cond.notify()
            return hits

    def release(self, owner: object, lease: int) -> bool:
        """End ``owner``'s lease now; ``False`` if it is gone already (expired, read or released)."""
        with self._cond:
            found = self._leases.get((owner, lease))
            if found is not None:
                self._end(found)
            return found is not None

    def release_share(self, lease: int, namespace: Hashable) -> None:
        """A ``get`` in ``namespace`` read what the lease pinned there: unpin that share."""
        with self._cond:
            found = next((x for x in self._by_id.get(lease, ()) if namespace in x.shares), None)
            if found is None:
                return
            self._index.unpin(found.shares.pop(namespace))
            if not found.shares:
                self._end(found)

    def drop_owner(self, owner: object) -> int:
        """End every lease ``owner`` took (its connection closed); return how many."""
        with self._cond:
            doomed = [lease for lease in self._leases.values() if lease.owner is owner]
            for lease in doomed:
                self._end(lease, unread=True)
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
                "lease_unread_chunks": self._unread,
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
            _, _, lease = heapq.heappop(self._expiry)
            if self._leases.get(lease.key) is lease:  # else replaced or gone
                self._end(lease, unread=True)
                self._expired += 1
                ended += 1
        return ended

    def _end(self, lease: _Lease, *, unread: bool = False) -> None:
        if unread:  # hits a lookup promised that no get came for: lost hits, unless recomputed
            self._unread += sum(len(share) for share in lease.shares.values())
        del self._leases[lease.key]
        same = self._by_id[lease.lease]
        same.remove(lease)
        if not same:
            del self._by_id[lease.lease]
        for share in lease.shares.values():
            self._index.unpin(share)
        lease.shares.clear()

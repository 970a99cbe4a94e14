"""The server's chunk index: which chunks it holds, their LRU order, pins and byte budget.

A chunk is addressed by ``(namespace, key)``. Shared chunks (keyed ``put``) live in a
client-chosen namespace (``bytes``), are evictable and outlive the context that stored
them. A context's own chunks (the chunk-id ``store``) live in the namespace of that
context's id (an ``int``, so it can never equal a client's namespace); they are never
evicted and go when the context closes.

Every method takes the index's own lock for a short, copy-free critical section. The
copies themselves happen outside it, which is what lets transfers of different
contexts overlap:

* a store first **reserves** bytes (evicting least recently used chunks if needed)
  and marks its new keys as being written, so no other store copies them again and
  no lookup sees them; after the copy it **commits** them (or **aborts**);
* a retrieve **acquires** the chunks it reads (a pin: a pinned chunk is never
  evicted), copies, then **releases** them;
* a leased lookup **pins** the chunks it found (:meth:`ChunkIndex.lookup_many`), so they
  stay until the lease's owner **unpins** them (a get read them, or the lease ended);
* a get **adopts** the chunks it brought from the remote tier (:meth:`ChunkIndex.adopt`):
  they join the index like stored ones, already pinned for that get's reads.

LRU order: a request touches its keys from last to first, so the first key of a
request ends most recently used. Keys chain a prefix (a later chunk is useless
without the earlier ones), so eviction takes a prefix's tail before its head.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import TransferError

#: ``(namespace, key)``: bytes for shared chunks, ``(context id, chunk id)`` for a context's own.
FullKey = tuple[Hashable, Hashable]


@dataclass(eq=False)
class StoredChunk:
    """One chunk in host memory: one tensor per object group."""

    payload: Sequence[Any]
    nbytes: int
    evictable: bool
    #: Requests reading it right now; a chunk with readers is never evicted.
    readers: int = 0
    #: Leases holding it (see :meth:`ChunkIndex.lookup_many`); a pinned chunk is never evicted.
    pins: int = 0

    @property
    def held(self) -> bool:
        return bool(self.readers or self.pins)


@dataclass
class Reservation:
    """What a store may write, decided under the lock; pass it to commit or abort."""

    namespace: Hashable
    #: Keys to copy, in request order: absent keys (shared) or every key (a context's own).
    keys: list[Hashable]
    chunk_nbytes: int
    shared: bool
    #: Bytes held back for this reservation in the budget.
    reserved: int = 0
    #: Keys already stored or being stored by another request (shared only): no copy.
    present: int = 0
    #: Keys not stored because no room could be made (shared only).
    dropped: int = 0
    evicted: int = 0
    done: bool = False


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    stored: int = 0
    present: int = 0
    dropped: int = 0
    retrieved: int = 0
    #: Chunks gets brought from the remote tier (see :meth:`ChunkIndex.adopt`).
    remote_loaded: int = 0


#: Removals of shared chunks the index remembers for :meth:`ChunkIndex.removed_since`.
REMOVAL_LOG = 1 << 16


class ChunkIndex:
    """Chunks by ``(namespace, key)`` under a byte budget; see the module docstring."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[FullKey, StoredChunk] = OrderedDict()
        self._writing: set[FullKey] = set()  # reserved by a store, not readable yet
        self._per_namespace: Counter[Hashable] = Counter()
        self._committed = 0  # bytes of readable chunks
        self._reserved = 0  # bytes held back for stores in progress
        self._counts = _Counters()
        #: ``(sequence, namespace, key)`` of the last shared chunks evicted, oldest first.
        self._removals: deque[tuple[int, Hashable, Hashable]] = deque(maxlen=REMOVAL_LOG)
        self._removal_seq = 0

    # -- reads ---------------------------------------------------------------------------

    def lookup(self, namespace: Hashable, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` are stored; they become most recently used."""
        return self.lookup_many([namespace], keys)[0]

    def lookup_many(
        self, namespaces: Sequence[Hashable], keys: Sequence[Hashable], *, pin: bool = False
    ) -> tuple[int, list[list[StoredChunk]]]:
        """How many leading ``keys`` every one of ``namespaces`` stores (the minimum).

        Those chunks become most recently used; with ``pin`` they are also pinned, in
        each namespace, until :meth:`unpin` (the second value: the pinned chunks per
        namespace, in order; empty lists without ``pin``). One critical section, so no
        store can evict a chunk between the count and the pin.
        """
        with self._lock:
            found = [self._leading(ns, keys) for ns in namespaces]
            hits = min((len(f) for f in found), default=0)
            pinned: list[list[StoredChunk]] = []
            for f in found:
                self._touch(f[:hits])
                chunks = [self._lru[fk] for fk in f[:hits]] if pin else []
                for c in chunks:
                    c.pins += 1
                pinned.append(chunks)
            self._counts.hits += hits
            self._counts.misses += len(keys) - hits
            return hits, pinned

    def leading_counts(self, namespaces: Sequence[Hashable], keys: Sequence[Hashable]) -> list[int]:
        """How many leading ``keys`` each namespace holds, touching and counting nothing.

        Where a lookup's question to the remote tier starts, per namespace.
        """
        with self._lock:
            return [len(self._leading(ns, keys)) for ns in namespaces]

    def unpin(self, chunks: Sequence[StoredChunk]) -> None:
        """Undo :meth:`lookup_many`'s pins on ``chunks``."""
        with self._lock:
            for c in chunks:
                c.pins -= 1

    def acquire(self, namespace: Hashable, keys: Sequence[Hashable]) -> list[StoredChunk]:
        """Pin the leading stored ``keys`` for reading; :meth:`release` them when done."""
        with self._lock:
            found = self._leading(namespace, keys)
            self._touch(found)
            chunks = [self._lru[fk] for fk in found]
            for c in chunks:
                c.readers += 1
            self._counts.retrieved += len(chunks)
            return chunks

    def adopt(
        self,
        namespace: Hashable,
        items: Sequence[tuple[Hashable, Sequence[Any], int]],
        *,
        head: Sequence[Hashable] = (),
    ) -> list[StoredChunk]:
        """Chunks a get fetched from the remote tier, as ``(key, tensors, nbytes)``: pinned for reading.

        Each joins the index (evictable, like a put's) if room can be made for it; one that
        another request stored meanwhile is read from the index's copy instead; one a put
        is storing right now, or that no room can be made for, is read once and not kept.
        :meth:`release` them all when done. ``head`` names the request's keys before these
        (held locally): they are touched again so that the request's first key ends most
        recently used, as in every request.
        """
        with self._lock:
            protect = {(namespace, k) for k in head} | {(namespace, k) for k, _, _ in items}
            out = []
            for key, payload, nbytes in items:
                fk = (namespace, key)
                chunk = self._lru.get(fk)
                if chunk is None:
                    chunk = StoredChunk(payload, nbytes, evictable=True)
                    if fk not in self._writing and self._make_room(1, nbytes, protect)[0]:
                        self._lru[fk] = chunk
                        self._committed += nbytes
                        self._per_namespace[namespace] += 1
                chunk.readers += 1
                out.append(chunk)
            order = [(namespace, k) for k in head] + [(namespace, k) for k, _, _ in items]
            self._touch([fk for fk in order if fk in self._lru])
            self._counts.retrieved += len(out)
            self._counts.remote_loaded += len(out)
            return out

    def release(self, chunks: Sequence[StoredChunk]) -> None:
        with self._lock:
            for c in chunks:
                c.readers -= 1

    def missing(self, namespace: Hashable, keys: Sequence[Hashable]) -> list[Hashable]:
        with self._lock:
            return [k for k in keys if (namespace, k) not in self._lru]

    def count(self, namespace: Hashable) -> int:
        """Chunks stored (or being stored) in ``namespace``."""
        with self._lock:
            return self._per_namespace[namespace]

    # -- writes --------------------------------------------------------------------------

    def reserve(
        self, namespace: Hashable, keys: Sequence[Hashable], chunk_nbytes: int, *, shared: bool
    ) -> Reservation:
        """Decide what a store writes and hold back its bytes, evicting LRU chunks if needed.

        ``shared``: skip keys already present or being written, and store the leading
        absent keys that fit (the rest are ``dropped``). Otherwise (a context's own
        chunks): write every key, replacing what it had, or raise
        :class:`TransferError` and reserve nothing if they cannot all fit.
        """
        if chunk_nbytes <= 0:
            raise ValueError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
        with self._lock:
            res = Reservation(namespace, [], chunk_nbytes, shared)
            if shared:
                present = []
                for k in keys:
                    fk = (namespace, k)
                    if fk in self._lru:
                        present.append(fk)
                    elif fk not in self._writing:
                        res.keys.append(k)
                self._touch(present)
                res.present = len(keys) - len(res.keys)
                fit, res.evicted = self._make_room(
                    len(res.keys), chunk_nbytes, protect={(namespace, k) for k in keys}
                )
                res.dropped = len(res.keys) - fit
                del res.keys[fit:]
                self._writing.update((namespace, k) for k in res.keys)
                self._per_namespace[namespace] += len(res.keys)
                res.reserved = fit * chunk_nbytes
            else:
                res.keys = list(keys)
                replaced = sum(self._lru[(namespace, k)].nbytes for k in keys if (namespace, k) in self._lru)
                need = len(keys) * chunk_nbytes - replaced
                room = self.max_bytes - self._committed - self._reserved
                victims = self._victims(need - room, protect=set()) if need > room else []
                if need > room + sum(self._lru[fk].nbytes for fk in victims):
                    raise TransferError(
                        f"store of {len(keys) * chunk_nbytes} bytes exceeds the server's host memory "
                        f"({self._committed + self._reserved} of {self.max_bytes} bytes in use, "
                        f"{self._unevictable()} of them not evictable); nothing was stored"
                    )
                res.evicted = self._evict(victims)
                res.reserved = need
            self._reserved += res.reserved
            return res

    def commit(self, res: Reservation, payloads: Sequence[tuple[Sequence[Any], int]]) -> None:
        """Make the reserved keys readable; ``payloads[i]`` is ``(tensors, nbytes)`` of ``res.keys[i]``."""
        if len(payloads) != len(res.keys):
            raise ValueError(f"commit: {len(payloads)} payloads for {len(res.keys)} keys")
        with self._lock:
            self._finish(res)
            added = []
            for k, (payload, nbytes) in zip(res.keys, payloads, strict=True):
                fk = (res.namespace, k)
                old = self._lru.pop(fk, None)
                if old is not None:
                    self._committed -= old.nbytes
                elif not res.shared:
                    self._per_namespace[res.namespace] += 1
                self._writing.discard(fk)
                self._lru[fk] = StoredChunk(payload, nbytes, evictable=res.shared)
                self._committed += nbytes
                added.append(fk)
            self._touch(added)
            self._counts.stored += len(added)
            self._counts.present += res.present
            self._counts.dropped += res.dropped

    def abort(self, res: Reservation) -> None:
        """Give back a reservation whose copy failed; the keys stay absent (or unchanged)."""
        with self._lock:
            self._finish(res)
            if res.shared:
                for k in res.keys:
                    self._writing.discard((res.namespace, k))
                self._forget(res.namespace, len(res.keys))

    def drop(self, namespace: Hashable) -> int:
        """Remove every chunk of ``namespace`` (a closing context's own); return how many."""
        with self._lock:
            doomed = [fk for fk in self._lru if fk[0] == namespace]
            for fk in doomed:
                self._committed -= self._lru.pop(fk).nbytes
            self._forget(namespace, len(doomed))
            return len(doomed)

    def removed_since(
        self, namespaces: Sequence[Hashable], since: int, limit: int
    ) -> tuple[list[tuple[int, Hashable]], int, bool]:
        """Shared chunks of ``namespaces`` evicted after sequence ``since``, oldest first.

        Returns ``(removed, cursor, missed)``: at most ``limit`` ``(namespace index, key)``
        pairs, the cursor to ask from next, and whether removals after ``since`` were
        already forgotten (the log keeps the last :data:`REMOVAL_LOG`).
        """
        where = {ns: i for i, ns in enumerate(namespaces)}
        with self._lock:
            missed = bool(self._removals) and self._removals[0][0] > since + 1 and since < self._removal_seq
            out: list[tuple[int, Hashable]] = []
            cursor = max(since, self._removals[0][0] - 1) if self._removals else since
            for seq, ns, key in self._removals:
                if seq <= since:
                    continue
                if len(out) == limit:
                    break
                cursor = seq
                if ns in where:
                    out.append((where[ns], key))
            else:
                cursor = max(cursor, self._removal_seq)
            return out, cursor, missed

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "chunks": len(self._lru),
                "host_bytes": self._committed + self._reserved,
                "max_host_bytes": self.max_bytes,
                "pinned": sum(1 for c in self._lru.values() if c.held),
                **vars(self._counts),
            }

    # -- under the lock ------------------------------------------------------------------

    def _leading(self, namespace: Hashable, keys: Sequence[Hashable]) -> list[FullKey]:
        found = []
        for k in keys:
            fk = (namespace, k)
            if fk not in self._lru:
                break
            found.append(fk)
        return found

    def _touch(self, keys: Sequence[FullKey]) -> None:
        for fk in reversed(keys):  # the request's first key ends most recently used
            self._lru.move_to_end(fk)

    def _victims(self, need: int, protect: set[FullKey]) -> list[FullKey]:
        """Least recently used evictable chunks nobody reads or leases: ``need`` bytes (or all)."""
        out, freed = [], 0
        for fk, c in self._lru.items():
            if freed >= need:
                break
            if c.evictable and not c.held and fk not in protect:
                out.append(fk)
                freed += c.nbytes
        return out

    def _make_room(self, n: int, chunk_nbytes: int, protect: set[FullKey]) -> tuple[int, int]:
        """Evict for up to ``n`` chunks of ``chunk_nbytes``; return how many fit and how many went."""
        room = self.max_bytes - self._committed - self._reserved
        need = n * chunk_nbytes
        if need <= room:
            return n, 0
        victims = self._victims(need - room, protect)
        available = room + sum(self._lru[fk].nbytes for fk in victims)
        fit = min(n, max(available, 0) // chunk_nbytes)
        short, used = fit * chunk_nbytes - room, []
        for fk in victims:  # evict only what the chunks that fit need
            if short <= 0:
                break
            used.append(fk)
            short -= self._lru[fk].nbytes
        return fit, self._evict(used)

    def _evict(self, victims: Sequence[FullKey]) -> int:
        for fk in victims:
            self._committed -= self._lru.pop(fk).nbytes
            self._forget(fk[0], 1)
            self._removal_seq += 1
            self._removals.append((self._removal_seq, *fk))
        self._counts.evictions += len(victims)
        return len(victims)

    def _forget(self, namespace: Hashable, n: int) -> None:
        self._per_namespace[namespace] -= n
        if self._per_namespace[namespace] <= 0:
            del self._per_namespace[namespace]

    def _finish(self, res: Reservation) -> None:
        if res.done:
            raise ValueError("this reservation was already committed or aborted")
        res.done = True
        self._reserved -= res.reserved

    def _unevictable(self) -> int:
        return sum(c.nbytes for c in self._lru.values() if not c.evictable or c.held) + self._reserved

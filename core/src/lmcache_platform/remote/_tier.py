"""The remote tier: the server's chunks in a store every node shares, behind the local index.

:class:`RemoteTier` is what the server calls around its own chunk index
(``server._index``):

* after a ``put`` committed chunks locally, :meth:`RemoteTier.write_behind` queues each
  one for the store and returns at once: a writer thread encodes queued chunks
  (``remote._entry``) and sends them in pipelined batches. The queue is bounded by bytes;
  when it is full, or while the store is down, a chunk is dropped and counted, never
  waited for;
* a ``lookup`` counts the leading chunks present locally, then asks
  :meth:`RemoteTier.lookup_more` for the rest: one pipelined round trip of exists;
* a ``get`` fetches the chunks it lacks with :meth:`RemoteTier.fetch` (one pipelined
  round trip), which checks each entry against what was asked for and refuses and counts
  anything else, then moves them into the engine's blocks like local ones.

Failures never reach the engine: every store call has a deadline; a call that times out,
or fails in every item (a batch that asked only a dead cluster node), makes the writer
thread ping the store, and a store that fails or does not answer is *down*: no call goes
to it (lookups find nothing, fetches return misses, writes are dropped) until a probe,
retried with exponential backoff, finds it again. A store that answers but refuses
every write (a full or read-only disk, a Valkey at ``maxmemory`` with ``noeviction``) is
*degraded* after :data:`DEGRADE_AFTER` refused chunks in a row: it still serves lookups
and fetches, writes are dropped and counted (``dropped_degraded``) but for one trial
write per backoff period, and the first write it takes makes it healthy again. Each state
change is one log line. So a remote that is down, full, slow or flushed leaves local
serving as it was.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from . import _entry
from ._entry import Decoded, EntryIdentity, Refused, TensorSpec
from ._errors import RemoteConfigError, RemoteError, RemotePartialError, RemoteTimeout
from ._local import fetch_each
from ._registry import open_remote
from ._store import Buffer, RemoteOptions, RemoteStore, RemoteURL, read_secret_file

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Default bound on the bytes waiting to be written to the store.
DEFAULT_QUEUE_BYTES = 1 << 30
#: Default deadline of a call made without one (seconds).
DEFAULT_CALL_TIMEOUT_S = 1.0
#: A fetch (or a write) of at least this many bytes in several entries checks (or encodes)
#: them on decoder threads.
_PARALLEL_DECODE_BYTES = 16 << 20
#: Entries in flight at once from a store of independent items (``parallel_items``).
_ITEM_THREADS = 4
_LOG_PERIOD_S = 10.0  # at most one line per kind of trouble (refusals, partial failures) per 10 s
_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

HEALTHY, DEGRADED, DOWN, CONNECTING, CLOSED = "healthy", "degraded", "down", "connecting", "closed"
#: Chunks the store refused in a row (no write taken between) that make a tier degraded.
DEGRADE_AFTER = 3


def log_event(level: int, event: str, message: str, **fields: Any) -> None:
    """One server log line, in the format of the server's ``log_event`` (``--json-log`` fields)."""
    logger.log(level, message, extra={"event": event, "fields": fields})


def check_prefix(prefix: str) -> str:
    """A deployment prefix: 1 to 64 of ``[A-Za-z0-9._-]``.

    No ``{`` or ``}``: in a Valkey Cluster a ``{...}`` hash tag would put every key of the
    deployment in one slot, on one node.
    """
    if not 1 <= len(prefix) <= _entry.MAX_NAME or not set(prefix) <= _PREFIX_CHARS:
        raise RemoteConfigError(
            f"remote prefix {prefix!r}: use 1 to {_entry.MAX_NAME} letters, digits, '.', '_', '-'"
        )
    return prefix


def load_key_file(path: str) -> bytes:
    """The checksum key of a deployment, derived from a key file's contents (at least 16 bytes)."""
    material = read_secret_file(path, "remote key")
    try:
        return _entry.derive_secret(material)
    except ValueError as exc:
        raise RemoteConfigError(f"remote key file {path}: {exc}") from None


@dataclass
class _Item:
    namespace: bytes
    key: bytes
    tensors: Sequence[torch.Tensor]
    nbytes: int


class RemoteTier:
    """The remote store as the server's second tier; see the module docstring.

    ``store`` is an open :class:`~lmcache_platform.remote.RemoteStore`; ``prefix`` keeps
    this deployment's keys apart from others' in a shared store; ``secret`` (from
    :func:`load_key_file`) keys the entries' checksums; ``ttl_s`` asks the store to forget
    entries after that long; ``queue_bytes`` bounds the write-behind queue (chunks queued
    there are held in memory beside the local index); ``call_timeout_s`` is the deadline
    of a call made without one, ``write_timeout_s`` that of one batch of writes;
    ``retry_first_s`` doubling up to ``retry_max_s`` paces the probes of a store that is
    down; ``decode_threads`` check the entries of a large fetch in parallel (hashing
    releases the GIL). ``name`` names the store in log lines (its URL; it holds no secret).
    """

    def __init__(
        self,
        store: RemoteStore,
        *,
        prefix: str,
        name: str = "remote store",
        secret: bytes | None = None,
        ttl_s: float | None = None,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        batch_bytes: int = 64 << 20,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        write_timeout_s: float = 10.0,
        probe_timeout_s: float = 1.0,
        retry_first_s: float = 1.0,
        retry_max_s: float = 30.0,
        decode_threads: int = min(4, os.cpu_count() or 1),
    ) -> None:
        self.store = store
        self.prefix = check_prefix(prefix).encode()
        self.name = name
        self._secret = secret
        self.ttl_s = ttl_s
        self.queue_bytes = queue_bytes
        self.batch_bytes = batch_bytes
        self.call_timeout_s = call_timeout_s
        self.write_timeout_s = write_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.retry_first_s = retry_first_s
        self.retry_max_s = retry_max_s
        self.decode_threads = decode_threads
        self._decode_pool: ThreadPoolExecutor | None = None
        self._items: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Item] = collections.deque()
        self._queued_bytes = 0
        self._writing = 0  # items taken by the writer, not yet answered
        self._state = CONNECTING
        self._since = time.monotonic()
        self._why = "not checked yet"
        self._retry_s = retry_first_s
        self._next_probe = 0.0
        self._suspect = ""  # why the writer pings to tell slow (or one node down) from down
        self._suspect_slow = False  # the suspicion is a timeout: a ping that answers means slow
        self._refused_run = 0  # chunks the store refused in a row (degraded at DEGRADE_AFTER)
        #: The store's optional gather write (values as lists of buffers: entries without a copy).
        self._gather: Callable[..., list[bool]] | None = getattr(store, "put_many_gather", None)
        self._trial = False  # a degraded tier's trial write is queued or in flight
        self._check_codec()
        self._counts: collections.Counter[str] = collections.Counter()
        self._last_log: dict[str, float] = {}
        self._writer = threading.Thread(target=self._run, name="lmcache-remote-writer", daemon=True)
        self._writer.start()

    @classmethod
    def open(
        cls, url: str, options: RemoteOptions | None = None, *, key_file: str | None = None, **kwargs: Any
    ) -> RemoteTier:
        """Open the store ``url`` names (:func:`~lmcache_platform.remote.open_remote`) as a tier.

        ``key_file`` is read with :func:`load_key_file`; ``kwargs`` go to the constructor.
        """
        secret = load_key_file(key_file) if key_file else None
        store = open_remote(url, options)
        try:
            return cls(store, name=RemoteURL.parse(url).text, secret=secret, **kwargs)
        except BaseException:
            store.close()
            raise

    def _check_codec(self) -> None:
        """Refuse to start a tier that cannot write entries (a missing checksum package...),
        rather than lose every chunk later, one logged failure at a time."""
        try:
            import torch

            sample = torch.arange(8, dtype=torch.uint8)
            who = EntryIdentity(self.prefix, b"n", b"k")
            back = _entry.decode(_entry.encode([sample], who, self._secret), who, self._secret)
            ok = torch.equal(back.tensors[0], sample)
        except Exception as exc:
            raise RemoteConfigError(
                f"remote {self.name}: this server cannot write remote entries "
                f"({type(exc).__name__}: {exc}); install lmcache-platform's dependencies "
                "(pip install torch blake3) in the server's environment"
            ) from None
        if not ok:
            raise RemoteConfigError(f"remote {self.name}: an entry did not read back as written")

    # -- what the server calls -----------------------------------------------------------

    @property
    def state(self) -> str:
        """``connecting``, ``healthy``, ``degraded`` (reads only), ``down`` or ``closed``."""
        return self._state

    @property
    def keyed(self) -> bool:
        """Whether entries' checksums are keyed with the deployment's secret (``--remote-key-file``)."""
        return self._secret is not None

    def store_key(self, namespace: bytes, key: bytes) -> bytes:
        """``<prefix>:<namespace hex>:<key hex>``: the store key of one chunk (no hash tag)."""
        return b"%s:%s:%s" % (self.prefix, namespace.hex().encode(), key.hex().encode())

    def lookup_more(self, namespace: bytes, keys: Sequence[bytes], deadline: int | None = None) -> int:
        """How many leading ``keys`` the store holds: one pipelined round trip, within ``deadline``.

        ``deadline`` is ``time.monotonic_ns()`` like the protocol's (``None``: the tier's
        default). 0 while the store is down or when the call fails; never raises for the store.
        """
        return self.lookup_more_many([(namespace, keys)], deadline)[0]

    def lookup_more_many(
        self, asks: Sequence[tuple[bytes, Sequence[bytes]]], deadline: int | None = None
    ) -> list[int]:
        """:meth:`lookup_more` for several ``(namespace, keys)`` at once, in one round trip.

        A lookup over several namespaces (one per tensor-parallel rank) asks for each
        namespace's keys after its own local hits, and takes the minimum.
        """
        flat = [(ns, k) for ns, keys in asks for k in keys]
        if not flat:
            return [0] * len(asks)
        self._add(lookups=1)
        answer = self._call(
            "lookup",
            deadline,
            lambda t: self.store.exists_many([self.store_key(ns, k) for ns, k in flat], timeout=t),
            len(flat),
        )
        if answer is None:
            return [0] * len(asks)
        present, _failed = answer
        out, at = [], 0
        for _ns, keys in asks:
            mine = present[at : at + len(keys)]
            at += len(keys)
            hits = next((i for i, p in enumerate(mine) if not p), len(mine))
            self._add(hits=hits, misses=len(keys) - hits)
            out.append(hits)
        return out

    def fetch(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        deadline: int | None = None,
        expect: Sequence[TensorSpec] | None = None,
        into: Callable[[], Sequence[torch.Tensor]] | None = None,
    ) -> list[Decoded | None]:
        """Each chunk of ``keys`` from the store, checked; ``None`` where absent, refused or failed.

        One pipelined round trip within ``deadline``. An entry is returned only when it is
        exactly this deployment's ``(namespace, key)``, its checksum holds, and (given
        ``expect``) its tensors have those dtypes and shapes; every refusal is counted by
        reason (``refused_<reason>``). The tensors are read-only views of the fetched bytes;
        or, given ``into`` (a maker of host tensors of the ``expect``-ed specs, such as a
        context's ``allocate_chunk``) and a store that reads in place (``get_many_into``),
        tensors ``into`` made, read straight into (``Decoded.placed``).
        """
        if not keys:
            return []
        placing = into is not None and expect is not None and hasattr(self.store, "get_many_into")
        if (len(keys) > 1 or placing) and getattr(self.store, "parallel_items", False):
            return fetch_each(self, namespace, keys, deadline, expect, into if placing else None)
        answer = self._call(
            "fetch",
            deadline,
            lambda t: self.store.get_many([self.store_key(namespace, k) for k in keys], timeout=t),
            len(keys),
        )
        if answer is None:
            return [None] * len(keys)
        values, failed = answer
        for i, value in enumerate(values):
            if value is None and i not in failed:
                self._add(fetch_misses=1)
        jobs = [(key, value) for key, value in zip(keys, values, strict=True) if value is not None]
        if len(jobs) > 1 and sum(len(v) for _, v in jobs) >= _PARALLEL_DECODE_BYTES:
            decoded = iter(
                self._decoders().map(lambda job: self._decode(namespace, job[0], job[1], expect), jobs)
            )
        else:
            decoded = iter([self._decode(namespace, key, value, expect) for key, value in jobs])
        out = [None if value is None else next(decoded) for value in values]
        refused = [k for k, v, d in zip(keys, values, out, strict=True) if v is not None and d is None]
        if refused:
            self._remove(namespace, refused, deadline)
        return out

    def _remove(self, namespace: bytes, keys: Sequence[bytes], deadline: int | None) -> None:
        """Delete refused entries where the store can (``delete_many``): damage is never read twice."""
        delete = getattr(self.store, "delete_many", None)
        if delete is None:
            return
        answer = self._call(
            "delete",
            deadline,
            lambda t: delete([self.store_key(namespace, k) for k in keys], timeout=t),
            len(keys),
        )
        if answer is not None:
            removed, _failed = answer
            self._add(removed_refused=sum(1 for r in removed if r))

    def _decode(
        self, namespace: bytes, key: bytes, value: Buffer, expect: Sequence[TensorSpec] | None
    ) -> Decoded | None:
        """One fetched entry, checked (on a decoder thread for large batches: hashing drops the GIL)."""
        try:
            chunk = _entry.decode(value, EntryIdentity(self.prefix, namespace, key), self._secret, expect)
        except Refused as exc:
            self._refused(exc, key)
            return None
        self._add(fetched=1, bytes_fetched=chunk.nbytes, fetched_v1=int(chunk.version == 1))
        return chunk

    def _refused(self, exc: Refused, key: bytes) -> None:
        self._add(**{f"refused_{exc.reason}": 1})
        self._log_limited(
            "refused", logging.WARNING, f"remote {self.name}: refused an entry ({exc.reason}): {exc}",
            reason=exc.reason, key=key.hex()[:16],
        )  # fmt: skip

    def _item_pool(self) -> ThreadPoolExecutor:
        """Threads for a store of independent items: each reads or writes one entry and checks
        or encodes it (several in flight: a disk's queue; the checksums share the cores)."""
        with self._lock:
            if self._items is None:
                self._items = ThreadPoolExecutor(
                    max_workers=max(self.decode_threads, _ITEM_THREADS),
                    thread_name_prefix="lmcache-remote-item",
                )
            return self._items

    def _decoders(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._decode_pool is None:
                self._decode_pool = ThreadPoolExecutor(
                    max_workers=self.decode_threads, thread_name_prefix="lmcache-remote-decode"
                )
            return self._decode_pool

    def write_behind(self, namespace: bytes, key: bytes, tensors: Sequence[torch.Tensor]) -> bool:
        """Queue one chunk (host tensors, not modified afterwards) for the store; never blocks.

        ``False`` (and counted) when it was dropped: the queue is full (``dropped_full``),
        the store is down (``dropped_down``), refuses writes (``dropped_degraded``; one
        chunk per backoff period goes as a trial) or the tier is closed.
        """
        nbytes = sum(int(t.nbytes) for t in tensors)
        with self._lock:
            if self._state == CLOSED:
                return False
            if self._state == DOWN:
                self._counts["dropped_down"] += 1
                return False
            if self._state == DEGRADED:
                if self._trial or time.monotonic() < self._next_probe:
                    self._counts["dropped_degraded"] += 1
                    return False
                self._trial = True
            if self._queued_bytes + nbytes > self.queue_bytes:
                self._counts["dropped_full"] += 1
                return False
            self._queue.append(_Item(namespace, key, tensors, nbytes))
            self._queued_bytes += nbytes
            self._counts["queued"] += 1
            self._wake.notify()
        return True

    def stats(self) -> dict[str, Any]:
        """Counters (see docs/multi-node.md) and ``state``; every refusal reason is present."""
        with self._lock:
            out: dict[str, Any] = {
                "state": self._state,
                "queue_entries": len(self._queue),
                "queue_bytes": self._queued_bytes,
            }
            for name in _COUNTERS:
                out[name] = self._counts[name]
            for reason in _entry.REASONS:
                out[f"refused_{reason}"] = self._counts[f"refused_{reason}"]
            return out

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the first probe answered (or ``timeout``); ``True`` when healthy."""
        end = time.monotonic() + timeout
        while self._state == CONNECTING and time.monotonic() < end:
            time.sleep(0.005)
        return self._state == HEALTHY

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is written (or dropped); ``True`` when it emptied in time."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._queue or self._writing:
                left = end - time.monotonic()
                if left <= 0 or self._state == CLOSED:
                    return False
                self._wake.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued within ``timeout`` if the store is up, then stop and close the store."""
        if self._state == HEALTHY:
            self.flush(timeout)
        with self._lock:
            if self._state == CLOSED:
                return
            self._set_state(CLOSED, "closed")
            dropped, dropped_bytes, unsure = len(self._queue), self._queued_bytes, self._writing
            self._counts["dropped_down"] += dropped
            self._queue.clear()
            self._queued_bytes = 0
            self._wake.notify_all()
        if dropped or unsure:
            log_event(
                logging.WARNING, "remote_dropped",
                f"remote {self.name}: closing after {timeout:g} s with {dropped} queued chunks "
                f"({dropped_bytes} bytes) dropped and {unsure} in a write the store has not answered "
                "(they may be lost)",
                store=self.name, chunks=dropped + unsure, queued=dropped, unanswered=unsure,
                bytes=dropped_bytes,
            )  # fmt: skip
        self._writer.join(timeout)
        for pool in (self._decode_pool, self._items):
            if pool is not None:
                pool.shutdown(wait=False)
        try:
            self.store.close()
        except Exception:
            logger.exception("remote %s: closing the store failed", self.name)

    # -- calls with a deadline -----------------------------------------------------------

    def _call(
        self, what: str, deadline: int | None, fn: Callable[[float], list[T]], n: int
    ) -> tuple[list[T], frozenset[int]] | None:
        """Run one store call within ``deadline``: its ``n`` answers and the indexes that failed.

        ``None`` when the store was not asked (down, deadline passed) or the call failed;
        every such case is counted, and a failure or a timeout feeds the state machine.
        """
        if self._state not in (HEALTHY, DEGRADED):
            self._add(skipped=1)
            return None
        if deadline is None:
            timeout = self.call_timeout_s
        else:
            timeout = (deadline - time.monotonic_ns()) / 1e9
            if timeout <= 0:
                self._add(deadline_passed=1)
                return None
        started = time.monotonic()
        failed: frozenset[int] = frozenset()
        try:
            result = fn(timeout)
        except RemotePartialError as exc:
            self._add(errors=len(exc.failed))
            self._partial(what, exc, n)
            result, failed = list(exc.results), frozenset(exc.failed)
        except RemoteTimeout as exc:
            self._add(timeouts=1)
            self._suspect_now(f"{what} timed out after {time.monotonic() - started:.3f} s ({exc})", slow=True)
            return None
        except RemoteError as exc:
            self._add(errors=1)
            self._went_down(f"{what} failed: {exc}")
            return None
        except Exception as exc:  # a store broke its contract: the server keeps serving
            self._add(errors=1)
            logger.exception(
                "remote %s: %s raised %s, not a RemoteError", self.name, what, type(exc).__name__
            )
            self._went_down(f"{what} raised {type(exc).__name__}: {exc}")
            return None
        if len(result) != n:
            self._add(errors=1)
            self._went_down(f"{what} answered {len(result)} items for {n}")
            return None
        return result, failed

    # -- the writer thread: writes, probes -----------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._state == CLOSED:
                        return
                    now = time.monotonic()
                    if self._state in (CONNECTING, DOWN) and now >= self._next_probe:
                        job = "probe"
                        break
                    if self._suspect:
                        job = "suspect"
                        break
                    if self._state in (HEALTHY, DEGRADED) and self._queue:
                        job = "write"
                        break
                    wait = self._next_probe - now if self._state in (CONNECTING, DOWN) else None
                    self._wake.wait(wait)
                batch: list[_Item] = self._take() if job == "write" else []
            try:
                if job == "probe":
                    self._probe()
                elif job == "suspect":
                    self._check_suspect()
                else:
                    self._write(batch)
            except Exception:  # a bug here must not stop every later write and probe
                logger.exception("remote %s: the writer thread's %s failed", self.name, job)
                with self._lock:
                    self._counts["errors"] += 1
                    self._writing = 0
                    self._wake.notify_all()

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        size = 0
        while self._queue and (not batch or size + self._queue[0].nbytes <= self.batch_bytes):
            item = self._queue.popleft()
            batch.append(item)
            size += item.nbytes
        self._queued_bytes -= size
        self._writing = len(batch)
        return batch

    def _encode(self, item: _Item) -> tuple[bytes, Any] | None:
        """One chunk's store key and entry (its parts, for a store that gathers them: no copy);
        ``None`` (a lost write, counted) when it cannot be encoded."""
        encode = _entry.encode_parts if self._gather is not None else _entry.encode
        try:
            entry = encode(item.tensors, EntryIdentity(self.prefix, item.namespace, item.key), self._secret)
        except Exception as exc:  # counted as lost writes; the tier checked its codec at start
            self._add(write_errors=1, encode_errors=1)
            self._log_limited(
                "encode", logging.WARNING,
                f"remote {self.name}: cannot encode a chunk: {type(exc).__name__}: {exc}",
            )  # fmt: skip
            return None
        return self.store_key(item.namespace, item.key), entry

    def _write(self, batch: list[_Item]) -> None:
        """Write one batch; for a store of independent items (``parallel_items``: a local disk),
        each chunk is encoded and written on its own decoder thread, so one's checksum runs
        while another is written."""
        try:
            if len(batch) > 1 and getattr(self.store, "parallel_items", False):
                list(self._item_pool().map(lambda item: self._write_some([item]), batch))
            else:
                self._write_some(batch)
        finally:
            with self._lock:
                self._writing = 0
                self._trial = False
                self._wake.notify_all()

    def _write_some(self, batch: list[_Item]) -> None:
        if len(batch) > 1 and sum(item.nbytes for item in batch) >= _PARALLEL_DECODE_BYTES:
            encoded = list(self._decoders().map(self._encode, batch))  # copies and hashing drop the GIL
        else:
            encoded = [self._encode(item) for item in batch]
        items = [e for e in encoded if e is not None]
        stored: list[bool] = []
        failed: frozenset[int] = frozenset()  # items that failed (a node down), not refused
        try:
            if items:
                put = self._gather or self.store.put_many
                stored = put(items, ttl=self.ttl_s, timeout=self.write_timeout_s)
        except RemotePartialError as exc:
            stored = [bool(s) for s in exc.results]
            failed = frozenset(exc.failed)
            self._partial("write", exc, len(items))
        except RemoteTimeout as exc:  # slow or hung: the ping tells which; these chunks are lost
            self._add(timeouts=1, write_errors=len(items))
            self._suspect_now(f"write of {len(items)} chunks timed out ({exc})", slow=True)
            stored = []
        except RemoteError as exc:
            self._add(dropped_down=len(items), errors=1)
            self._went_down(f"write of {len(items)} chunks failed: {exc}")
            stored = []
        except Exception as exc:
            self._add(dropped_down=len(items), errors=1)
            logger.exception(
                "remote %s: put_many raised %s, not a RemoteError", self.name, type(exc).__name__
            )
            self._went_down(f"write raised {type(exc).__name__}: {exc}")
            stored = []
        else:
            if len(stored) != len(items):
                self._add(errors=1)
                self._went_down(f"write answered {len(stored)} items for {len(items)}")
                stored = []
        ok = sum(1 for s in stored if s)
        answered = zip(items, stored, strict=True) if stored else ()  # none when the call failed
        written_bytes = sum(_size(entry) for (_, entry), s in answered if s)
        with self._lock:
            self._counts["written"] += ok
            self._counts["bytes_written"] += written_bytes
            self._counts["write_errors"] += len(stored) - ok
            if ok:
                self._refused_run = 0
                if self._state == DEGRADED:
                    self._set_state(HEALTHY, "took a write")
            elif len(stored) > len(failed):  # the store answered and refused: full, read-only...
                self._refused_run += len(stored) - len(failed)
                if self._state == HEALTHY and self._refused_run >= DEGRADE_AFTER:
                    self._degrade(f"it refused {self._refused_run} chunks in a row (see its log for why)")
                elif self._state == DEGRADED and self._trial:  # the trial failed: wait longer
                    self._retry_s = min(self._retry_s * 2, self.retry_max_s)
                    self._next_probe = time.monotonic() + self._retry_s

    def _degrade(self, why: str) -> None:
        """Under the lock: reads go on, the queue is dropped, one trial write per backoff period."""
        self._retry_s = self.retry_first_s
        self._set_state(DEGRADED, why)
        self._next_probe = time.monotonic() + self._retry_s
        self._counts["dropped_degraded"] += len(self._queue)
        self._queue.clear()
        self._queued_bytes = 0

    def _probe(self) -> None:
        try:
            self.store.ping(timeout=self.probe_timeout_s)
        except Exception as exc:
            self._went_down(f"{type(exc).__name__}: {exc}", probe=True)
            return
        with self._lock:
            if self._state in (CONNECTING, DOWN):
                self._set_state(HEALTHY, "answered a ping")

    def _partial(self, what: str, exc: RemotePartialError, n: int) -> None:
        """Some items failed (a cluster node down): logged; if every one did, is it the whole store?"""
        message = f"remote {self.name}: {what}: {exc}"
        if self._state != DEGRADED:  # a degraded tier's refused trials: its state line said so
            self._log_limited("partial", logging.WARNING, message, failed=len(exc.failed))
        if len(exc.failed) >= n:
            self._suspect_now(f"every item of a {what} failed ({exc})", slow=False)

    def _suspect_now(self, why: str, *, slow: bool) -> None:
        """Have the writer ping the store: a call timed out (``slow``), or failed in every item."""
        with self._lock:
            if self._state == HEALTHY and not self._suspect:
                self._suspect, self._suspect_slow = why, slow
                self._wake.notify()

    def _check_suspect(self) -> None:
        with self._lock:
            why, self._suspect = self._suspect, ""
            slow = self._suspect_slow
        if not why:  # the state changed since the writer took this job: nothing to tell
            return
        try:
            self.store.ping(timeout=self.probe_timeout_s)
        except Exception as exc:
            self._went_down(f"{why}; then a ping failed: {type(exc).__name__}: {exc}")
            return
        if slow:
            self._add(slow=1)
            message = f"remote {self.name}: slow: {why}, but it answers pings"
            self._log_limited("slow", logging.WARNING, message)

    # -- state ---------------------------------------------------------------------------

    def _went_down(self, why: str, *, probe: bool = False) -> None:
        """The store failed: go down (and drop the queue), or after a failed probe back off further."""
        with self._lock:
            if self._state == CLOSED:
                return
            if self._state != DOWN:
                self._retry_s = self.retry_first_s
                self._set_state(DOWN, why)
                self._counts["dropped_down"] += len(self._queue)
                self._queue.clear()
                self._queued_bytes = 0
            elif probe:  # still down: quietly wait longer before the next probe
                self._retry_s = min(self._retry_s * 2, self.retry_max_s)
            else:
                return
            self._next_probe = time.monotonic() + self._retry_s
            self._wake.notify_all()

    def _set_state(self, state: str, why: str) -> None:
        """Under the lock: the one log line per state change."""
        old, since = self._state, self._since
        self._state, self._since, self._why = state, time.monotonic(), why
        self._counts["state_changes"] += 1
        self._suspect = ""
        if state == HEALTHY:
            self._retry_s = self.retry_first_s
            self._refused_run = 0
            after = f" after {self._since - since:.1f} s {old}" if old in (DOWN, DEGRADED) else ""
            log_event(logging.INFO, "remote_up", f"remote {self.name}: healthy{after}", store=self.name)
        elif state == DEGRADED:
            log_event(
                logging.WARNING, "remote_degraded",
                f"remote {self.name}: degraded ({why}); serving its entries, dropping writes but one "
                f"trial every {self._retry_s:g} s or more",
                store=self.name, reason=why,
            )  # fmt: skip
        elif state == DOWN:
            log_event(
                logging.WARNING, "remote_down",
                f"remote {self.name}: down ({why}); serving local hits only, retrying in {self._retry_s:g} s",
                store=self.name, reason=why,
            )  # fmt: skip
        elif state == CLOSED:
            log_event(logging.INFO, "remote_closed", f"remote {self.name}: closed", store=self.name)

    # -- counters ------------------------------------------------------------------------

    def _add(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def _log_limited(self, kind: str, level: int, message: str, **fields: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_log.get(kind, -_LOG_PERIOD_S) < _LOG_PERIOD_S:
                return
            self._last_log[kind] = now
        log_event(level, f"remote_{kind}", message, store=self.name, **fields)


def _size(entry: Buffer | Sequence[Buffer]) -> int:
    """An entry's bytes, whole or in parts."""
    if isinstance(entry, (bytes, bytearray, memoryview)):
        return len(entry)
    return sum(len(p) for p in entry)


#: The counters :meth:`RemoteTier.stats` reports (besides state, the queue and refusals).
_COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "fetched",
    "fetch_misses",
    "bytes_fetched",
    "queued",
    "written",
    "bytes_written",
    "write_errors",
    "encode_errors",
    "fetched_v1",
    "dropped_full",
    "dropped_down",
    "dropped_degraded",
    "errors",
    "timeouts",
    "slow",
    "skipped",
    "deadline_passed",
    "state_changes",
    "removed_refused",
)

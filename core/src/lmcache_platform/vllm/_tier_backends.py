"""Where :class:`~lmcache_platform.vllm.tier.LMCachePlatformTier` keeps rows: a server, or a store.

Both answer the same three blocking calls, made only on the tier's own threads:
``lookup`` (which keys are held), ``store`` (rows to keys) and ``load`` (keys to rows,
the leading ones that could be read). A failure raises; the tier turns it into a
failed job or a miss.

* :class:`ServerRows` talks to ``lmcache-platform serve``: vLLM's primary region is
  registered once per connection as a context of one ``uint8`` layer whose blocks are
  the rows (the file's descriptor travels beside the request), and then ``put`` and
  ``get`` name keys and row numbers; the server copies the rows itself. A connection
  that fails is dropped; the next call after a pause (doubling, up to 5 s) dials again
  and registers anew, so a restarted server is picked up by itself.
* :class:`StoreRows` writes straight to a remote store (``file://``, ``valkey://``)
  through :class:`~lmcache_platform.remote._tier.RemoteTier`, the tier ``serve
  --remote`` uses: the same entry format, checksums, key file, prefix and bounds.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .. import KVFormat, LayoutHints
from .._errors import ServerUnavailable
from ..client import ServerClient
from ._tier_region import Rows, rows_wrapper

logger = logging.getLogger("lmcache_platform.vllm.tier")

if TYPE_CHECKING:
    from ..remote._chain import RemoteChain
    from ..remote._tier import RemoteTier

#: Keys per server request (a request's frame stays small; the server copies a batch at a time).
_BATCH = 256
#: Fewest chunks in a part of a job split over lanes (smaller jobs take one lane).
_MIN_PART = 16
_RETRY_FIRST_S, _RETRY_MAX_S = 0.25, 5.0
#: How long a connection's registration may take, however short the transfer deadline: the
#: server opens and maps the region then (and a fresh one may still be preparing its memory),
#: seconds on a busy host. It runs on the tier's own threads, never on vLLM's.
_REGISTER_S = 10.0


class TierUnavailable(Exception):
    """The server or store cannot be used now (down, hung, refusing); the call did nothing it reports."""


class _Pacer:
    """When to dial a failed server again: at once, then after pauses doubling to 5 s."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pause = 0.0
        self._next = 0.0
        self.why = ""

    def check(self) -> None:
        with self._lock:
            if time.monotonic() < self._next:
                raise TierUnavailable(
                    f"server unavailable ({self.why}); next try in {self._next - time.monotonic():.1f} s"
                )

    def failed(self, why: str) -> None:
        with self._lock:
            self._pause = min(_RETRY_MAX_S, max(_RETRY_FIRST_S, self._pause * 2))
            self._next = time.monotonic() + self._pause
            self.why = why

    def worked(self) -> None:
        with self._lock:
            self._pause, self._next, self.why = 0.0, 0.0, ""


class _Lane:
    """One connection of one of the tier's threads, with the region registered on it."""

    def __init__(self, owner: ServerRows, *, register: bool, deadline_ms: float) -> None:
        self.owner = owner
        self.register = register
        self.deadline_ms = deadline_ms
        self.client: ServerClient | None = None
        self.context = 0
        self.lock = threading.Lock()  # the lane's thread, and the warm-up at start

    def call(self, fn: Any) -> Any:
        """``fn(client, context)`` on a live connection; any failure drops it and raises TierUnavailable."""
        owner = self.owner
        if owner.closed:
            raise TierUnavailable("the tier is shut down")
        owner.pacer.check()
        with self.lock:
            try:
                if self.client is None:
                    self.client = self._dial()
                result = fn(self.client, self.context)
            except Exception as exc:
                self.drop()
                owner.pacer.failed(f"{type(exc).__name__}: {exc}")
                raise TierUnavailable(f"{type(exc).__name__}: {exc}") from exc
        owner.pacer.worked()
        return result

    def _dial(self) -> ServerClient:
        owner = self.owner
        setup_ms = max(self.deadline_ms, _REGISTER_S * 1e3)
        client = ServerClient(owner.socket_path, timeout=setup_ms / 1e3, deadline_ms=setup_ms)
        try:
            if self.register:
                hints = LayoutHints(kv_format=KVFormat.MLA, block_size=1, num_kv_heads=1)
                reg = client.register(
                    [rows_wrapper(owner.rows)],
                    namespace=owner.namespace,
                    lmcache_tokens_per_chunk=1,
                    layout_hints=hints,
                    chunk_format="blocks",
                )
                self.context = reg.context
        except BaseException:
            client.close()
            raise
        client.deadline_ms = self.deadline_ms  # each job's requests: the transfer deadline again
        return client

    def drop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()


class ServerRows:
    """The rows kept by ``lmcache-platform serve`` at ``socket_path``; see the module docstring."""

    medium = "CPU"

    def __init__(
        self,
        socket_path: str,
        rows: Rows,
        namespace: bytes,
        *,
        lookup_ms: float,
        transfer_ms: float,
        parallel: int = 1,
    ) -> None:
        self.socket_path = socket_path
        self.rows = rows
        self.namespace = namespace
        self.pacer = _Pacer()
        self.closed = False
        self.parallel = max(1, parallel)
        # Every lane is registered: the server knows a namespace's name in its own tiers only from
        # a context, and each context copies beside the others (the server's transfers run in
        # parallel per context), so a large job is split over ``parallel`` lanes.
        self._lanes = {"lookup": _Lane(self, register=True, deadline_ms=lookup_ms)}
        for kind in ("load", "store"):
            for i in range(self.parallel):
                self._lanes[f"{kind}{i}"] = _Lane(self, register=True, deadline_ms=transfer_ms)
        self._pool = ThreadPoolExecutor(2 * self.parallel, thread_name_prefix="lmcache-tier-part")
        # Connect and register now, beside vLLM's start-up, so the first job pays for neither
        # (the server maps the region's pages ahead of the first copies).
        threading.Thread(target=self._warm, name="lmcache-tier-connect", daemon=True).start()

    def _warm(self) -> None:
        for lane in self._lanes.values():
            try:
                lane.call(lambda c, ctx: None)
            except TierUnavailable as exc:  # the jobs will try again, paced
                logger.info("lmcache-platform tier: server %s not reachable yet: %s", self.socket_path, exc)
                return

    def watch_removals(self, period_s: float = 1.0) -> collections.deque[bytes]:
        """Keys the server evicts from its memory, appended by a thread reading its removal log."""
        removed: collections.deque[bytes] = collections.deque()
        lane = _Lane(self, register=False, deadline_ms=self._lanes["lookup"].deadline_ms)
        self._lanes["removals"] = lane  # closed with the others

        def poll() -> None:
            cursor = 0
            while not self.closed:
                try:
                    res = lane.call(lambda c, _, since=cursor: c.removals([self.namespace], since))
                    removed.extend(key for _, key in res.removed)
                    cursor = res.cursor
                except TierUnavailable:  # a new server starts its log afresh
                    cursor = 0
                time.sleep(period_s)

        threading.Thread(target=poll, name="lmcache-tier-removals", daemon=True).start()
        return removed

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the server holds (its memory, then its tiers): leading runs, one call each."""
        return held(keys, lambda ks: self._lanes["lookup"].call(lambda c, _: c.lookup(self.namespace, ks)))

    def store(self, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """The rows copied into the server under ``keys``; raises unless every key is held after."""
        for kept, asked in self._parts("store", keys, rows, self._put):
            if kept < asked:
                raise TierUnavailable(f"the server kept {kept} of {asked} chunks (full, or a part failed)")

    def load(self, keys: Sequence[bytes], rows: Sequence[int]) -> int:
        """How many leading keys the server wrote into their rows."""
        done = 0
        for got, asked in self._parts("load", keys, rows, self._get):
            done += got
            if got < asked:
                break
        return done

    def _parts(
        self, kind: str, keys: Sequence[bytes], rows: Sequence[int], move: Any
    ) -> list[tuple[int, int]]:
        """``move(lane, keys, rows)`` over contiguous parts, a lane each, at once; ``(done, asked)`` each.

        A part that raised counts as none done (after one more try if another part got through);
        the first error is raised only if every part failed.
        """
        n = len(keys)
        count = max(1, min(self.parallel, n // _MIN_PART))
        bounds = [(n * i // count, n * (i + 1) // count) for i in range(count)]
        futures = [
            self._pool.submit(move, self._lanes[f"{kind}{i}"], keys[lo:hi], rows[lo:hi])
            for i, (lo, hi) in enumerate(bounds)
        ]
        out: list[tuple[int, int]] = []
        failed: dict[int, TierUnavailable] = {}
        for i, ((lo, hi), future) in enumerate(zip(bounds, futures, strict=True)):
            try:
                out.append((int(future.result()), hi - lo))
            except TierUnavailable as exc:
                failed[i] = exc
                out.append((0, hi - lo))
        if len(failed) == count:
            raise failed[0]
        for i in failed:  # refused by the pause while another part found the server back: once more
            lo, hi = bounds[i]
            with contextlib.suppress(TierUnavailable):  # else this part fails; the others' count stands
                out[i] = (int(move(self._lanes[f"{kind}{i}"], keys[lo:hi], rows[lo:hi])), hi - lo)
        return out

    def _put(self, lane: _Lane, keys: Sequence[bytes], rows: Sequence[int]) -> int:
        kept = 0
        for at in range(0, len(keys), _BATCH):
            chunks = [(k, [[r]]) for k, r in zip(keys[at : at + _BATCH], rows[at : at + _BATCH], strict=True)]
            res = lane.call(lambda c, ctx, chunks=chunks: c.put(ctx, chunks))
            kept += res.stored + res.present
            if res.stored + res.present < len(chunks):
                break
        return kept

    def _get(self, lane: _Lane, keys: Sequence[bytes], rows: Sequence[int]) -> int:
        done = 0
        for at in range(0, len(keys), _BATCH):
            chunks = [(k, [[r]]) for k, r in zip(keys[at : at + _BATCH], rows[at : at + _BATCH], strict=True)]
            got = int(lane.call(lambda c, ctx, chunks=chunks: c.get(ctx, chunks)).retrieved)
            done += got
            if got < len(chunks):
                break
        return done

    def close(self) -> None:
        """Wait for the parts under way, drop every connection, close our descriptor of the region."""
        self.closed = True
        self._pool.shutdown(wait=True)
        for lane in self._lanes.values():
            with lane.lock:
                lane.drop()
        os.close(self.rows.fd)


class StoreRows:
    """The rows kept straight in a remote store (no server); see the module docstring."""

    def __init__(
        self,
        tier: RemoteTier | RemoteChain,
        view: memoryview,
        namespace: bytes,
        *,
        timeout_ms: float,
        flush_s: float = 1.0,
    ) -> None:
        import numpy as np

        from ..remote._entry import TensorSpec

        self.tier = tier
        self.namespace = namespace
        self.timeout_ms = timeout_ms
        self.flush_s = flush_s  # how long close() lets queued writes finish (``remote_flush_timeout``)
        # Rows are copied as bytes (one memcpy each), never with torch: this runs in vLLM's
        # process, whose torch copies fan out over its intra-op threads, which the engine's
        # own threads keep busy (on 2 busy cores a 1 MiB row took 7 ms that way, 0.5 ms so).
        self._rows = np.asarray(view).view(np.uint8)  # (rows, bytes); rows may be padded apart
        self._expect = [TensorSpec("uint8", (int(self._rows.shape[1]),))]
        self.closed = False

    def _deadline(self) -> int:
        return time.monotonic_ns() + int(self.timeout_ms * 1e6)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the store holds (a store still connecting is waited for, within the deadline)."""
        self._ready()
        return held(keys, lambda ks: self.tier.lookup_more(self.namespace, ks, self._deadline()))

    def _ready(self) -> None:
        if self.tier.state != "healthy" and not self.tier.wait_ready(self.timeout_ms / 1e3):
            raise TierUnavailable(f"the store is {self.tier.state} ({getattr(self.tier, '_why', '')})")

    def store(self, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """Each row copied out (vLLM may reuse it once the job ends), queued, and written before return."""
        import torch

        self._ready()
        for key, row in zip(keys, rows, strict=True):
            copy = torch.frombuffer(bytearray(self._row(row)), dtype=torch.uint8)
            if not self.tier.write_behind(self.namespace, key, [copy]):
                raise TierUnavailable("the store's write queue is full or the store is down")
        if not self.tier.flush(self.timeout_ms / 1e3):
            raise TierUnavailable("the store did not take the writes in time")
        if self.tier.state != "healthy":
            raise TierUnavailable(f"the store went {self.tier.state} while writing")

    def load(self, keys: Sequence[bytes], rows: Sequence[int]) -> int:
        """Leading entries fetched, checked (identity, checksum, shape) and copied into their rows."""
        from ..remote._entry import byte_view

        self._ready()
        got = self.tier.fetch(self.namespace, list(keys), self._deadline(), expect=self._expect)
        done = 0
        for chunk, row in zip(got, rows, strict=True):
            if chunk is None:
                break
            self._row(row)[:] = byte_view(chunk.tensors[0].contiguous())
            done += 1
        return done

    def _row(self, row: int) -> memoryview:
        data: memoryview = self._rows[row].data  # one row's bytes, contiguous
        return data

    def close(self) -> None:
        """Close the store; drop our view of the rows (vLLM unmaps the region after)."""
        self.closed = True
        self.tier.close(self.flush_s)
        del self._rows


def held(keys: Sequence[bytes], leading: Any) -> list[bool]:
    """Per-key presence from a ``leading(keys) -> count of leading keys held`` call: one call per run."""
    out: list[bool] = []
    rest = list(keys)
    while rest:
        n = int(leading(rest))
        out += [True] * n
        if n < len(rest):
            out.append(False)
        rest = rest[n + 1 :]
    return out


__all__ = ["ServerRows", "ServerUnavailable", "StoreRows", "TierUnavailable", "held"]

"""The tier's jobs off vLLM's scheduler thread: queued, run on two threads, each reported once.

Loads and stores run on threads of their own (a long store never holds up a load);
the scheduler thread only appends to a queue and takes finished results. A job that
raises is a failed job; nothing raises into vLLM. ``drain`` waits for the queues to
empty and the jobs under way to end (each is bounded by the backend's deadlines);
``close`` fails what never started and waits for what did.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger("lmcache_platform.vllm.tier")

#: Latencies kept for the stats between two reads.
_MAX_SAMPLES = 4096


@dataclass
class Job:
    """One queued transfer: vLLM's id, our keys and the primary rows."""

    job_id: int
    kind: str  # "load" or "store"
    keys: list[bytes]
    rows: list[int]
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class Done:
    """A finished job: how many leading keys succeeded, its time and bytes."""

    job: Job
    ok: int
    seconds: float
    error: str = ""

    @property
    def success(self) -> bool:
        return self.ok == len(self.job.keys)


class Stats:
    """Counters and job latencies, taken (and reset) by ``get_stats``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.latency: dict[str, list[float]] = {"load": [], "store": []}

    def add(self, **counts: int) -> None:
        with self.lock:
            self.counts.update(counts)

    def job(self, kind: str, seconds: float) -> None:
        with self.lock:
            samples = self.latency[kind]
            if len(samples) < _MAX_SAMPLES:
                samples.append(seconds)

    def take(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        with self.lock:
            counts, latency = dict(self.counts), self.latency
            self.counts = collections.Counter()
            self.latency = {"load": [], "store": []}
        return counts, latency


class Runner:
    """Runs jobs with ``run(job) -> leading keys done`` on a thread per kind; see the module docstring."""

    def __init__(self, run: Callable[[Job], int], row_bytes: int, stats: Stats) -> None:
        self._run = run
        self._row_bytes = row_bytes
        self._stats = stats
        self._cond = threading.Condition()
        self._queues: dict[str, collections.deque[Job]] = {
            "load": collections.deque(),
            "store": collections.deque(),
        }
        self._busy = 0
        self._finished: collections.deque[Done] = collections.deque()
        self._closing = False
        #: The latest failure's reason (status and tests; the jobs themselves only fail).
        self.last_error = ""
        self._threads = [
            threading.Thread(target=self._loop, args=(kind,), name=f"lmcache-tier-{kind}", daemon=True)
            for kind in self._queues
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (never waits); after :meth:`close` it fails at once."""
        with self._cond:
            if self._closing:
                self._finished.append(Done(job, 0, 0.0, "the tier is shut down"))
                return
            self._queues[job.kind].append(job)
            self._cond.notify_all()

    def finished(self) -> list[Done]:
        """Jobs finished since the last call, each once."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def pending(self) -> bool:
        """Whether a job is queued, running, or finished but not yet taken."""
        with self._cond:
            return bool(self._busy or any(self._queues.values()) or self._finished)

    def in_flight(self) -> int:
        with self._cond:
            return self._busy + sum(len(q) for q in self._queues.values())

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; whether that happened within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy and not any(self._queues.values()), timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Fail the jobs not started, wait (up to ``timeout``) for those running, stop the threads."""
        with self._cond:
            self._closing = True
            for q in self._queues.values():
                while q:
                    self._finished.append(Done(q.popleft(), 0, 0.0, "the tier is shut down"))
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _loop(self, kind: str) -> None:
        queue = self._queues[kind]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or bool(queue))
                if not queue:
                    return
                job = queue.popleft()
                self._busy += 1
            start = time.monotonic()
            error = ""
            try:
                ok = self._run(job)
            except Exception as exc:  # a failed job, reported as one; never raised into vLLM
                ok, error = 0, f"{type(exc).__name__}: {exc}"
                self.last_error = error
                logger.debug("lmcache-platform tier: %s job %d failed: %s", kind, job.job_id, error)
            seconds = time.monotonic() - start
            self._account(kind, job, ok, seconds, error)
            with self._cond:
                self._finished.append(Done(job, ok, seconds, error))
                self._busy -= 1
                self._cond.notify_all()

    def _account(self, kind: str, job: Job, ok: int, seconds: float, error: str) -> None:
        n = len(job.keys)
        if kind == "store":
            whole = n if ok == n else 0
            self._stats.add(
                stores=1, store_chunks=whole, store_bytes=whole * self._row_bytes, store_failures=int(ok != n)
            )
        else:
            self._stats.add(
                loads=1, load_chunks=ok, load_bytes=ok * self._row_bytes, load_failures=int(ok != n)
            )
        self._stats.job(kind, seconds)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples`` by nearest rank; 0.0 for none."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

"""``LMCachePlatformTier``: lmcache-platform behind vLLM's own ``OffloadingConnector``.

vLLM's native offloading (``OffloadingConnector`` with ``spec_name":
"TieringOffloadingSpec"``) keeps a CPU primary tier in a ``/dev/shm`` region and
cascades chunks to secondary tiers; this class is one, loaded by module path::

    "secondary_tiers": [{"type": "LMCachePlatformTier",
                         "module_path": "lmcache_platform.vllm.tier",
                         "socket": "/run/lmcache/server.sock"}]

* ``"socket": PATH``: through a running ``lmcache-platform serve``. The region's file
  is handed to the server once per connection; then only keys and row numbers cross
  the socket and the server copies rows to and from its memory and its own tiers
  (``serve --remote ...``). Every engine on the host shares that memory.
* ``"remote": URL`` (``file:///dir``, ``valkey://...``, a list for a chain): straight
  to a store from the scheduler process, with ``serve --remote``'s entry format,
  checksums and options, under the flags' names (``remote_prefix``,
  ``remote_key_file``, ``remote_ttl``, ``remote_queue_bytes``, ``remote_timeout_ms``,
  ``remote_option``, ``remote_password_env``, ``remote_password_file``,
  ``remote_tls_ca``, ``remote_tls_cert``, ``remote_tls_key``).

Other keys: ``lookup_timeout_ms`` (1000), ``transfer_timeout_ms`` (5000), ``model_id``
(default: vLLM's model name), ``enable_kv_events`` (false), ``locality``.

Every method runs on vLLM's scheduler thread and returns at once: lookups are batched
per step on vLLM's own ``AsyncLookupManager`` thread (``RETRY`` until answered), jobs
run on the tier's two threads. A server or store that is down, hung or refusing costs
failed jobs and misses, never an exception into vLLM; the tier dials again by itself.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ._tier_backends import ServerRows, StoreRows
from ._tier_jobs import Done, Job, Runner, Stats, percentile
from ._tier_region import content_key, find_rows, tier_namespace

logger = logging.getLogger("lmcache_platform.vllm.tier")

_REMOTE_OPTIONS = (
    "remote_prefix",
    "remote_key_file",
    "remote_ttl",
    "remote_queue_bytes",
    "remote_timeout_ms",
    "remote_option",
    "remote_password_env",
    "remote_password_file",
    "remote_tls_ca",
    "remote_tls_cert",
    "remote_tls_key",
    "remote_flush_timeout",
)
_KEYS = frozenset(
    {
        "socket",
        "parallel_requests",
        "remote",
        "lookup_timeout_ms",
        "transfer_timeout_ms",
        "model_id",
        "enable_kv_events",
        "locality",
    }
    | set(_REMOTE_OPTIONS)
)
#: Prometheus names of the tier's metrics (label ``tier``: the tier's type name).
METRICS = {
    "lookups": "lmcache_platform_tier_lookups",
    "lookup_hits": "lmcache_platform_tier_lookup_hits",
    "store_chunks": "lmcache_platform_tier_stored_chunks",
    "store_bytes": "lmcache_platform_tier_stored_bytes",
    "store_failures": "lmcache_platform_tier_store_failures",
    "load_chunks": "lmcache_platform_tier_loaded_chunks",
    "load_bytes": "lmcache_platform_tier_loaded_bytes",
    "load_failures": "lmcache_platform_tier_load_failures",
    "job_seconds": "lmcache_platform_tier_job_seconds",
}


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's batched, per-step lookups, asked of our backend on vLLM's lookup thread."""

    def __init__(self, tier: LMCachePlatformTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        try:
            found = tier._backend.lookup([content_key(k) for k in keys])
        except Exception as exc:  # unavailable: misses now, asked again by later requests
            logger.debug("lmcache-platform tier: lookup failed: %s", exc)
            found = [False] * len(keys)
        tier._stats.add(lookups=len(keys), lookup_hits=sum(found))
        return found


class LMCachePlatformTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier kept by ``lmcache-platform serve`` or a remote store; see the module."""

    #: The server's memory (``socket``); an instance straight to a store says ``STORAGE``/``DISK``.
    medium = Medium.CPU
    cache_hit_source = CacheHitSource.HOST
    #: vLLM 0.33+: our lookups, jobs and results are thread-safe, so polling off the scheduler thread is fine.
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        unknown = sorted(set(config) - _KEYS)
        if unknown:
            raise ValueError(f"LMCachePlatformTier: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        if bool(config.get("socket")) == bool(config.get("remote")):
            raise ValueError(
                'LMCachePlatformTier: give exactly one of "socket" (a serve socket) and "remote" (a URL)'
            )
        vllm_config = getattr(offloading_spec, "config", offloading_spec)
        row_bytes = int((primary_kv_view.shape or (0, 0))[1])
        self.namespace = tier_namespace(vllm_config, row_bytes, config.get("model_id"))
        lookup_ms = float(config.get("lookup_timeout_ms", 1000))
        transfer_ms = float(config.get("transfer_timeout_ms", 5000))
        self._stats = Stats()
        self._backend: ServerRows | StoreRows
        if config.get("socket"):
            self._backend = ServerRows(
                str(config["socket"]), find_rows(primary_kv_view), self.namespace,
                lookup_ms=lookup_ms, transfer_ms=transfer_ms,
                parallel=int(config.get("parallel_requests", 1)),
            )  # fmt: skip
            self.medium = Medium.CPU
            self.cache_hit_source = CacheHitSource.HOST
        else:
            self._backend = StoreRows(
                _open_store(config),
                primary_kv_view,
                self.namespace,
                timeout_ms=transfer_ms,
                flush_s=_flush_seconds(config.get("remote_flush_timeout")),
            )
            self.medium = Medium.STORAGE
            self.cache_hit_source = CacheHitSource.DISK
        locality = config.get("locality")
        self.locality = Locality(locality) if locality is not None else None
        events_on = bool(getattr(vllm_config, "enable_kv_cache_events", False))
        self._events: list[OffloadingEvent] | None = (
            [] if config.get("enable_kv_events") and events_on else None
        )
        self._removed: collections.deque[bytes] | None = None
        if self._events is not None and isinstance(self._backend, ServerRows):
            self._removed = self._backend.watch_removals()
        self._jobs = Runner(self._run, row_bytes, self._stats)
        self._keys: dict[int, list[OffloadKey]] = {}
        self._lookups = _Lookups(self, tier_type)

    # -- vLLM's calls (scheduler thread, never waiting) ---------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, "store")

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, "load")

    def _submit(self, job: TransferJob, kind: str) -> None:
        keys = list(job.keys)
        self._keys[job.job_id] = keys
        rows = [int(r) for r in job.chunk_ids]
        self._jobs.submit(Job(job.job_id, kind, [content_key(k) for k in keys], rows))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for done in self._jobs.finished():
            results.append(self._result(done))
        return results

    def _result(self, done: Done) -> JobResult:
        job = done.job
        keys = self._keys.pop(job.job_id, [])
        nbytes = done.ok * self.block_size_bytes
        if job.kind == "store":
            if done.success and self._events is not None and keys:
                self._events.append(
                    OffloadingEvent(keys=keys, medium=self.medium, removed=False, locality=self.locality)
                )
            return JobResult(
                job_id=job.job_id, success=done.success, transfer_time=done.seconds, transfer_bytes=nbytes
            )
        if done.success:
            return JobResult(
                job_id=job.job_id, success=True, transfer_time=done.seconds, transfer_bytes=nbytes
            )
        self._lookups.mark_miss(keys[done.ok :])  # never promised again: no failed-load livelock
        kept = tuple(keys[: done.ok]) or None
        return JobResult(
            job_id=job.job_id,
            success=False,
            successful_keys=kept,
            transfer_time=done.seconds,
            transfer_bytes=nbytes,
        )

    def has_pending_work(self) -> bool:
        return self._jobs.pending()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Chunks stored since the last call and, through a server, those it evicted."""
        if self._events is None:
            return ()
        events, self._events = self._events, []
        removed = self._removed
        if removed:
            keys = [OffloadKey(removed.popleft()) for _ in range(len(removed))]
            events.append(
                OffloadingEvent(keys=keys, medium=self.medium, removed=True, locality=self.locality)
            )
        return events

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        """Wait for every queued and running job (each bounded by ``transfer_timeout_ms``)."""
        self._jobs.drain()

    def shutdown(self) -> None:
        self._jobs.close()
        self._lookups.shutdown()
        self._backend.close()

    # -- metrics ------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingHistogramMetadata

        labels = ("tier",)
        out: dict[str, Any] = {
            name: OffloadingCounterMetadata(documentation=f"lmcache-platform tier: {what}", labelnames=labels)
            for what, name in METRICS.items()
            if what != "job_seconds"
        }
        out[METRICS["job_seconds"]] = OffloadingHistogramMetadata(
            documentation="lmcache-platform tier: seconds a load or store job took",
            labelnames=("tier", "kind"),
        )
        return out

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        counts, latency = self._stats.take()
        if not counts and not any(latency.values()):
            return None
        stats = OffloadingConnectorStats()
        for what, name in METRICS.items():
            if what in counts:
                stats.increase_counter(name, counts[what], (self.tier_type,))
        for kind, samples in latency.items():
            for s in samples:
                stats.observe_histogram(METRICS["job_seconds"], s, (self.tier_type, kind))
        return stats

    def job_latency(self) -> dict[str, float]:
        """p50 and p99 of the jobs since the last :meth:`get_stats` (for benchmarks; does not reset)."""
        with self._stats.lock:
            samples = self._stats.latency["load"] + self._stats.latency["store"]
        return {"p50": percentile(samples, 0.5), "p99": percentile(samples, 0.99)}

    # -- the jobs (the tier's threads) --------------------------------------------------

    def _run(self, job: Job) -> int:
        if job.kind == "store":
            self._backend.store(job.keys, job.rows)
            return len(job.keys)
        return self._backend.load(job.keys, job.rows)


def _flush_seconds(value: object) -> float:
    """``remote_flush_timeout`` (a duration, ``"5s"``, or seconds) as seconds; ``serve``'s default, 5 s."""
    from .._units import parse_duration
    from ..remote import RemoteConfigError

    if value is None:
        return 5.0
    try:
        return parse_duration(value) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise RemoteConfigError(f"secondary tier 'remote_flush_timeout': {exc}") from None


def _open_store(config: dict[str, Any]) -> Any:
    """``serve --remote``'s tier (or chain) from the tier config's ``remote`` and ``remote_*`` keys:
    the same opening (:func:`~lmcache_platform.remote._chain.open_chain`) under the flags' names."""
    from .._units import parse_bytes, parse_duration
    from ..remote import RemoteConfigError, RemoteOptions
    from ..remote._chain import open_chain

    def value(name: str, parse: Any = None) -> Any:
        v = config.get(name)
        try:
            return parse(v) if parse is not None and isinstance(v, str) else v
        except ValueError as exc:
            raise RemoteConfigError(f"secondary tier {name!r}: {exc}") from None

    settings = value("remote_option") or {}
    if isinstance(settings, (list, tuple)):  # "KEY=VALUE" items, as --remote-option takes them
        pairs = [str(item).partition("=") for item in settings]
        if any(not sep or not key.strip() for key, sep, _ in pairs):
            raise RemoteConfigError(
                f"secondary tier 'remote_option': expected KEY=VALUE items, got {settings!r}"
            )
        settings = {key.strip(): v for key, _, v in pairs}
    options = RemoteOptions(
        password_env=value("remote_password_env"),
        password_file=value("remote_password_file"),
        tls_ca_file=value("remote_tls_ca"),
        tls_cert_file=value("remote_tls_cert"),
        tls_key_file=value("remote_tls_key"),
        settings={str(k): str(v) for k, v in dict(settings).items()},
    )
    urls = config["remote"]
    timeout_ms = value("remote_timeout_ms")
    return open_chain(
        [urls] if isinstance(urls, str) else list(urls),
        options,
        key_file=value("remote_key_file"),
        prefix=value("remote_prefix"),
        ttl_s=value("remote_ttl", parse_duration),
        queue_bytes=value("remote_queue_bytes", parse_bytes),
        call_timeout_s=float(timeout_ms) / 1e3 if timeout_ms else None,
    )


__all__ = ["LMCachePlatformTier"]

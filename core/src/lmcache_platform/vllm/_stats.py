"""The connector's counters as vLLM reports them: its "KV Transfer metrics" log line and Prometheus.

Each side counts into a :class:`ConnectorStats`; vLLM collects the workers' every
step (``get_kv_connector_stats``), sums them across ranks and intervals
(:meth:`ConnectorStats.aggregate`), logs :meth:`ConnectorStats.reduce` once per
logging interval, and feeds :class:`ConnectorPromMetrics` for ``/metrics``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: name -> help text. Counts since the last report; seconds are wall time of transfers.
COUNTERS: dict[str, str] = {
    "lookups": "prompts looked up in the server",
    "hit_tokens": "prompt tokens the server supplied instead of a recompute",
    "loads": "asynchronous loads started",
    "loaded_chunks": "chunks written into the engine's blocks",
    "loaded_bytes": "bytes written into the engine's blocks",
    "load_seconds": "time from a load's start to its answer, summed",
    "load_failures": "loads that did not complete (the request was recomputed)",
    "stored_chunks": "chunks the server copied from the engine",
    "stored_bytes": "bytes the server copied from the engine",
    "store_seconds": "time from a store's start to its answer, summed",
    "store_failures": "stores that did not complete (the chunks stay uncached)",
    "skipped_chunks": "chunks not stored because part of their kept KV is gone (sliding window)",
    "deadline_misses": "server requests that missed their deadline",
    "lookup_failures": "lookups the server failed or refused (the prompt was computed)",
    "lookups_unregistered": "lookups answered while a rank had no live registration (no hits offered)",
}


class Counters:
    """One side's counters: totals since start-up (``totals``) and what vLLM has not collected yet."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self._interval = dict.fromkeys(COUNTERS, 0.0)

    def add(self, name: str, amount: float = 1) -> None:
        self.totals[name] += amount
        self._interval[name] += amount

    def take(self) -> ConnectorStats | None:
        """The counts since the last call, for vLLM (``None`` when nothing happened)."""
        if not any(self._interval.values()):
            return None
        out = ConnectorStats(self._interval)
        self._interval = dict.fromkeys(COUNTERS, 0.0)
        return out


class ConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters keyed by :data:`COUNTERS`; vLLM sums them over ranks and steps."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data={k: float((data or {}).get(k, 0)) for k in COUNTERS})

    def reset(self) -> None:
        for k in self.data:
            self.data[k] = 0.0

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if k in self.data:
                self.data[k] += float(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(v) for k, v in self.data.items() if not k.endswith("seconds")}
        for what, moved in (("load", "loaded_bytes"), ("store", "stored_bytes")):
            seconds = self.data[f"{what}_seconds"]
            out[f"{what}_GBps"] = round(self.data[moved] / seconds / 1e9, 3) if seconds > 0 else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ConnectorPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One Prometheus counter per :data:`COUNTERS` entry, ``vllm:lmcache_platform_<name>``, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:lmcache_platform_{name}",
                documentation=f"lmcache-platform: {doc}",
                labelnames=labelnames,
            )
            self._counters[name] = {
                engine: metric.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value:
                per_engine[engine_idx].inc(float(value))

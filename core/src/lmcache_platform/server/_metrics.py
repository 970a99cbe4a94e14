"""The server's counters in the Prometheus text exposition format, over HTTP.

``lmcache-platform serve --metrics-port N`` starts :class:`MetricsServer`: the standard
library's HTTP server on a daemon thread, answering ``GET /metrics`` with
:func:`prometheus_text` of :meth:`ReferenceServer.counters`. No dependency, no state of
its own: each scrape reads the counters afresh. :data:`METRICS` documents every metric,
:data:`REMOTE_METRICS` those of the remote tier (``serve --remote``).
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "lmcache_platform_server_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: metric name (after :data:`PREFIX`) -> (type, counters key, help). ``requests_total``
#: is labelled by ``op`` and comes from the ``requests`` map.
METRICS: dict[str, tuple[str, str, str]] = {
    "uptime_seconds": ("gauge", "uptime_s", "Seconds since the server started."),
    "contexts": ("gauge", "contexts", "Cache contexts registered now."),
    "connections": ("gauge", "connections", "Client connections open now."),
    "namespaces": ("gauge", "namespaces", "Namespaces bound to a KV layout now."),
    "chunks": ("gauge", "chunks", "Chunks held in host memory."),
    "host_bytes": (
        "gauge",
        "host_bytes",
        "Bytes of host memory used by chunks, stores in progress included.",
    ),
    "max_host_bytes": ("gauge", "max_host_bytes", "The host memory cap (--max-host-bytes)."),
    "pinned_chunks": ("gauge", "pinned", "Chunks that cannot be evicted now: being read or leased."),
    "leases": ("gauge", "leases", "Live leases taken by lookups."),
    "lease_pins": ("gauge", "lease_pins", "Chunk pins held by live leases."),
    "lookup_hits_total": (
        "counter",
        "hits",
        "Keys asked by lookups that were found in host memory (leading ones).",
    ),
    "lookup_misses_total": ("counter", "misses", "Keys asked by lookups that were not found in host memory."),
    "chunks_stored_total": ("counter", "stored", "Chunks copied into the server by store and put."),
    "chunks_present_total": ("counter", "present", "Chunks a put skipped: already held or being stored."),
    "chunks_dropped_total": ("counter", "dropped", "Chunks a put dropped: no room could be made."),
    "chunks_retrieved_total": ("counter", "retrieved", "Chunks written into engines by retrieve and get."),
    "evictions_total": ("counter", "evictions", "Chunks evicted to make room."),
    "leases_taken_total": ("counter", "leases_taken", "Leases taken by lookups."),
    "leases_expired_total": (
        "counter",
        "lease_expired",
        "Leases that expired before a get or release ended them.",
    ),
    "deadline_drops_total": ("counter", "deadline_drops", "Requests dropped because their deadline passed."),
    "remote_hits_total": (
        "counter",
        "remote_hits",
        "Lookup hits the remote tier held (beyond the local ones).",
    ),
    "chunks_remote_loaded_total": (
        "counter",
        "remote_loaded",
        "Chunks gets fetched from the remote tier and wrote into engines (kept here when room allowed).",
    ),
    "chunks_missing_total": (
        "counter",
        "get_missing",
        "Chunks gets asked for that neither tier could give (the engine recomputes them).",
    ),
    "errors_total": ("counter", "errors", "Requests answered with an error (deadline drops included)."),
    "refused_total": (
        "counter",
        "refused",
        "Requests refused (an error reply, deadline drops aside), by op.",
    ),
    "lease_unread_chunks_total": (
        "counter",
        "lease_unread_chunks",
        "Chunks leased lookups found that no get read before the lease expired or its connection closed.",
    ),
    "torch_path_contexts_total": (
        "counter",
        "torch_path_contexts",
        "Contexts registered whose transfers take the generic torch path instead of the backend's "
        "kernels (a kernel build that failed, say; status says why).",
    ),
    "host_mapped_bytes": (
        "gauge",
        "host_mapped_bytes",
        "Host memory mapped for chunks: stored, in use, or prepared ahead and idle.",
    ),
    "host_prepared_bytes_total": (
        "counter",
        "host_prepared_bytes",
        "Host memory mapped and faulted in ahead of use, off the request path.",
    ),
    "host_ready_bytes": (
        "gauge",
        "host_ready_bytes",
        "Host memory prepared and free to hand out to the next stores now.",
    ),
    "host_prepare_target_bytes": (
        "gauge",
        "host_prepare_target_bytes",
        "Host memory the server prepares in the background: its bound (eager) or what it keeps ahead.",
    ),
    "host_slow_takes_total": (
        "counter",
        "host_slow_takes",
        "Chunk buffers mapped on a request's path because no prepared one was free.",
    ),
    "host_registered_bytes_total": (
        "counter",
        "host_registered_bytes",
        "Host memory registered with a device for its copies (once per mapping).",
    ),
    "host_register_failures_total": (
        "counter",
        "host_register_failures",
        "Chunk mappings a device refused to register: their copies run from pageable memory.",
    ),
    "host_kept_mapped_total": (
        "counter",
        "host_kept_mapped",
        "Chunk mappings kept mapped for good because ending their device registration failed.",
    ),
    "first_register_seconds": (
        "gauge",
        "first_register_s",
        "Seconds from listening to the first registration (engines back after a start); absent before.",
    ),
    "first_hit_seconds": (
        "gauge",
        "first_hit_s",
        "Seconds from listening to the first lookup that found chunks; absent before.",
    ),
    "requests_total": ("counter", "requests", "Requests received, by op."),
}


#: The remote tier's metrics, from ``counters["remote"]`` (``RemoteTier.stats``), named
#: after :data:`PREFIX` + ``remote_``: name -> (type, stats key, help). The keys of
#: :data:`_REMOTE_LABELLED` become one labelled metric each.
REMOTE_METRICS: dict[str, tuple[str, str, str]] = {
    "queue_entries": ("gauge", "queue_entries", "Chunks waiting in the write-behind queue."),
    "queue_bytes": ("gauge", "queue_bytes", "Bytes waiting in the write-behind queue."),
    "lookups_total": ("counter", "lookups", "Lookups that asked the remote store."),
    "hits_total": ("counter", "hits", "Chunks lookups found in the store (leading runs, per namespace)."),
    "misses_total": ("counter", "misses", "Chunks lookups asked the store for and it did not hold."),
    "fetched_total": ("counter", "fetched", "Chunks fetched from the store and accepted."),
    "fetch_misses_total": ("counter", "fetch_misses", "Chunks fetched that the store no longer held."),
    "fetched_bytes_total": ("counter", "bytes_fetched", "Bytes of the chunks fetched and accepted."),
    "queued_total": ("counter", "queued", "Chunks queued for writing to the store."),
    "written_total": ("counter", "written", "Chunks written to the store."),
    "written_bytes_total": ("counter", "bytes_written", "Bytes of the entries written to the store."),
    "write_errors_total": (
        "counter",
        "write_errors",
        "Chunks the store refused to take (memory or disk full, node down) or that could not be encoded.",
    ),
    "encode_errors_total": (
        "counter",
        "encode_errors",
        "Chunks that could not be made entries (lost writes).",
    ),
    "fetched_v1_total": ("counter", "fetched_v1", "Chunks fetched in the previous entry format (BLAKE2b)."),
    "errors_total": ("counter", "errors", "Failed store calls, or failed items of a batch."),
    "timeouts_total": ("counter", "timeouts", "Store calls that passed their deadline."),
    "slow_total": ("counter", "slow", "Timeouts after which the store still answered a ping."),
    "skipped_total": ("counter", "skipped", "Store calls not made because the store was down."),
    "deadline_passed_total": ("counter", "deadline_passed", "Store calls not made: the request was late."),
    "state_changes_total": ("counter", "state_changes", "Changes of the tier's state (healthy, down...)."),
    "removed_refused_total": ("counter", "removed_refused", "Refused entries deleted from the store."),
}
#: prefix of stats keys -> (metric, label, help): ``refused_<reason>``, ``dropped_<why>``.
_REMOTE_LABELLED = {
    "refused_": ("refused_total", "reason", "Entries refused and never loaded, by reason."),
    "dropped_": (
        "dropped_total",
        "reason",
        "Chunks not written: the queue was full, the store down or degraded.",
    ),
}


def prometheus_text(counters: Mapping[str, Any]) -> str:
    """Every metric of :data:`METRICS` (and :data:`REMOTE_METRICS`) present in ``counters``."""
    lines: list[str] = []
    for name, (kind, key, help_text) in METRICS.items():
        if key not in counters:
            continue
        full = PREFIX + name
        lines += _head(full, help_text, kind)
        value = counters[key]
        if isinstance(value, Mapping):
            lines += [f'{full}{{op="{_label(op)}"}} {_number(n)}' for op, n in sorted(value.items())]
        else:
            lines.append(f"{full} {_number(value)}")
    if "device_failed" in counters:  # a reason or None: the metric says whether
        full = PREFIX + "device_failed"
        lines += _head(
            full, "1 once a device failed for good (a sticky CUDA error): the server stops.", "gauge"
        )
        lines.append(f"{full} {int(counters['device_failed'] is not None)}")
    remote = counters.get("remote")
    if isinstance(remote, Mapping):
        lines += _remote_lines(remote)
    return "\n".join(lines) + "\n"


def _remote_lines(stats: Mapping[str, Any]) -> list[str]:
    full = PREFIX + "remote_up"
    lines = _head(
        full, "1 while the remote store is healthy, else 0 (connecting, degraded, down, closed).", "gauge"
    )
    lines.append(f'{full}{{store="{_label(stats.get("store", ""))}"}} {int(stats.get("state") == "healthy")}')
    for name, (kind, key, help_text) in REMOTE_METRICS.items():
        if key in stats:
            full = PREFIX + "remote_" + name
            lines += [*_head(full, help_text, kind), f"{full} {_number(stats[key])}"]
    for prefix, (name, label, help_text) in _REMOTE_LABELLED.items():
        values = sorted((k.removeprefix(prefix), v) for k, v in stats.items() if k.startswith(prefix))
        if values:
            full = PREFIX + "remote_" + name
            lines += _head(full, help_text, "counter")
            lines += [f'{full}{{{label}="{_label(why)}"}} {_number(v)}' for why, v in values]
    tiers = stats.get("tiers")
    if isinstance(tiers, list):  # a chain: the sums above, and each tier on its own
        lines += _tier_lines(tiers)
    return lines


def _tier_lines(tiers: list[Mapping[str, Any]]) -> list[str]:
    """``remote_tier_*{tier="0",store="..."}``: each tier of a chain (``serve --remote`` repeated)."""
    labels = [f'tier="{i}",store="{_label(t.get("store", ""))}"' for i, t in enumerate(tiers)]
    full = PREFIX + "remote_tier_up"
    lines = _head(full, "1 while this tier's store is healthy, else 0.", "gauge")
    lines += [
        f"{full}{{{lab}}} {int(t.get('state') == 'healthy')}" for lab, t in zip(labels, tiers, strict=True)
    ]
    for name, (kind, key, help_text) in REMOTE_METRICS.items():
        full = PREFIX + "remote_tier_" + name
        rows = [
            f"{full}{{{lab}}} {_number(t[key])}" for lab, t in zip(labels, tiers, strict=True) if key in t
        ]
        if rows:
            lines += [*_head(full, f"{help_text} (per tier)", kind), *rows]
    return lines


def _head(full: str, help_text: str, kind: str) -> list[str]:
    """A metric's ``# HELP`` and ``# TYPE`` lines."""
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]


def _number(value: Any) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MetricsServer:
    """``GET /metrics`` on ``host:port`` (port 0: any free port, see :attr:`port`), on a daemon thread."""

    def __init__(
        self, counters: Callable[[], Mapping[str, Any]], host: str = "127.0.0.1", port: int = 0
    ) -> None:
        handler = _handler(counters)
        self._httpd = http.server.ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="lmcache-metrics",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._thread.join()
        self._httpd.server_close()


def _handler(counters: Callable[[], Mapping[str, Any]]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body = prometheus_text(counters()).encode()
            except Exception as exc:  # never take the server down for a scrape
                logger.exception("metrics scrape failed")
                self.send_error(500, f"{type(exc).__name__}")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("metrics: " + format, *args)

    return Handler

"""vLLM integration: a KV connector that keeps prefix KV in an lmcache-platform server.

Load it by module path (see ``docs/vllm.md``)::

    KVTransferConfig(
        kv_connector="LMCachePlatformConnector",
        kv_connector_module_path="lmcache_platform.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"socket": "/run/lmcache/server.sock"},
    )

KV that one engine computed is stored in the server (``lmcache-platform serve``) in
whole chunks; another engine with the same model and configuration, or the same one
after a restart, loads those chunks into the blocks vLLM allocated instead of
recomputing them. The server reads and writes the engine's memory directly (shared
memory on CPU, CUDA IPC on GPUs): only block ids and keys cross the socket.

What is shared is what vLLM's own prefix cache would share: chunk keys come from
vLLM's block hashes, which cover the cache salt, the LoRA adapter, multimodal
inputs and prompt embeddings (:mod:`._identity`). The connector is two objects,
one per role: the scheduler's (:class:`._scheduler.SchedulerSide`: lookups, what
to load and store, which blocks are in transfer) and each worker's
(:class:`._worker.WorkerSide`: the transfers themselves). Neither ever waits on the
server: requests are sent by a background thread and answered on a later step;
every request carries a deadline; a hung, dead or refusing server costs no request
its answer (a failed load is recomputed) and the engine at most one deadline per
change of the server's state.

Extra-config keys (``kv_connector_extra_config``): ``socket`` (else the environment
variable ``LMCACHE_PLATFORM_SOCKET``), ``tokens_per_chunk`` (256), ``model_id``
(default: vLLM's model and revision), ``lookup_deadline_ms`` (1000),
``transfer_deadline_ms`` (5000), ``lease_ms`` (30000), ``cuda_ipc`` (``auto``: the CUDA IPC kind,
else ``$LMCACHE_PLATFORM_CUDA_IPC``).

``kv_role`` is followed: ``kv_producer`` (a prefill instance) only stores,
``kv_consumer`` (a decode instance) only loads, ``kv_both`` does both. With vLLM's
KV-event publisher on, :meth:`LMCachePlatformConnector.take_events` reports the chunks
the server holds for this engine and those it evicted (medium ``"CPU"``).

``import lmcache_platform`` never imports this module or vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ._identity import cache_namespace_for, registration_config
from ._scheduler import SchedulerSide
from ._settings import Settings
from ._stats import ConnectorPromMetrics, ConnectorStats
from ._worker import WorkerSide

__all__ = ["LMCachePlatformConnector", "cache_namespace_for", "registration_config"]


class LMCachePlatformConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Keeps whole prompt chunks of KV in an lmcache-platform server (see the module docs)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = Settings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, kv_cache_config, settings)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, settings)

    @property
    def stats(self) -> dict[str, float]:
        """This side's counters since start-up (see ``_stats.COUNTERS``)."""
        side = self.scheduler or self.worker
        assert side is not None
        return side.stats.totals

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is a future miss, never a reason to recompute."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """How the server reaches the KV cache, which decides how vLLM (0.33+) allocates it.

        On CUDA the server imports the memory in its own process: with the VMM IPC kind
        (the default, ``cuda_ipc`` ``auto`` or ``vmm``) through POSIX file descriptors,
        so vLLM's extensible cache is created with exportable handles (``EXPORTS_FD``);
        with a legacy kind (``torch``, ``raw``) through legacy CUDA IPC, which turns the
        extensible cache off (``LEGACY_IPC``). Elsewhere (CPU) the memory is shared by
        host means and any allocation works (``IN_PROCESS``).
        """
        from vllm.config.kv_transfer import KVCacheAccess
        from vllm.platforms import current_platform

        if not current_platform.is_cuda_alike():
            return KVCacheAccess.IN_PROCESS
        settings = Settings.from_extra(getattr(kv_transfer_config, "kv_connector_extra_config", None))
        return KVCacheAccess.LEGACY_IPC if settings.legacy_ipc else KVCacheAccess.EXPORTS_FD

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Sleep mode and weight updates are followed: see :meth:`unregister_kv_caches`."""
        return True

    # -- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV cache's memory: the server drops every mapping of it."""
        if self.worker is not None:
            self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After vLLM mapped memory again: registered afresh; stored chunks are still there."""
        if self.worker is not None:
            self.worker.restore_kv_caches()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and whole-request: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Chunks are stored whole, after the step (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        finished, failed = self.worker.transfer_results(self._connector_metadata)
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.report() if self.worker is not None else None

    def get_kv_connector_stats(self) -> ConnectorStats | None:
        side = self.scheduler or self.worker
        return side.stats.take() if side is not None else None

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.shutdown()

    # -- scheduler side -----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self.scheduler is not None
        self.scheduler.bind(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Any) -> bool:
        """True once the request's lookup found chunks to load (answered; no socket call)."""
        return self.scheduler is not None and self.scheduler.may_load_async(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def take_events(self) -> list[Any]:
        """Chunks stored in the server and evicted from it, for routers (medium ``"CPU"``)."""
        return self.scheduler.take_events() if self.scheduler is not None else []

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ConnectorStats:
        return ConnectorStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ConnectorPromMetrics:
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

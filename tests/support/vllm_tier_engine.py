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

Spec keys: ``engine_id``, ``model``, ``chunks``, ``chunk_bytes`` (per worker), ``world``
(workers, 1), ``agnostic``, ``tiers`` (vLLM's ``secondary_tiers``), ``timeout_s`` (60),
and ``phases``, each run in turn in this one process (or the spec itself as the only
phase): ``mode`` (store | load | both), ``seed``, ``wait_file`` (wait, stepping, until it
exists), ``settle_s`` (then keep stepping that long), ``ready_file`` (written once the store phase settled), ``hold_s`` (keep stepping
that long after a store: a fault injected meanwhile lands mid-jobs), ``drain`` (call
``drain_jobs`` with the cascade in flight). The test judges the printed report.
"""

from __future__ import annotations

import hashlib
import json
import os
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


#: Keys the tiers reported through take_events: stored and removed.
EVENTS = {"stored": 0, "removed": 0}


def step_until(mgr: Any, done: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mgr.on_schedule_end(STEP)
        for tier in mgr.secondary_tiers:  # what vLLM's KV-event publisher would take
            for event in tier.take_events():
                EVENTS["removed" if event.removed else "stored"] += len(event.keys)
        if done():
            return True
        time.sleep(0.001)
    return False


def store(
    mgr: Any, view: Any, hashes: list[bytes], keys: list[Any], phase: dict[str, Any], out: dict[str, Any]
) -> None:
    req = ReqContext(req_id=f"store-{phase.get('seed', 0)}")
    mgr.on_new_request(req)
    prepared = mgr.prepare_store(keys, req)
    rows = [int(r) for r in prepared.store_spec.block_ids]
    for h, r in zip(hashes, rows, strict=True):  # the GPU worker's copies: not timed
        view[r, :] = payload(h, view.shape[1])
    t = time.monotonic()  # from vLLM's cascade to every tier's job reported
    mgr.complete_store(keys, req)
    mgr.on_request_finished(req)
    if phase.get("drain"):  # vLLM's reset_cache path: drain_jobs with the cascade in flight
        mgr.on_schedule_end(STEP)  # the cascade's jobs are submitted here
        tiers = mgr.secondary_tiers
        out["in_flight_before_drain"] = sum(t._jobs.in_flight() for t in tiers)
        for tier in tiers:
            tier.drain_jobs()
        out["in_flight_after_drain"] = sum(t._jobs.in_flight() for t in tiers)
        out["finished_after_drain"] = sum(len(t._jobs._finished) for t in tiers)
    if phase.get("hold_s"):
        step_until(mgr, lambda: False, float(phase["hold_s"]))
    out["store_settled"] = step_until(
        mgr, lambda: not mgr.has_pending_work(), float(phase.get("timeout_s", 60))
    )
    out["store_s"] = time.monotonic() - t


def load(
    mgr: Any, view: Any, hashes: list[bytes], keys: list[Any], phase: dict[str, Any], out: dict[str, Any]
) -> None:
    req = ReqContext(req_id=f"load-{phase.get('seed', 0)}")
    mgr.on_new_request(req)
    t = time.monotonic()
    results: dict[int, Any] = {}

    def all_known() -> bool:
        for i, k in enumerate(keys):
            if results.get(i) not in (LookupResult.HIT, LookupResult.MISS):
                results[i] = mgr.lookup(k, req)
        return all(r in (LookupResult.HIT, LookupResult.MISS) for r in results.values())

    out["load_settled"] = step_until(mgr, all_known, float(phase.get("timeout_s", 60)))
    hits = [i for i, r in results.items() if r is LookupResult.HIT]
    out["load_s"] = time.monotonic() - t
    out["hits"] = len(hits)
    out["states"] = sorted({str(r) for r in results.values()})
    good = bad = 0
    if hits:
        hit_keys = [keys[i] for i in hits]
        load_spec = mgr.prepare_load(hit_keys, req)
        for i, r in zip(hits, load_spec.block_ids, strict=True):
            if np.array_equal(view[int(r)], payload(hashes[i], view.shape[1])):
                good += 1
            else:
                bad += 1
        mgr.complete_load(hit_keys, req)
    out["identical"], out["wrong"] = good, bad
    mgr.on_request_finished(req)


def prometheus(tier: Any) -> dict[str, float]:
    """The tier's ``get_stats`` as vLLM's exporter gets it: each metric summed over its labels."""
    stats = tier.get_stats()
    if stats is None:
        return {}
    out: dict[str, float] = {}
    for name, by_label in stats.data["data"].items():
        values = by_label.values()
        out[name] = sum(sum(v) if isinstance(v, list) else v for v in values)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    t0 = time.monotonic()
    mgr = TieringOffloadingSpec(config(spec)).get_manager()
    timers = [Timer(t) for t in mgr.secondary_tiers]
    view = np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8)
    report: dict[str, Any] = {
        "rows": int(view.shape[0]),
        "row_bytes": int(view.shape[1]),
        "start_s": time.monotonic() - t0,
    }
    phases = spec.get("phases") or [spec]
    report["phases"] = []
    for phase in phases:
        out: dict[str, Any] = {}
        if phase.get("wait_file"):
            deadline = time.monotonic() + 120
            while not os.path.exists(phase["wait_file"]) and time.monotonic() < deadline:
                mgr.on_schedule_end(STEP)
                time.sleep(0.01)
        if phase.get("settle_s"):
            step_until(mgr, lambda: False, float(phase["settle_s"]))
        hashes = [
            chunk_hash(int(phase.get("seed", spec.get("seed", 0))), i) for i in range(int(spec["chunks"]))
        ]
        keys = [make_offload_key(h, 0) for h in hashes]
        if phase["mode"] in ("store", "both"):
            store(mgr, view, hashes, keys, phase, out)
        if phase.get("ready_file"):
            with open(phase["ready_file"], "w") as f:
                f.write("stored")
        if phase["mode"] in ("load", "both"):
            load(mgr, view, hashes, keys, phase, out)
        report["phases"].append(out)
    step_until(mgr, lambda: not mgr.has_pending_work(), float(spec.get("timeout_s", 60)))
    report["tier_calls"] = [t.summary() for t in timers]
    report["stats"] = [dict(t._stats.counts) for t in mgr.secondary_tiers if hasattr(t, "_stats")]
    report["events"] = EVENTS
    report["prometheus"] = [prometheus(t) for t in mgr.secondary_tiers]
    report["job_s"] = [
        {k: sum(v) for k, v in t._stats.latency.items()} for t in mgr.secondary_tiers if hasattr(t, "_stats")
    ]
    report["last_error"] = [t._jobs.last_error for t in mgr.secondary_tiers if hasattr(t, "_jobs")]
    del view  # vLLM unmaps the region at shutdown: no export of it may be left
    mgr.shutdown()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

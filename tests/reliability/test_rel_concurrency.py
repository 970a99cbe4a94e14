"""Case 5: concurrency. First resolution, transfers on one context, fork, spawn.

Locking, as implemented (and documented in docs/reliability.md):

* the registry holds one re-entrant lock around the metadata scan and each device
  type's first resolution; later lookups are a lock-free dict read;
* a cache context serializes ``store_chunk``, ``retrieve_chunk`` and
  ``stage_block_ids`` with one lock per context (they share the staged block-id
  buffer); validation runs outside it. Staging slots are the caller's: two threads
  must not use one slot at once;
* the CPU backend keeps a lock per process around its segment tables, re-created
  in a forked child, whose table starts empty.

Thread races are made likelier with a tiny ``sys.setswitchinterval``.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import importlib_metadata
import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import KVFormat, LayoutHints, TransferError, wire
from lmcache_platform._plugins.registry import REGISTRY, selected_backend, wire_classes_for
from lmcache_platform_cpu import CpuShmIPCWrapper
from support.reliability import SHM_DIR, Workers, emit

WORKERS = 2


@pytest.fixture
def switch_often() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def race(n: int, work: Callable[[int], Any]) -> tuple[list[Any], list[BaseException]]:
    """Run ``work(i)`` in ``n`` threads released together; return results and errors."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as exc:  # collected and asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


# -- first resolution ------------------------------------------------------------------------


def test_64_threads_racing_the_first_resolution_scan_once(
    lmcache_registry: Any, monkeypatch: pytest.MonkeyPatch, switch_often: None, request: pytest.FixtureRequest
) -> None:
    """Real installed metadata (the editable cpu, cpu.file and cuda backends), four entry points."""
    scans: list[int] = []
    loads: list[str] = []
    real_scan, real_load = importlib_metadata.distributions, importlib_metadata.EntryPoint.load

    def counting_scan(**kw: Any) -> Any:
        scans.append(1)
        return real_scan(**kw)

    monkeypatch.setattr(importlib_metadata, "distributions", counting_scan)

    def counting_load(ep: importlib_metadata.EntryPoint) -> Any:
        loads.append(ep.name)
        return real_load(ep)

    monkeypatch.setattr(importlib_metadata.EntryPoint, "load", counting_load)
    lmcache_registry.rescan()
    calls = [lp.get_kv_wrapper_factory, REGISTRY.cache_context_class, wire_classes_for, selected_backend]
    results, errors = race(64, lambda i: calls[i % 4]("cpu"))
    assert errors == []
    assert len(scans) == 1, "metadata was read more than once"
    # The usable primary cpu wins without importing its variant cpu.file (the selection rule).
    assert loads == ["cpu"], "a backend was imported twice, or cpu.file or cuda was imported"
    assert len({id(r) for r in results[0::4]}) == 1 and results[0].__self__ is CpuShmIPCWrapper
    assert {r.name for r in results[3::4]} == {"cpu"}
    emit(
        request, "5 first resolution", f"64 threads: {len(scans)} metadata scan, entry points loaded {loads}"
    )


# -- one context, many threads -----------------------------------------------------------------

LAYERS, BLOCKS, BLOCK, HEADS, HEAD, CHUNK = 4, 48, 4, 2, 16, 8
HINTS = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=BLOCK, num_kv_heads=HEADS)


@pytest.fixture
def engine_and_context() -> Iterator[tuple[list[torch.Tensor], lp.BaseCacheContext]]:
    """Engine tensors in shared memory, and a context built on their reopened descriptors."""
    tensors = [torch.zeros(2, BLOCKS, BLOCK, HEADS, HEAD, dtype=torch.float16) for _ in range(LAYERS)]
    wrappers = lp.wrap_kv_caches(tensors)
    reopened = [CpuShmIPCWrapper.from_fields(w.fields()) for w in wrappers]
    ctx = lp.create_cache_context(reopened, lmcache_tokens_per_chunk=CHUNK, layout_hints=HINTS)
    yield tensors, ctx
    ctx.close()
    for w in wrappers:
        w.close()


def test_concurrent_store_and_retrieve_on_one_context_are_bit_exact(
    engine_and_context: tuple[list[torch.Tensor], lp.BaseCacheContext],
    switch_often: None,
    request: pytest.FixtureRequest,
) -> None:
    """One thread per staging slot, each storing fresh bytes and retrieving them elsewhere."""
    tensors, ctx = engine_and_context
    rounds, per_chunk = 60, CHUNK // BLOCK
    n = ctx.max_batch_size

    def worker(slot: int) -> int:
        gen = torch.Generator().manual_seed(slot)
        bad = 0
        for r in range(rounds):
            src = [slot * 8 + (2 * r) % 8 + b for b in range(per_chunk)]  # blocks 0..8n-1
            dst = [8 * n + slot * 4 + (r % 2) * 2 + b for b in range(per_chunk)]  # above them
            for t in tensors:
                t[:, src] = torch.randint(
                    -(2**15), 2**15, t[:, src].shape, dtype=torch.int16, generator=gen
                ).view(torch.float16)
            want = [t[:, src].clone() for t in tensors]
            ctx.store_chunk([src], slot=slot)
            for t in tensors:
                t[:, dst] = 0
            ctx.retrieve_chunk([dst], slot=slot)
            bad += sum(
                not torch.equal(t[:, dst].view(torch.int16), w.view(torch.int16))
                for t, w in zip(tensors, want, strict=True)
            )
        return bad

    results, errors = race(n, worker)
    assert errors == []
    assert results == [0] * n, f"mismatched layer copies per thread: {results}"
    emit(
        request,
        "5 concurrent transfers",
        f"{n} threads x {rounds} store+retrieve rounds on one context: 0 mismatched bytes",
    )


def test_transfers_on_a_closed_context_are_refused(
    engine_and_context: tuple[list[torch.Tensor], lp.BaseCacheContext],
) -> None:
    _, ctx = engine_and_context
    ctx.close()
    for call in (
        lambda: ctx.store_chunk([[0, 1]]),
        lambda: ctx.retrieve_chunk([[2, 3]]),
        lambda: ctx.stage_block_ids([[0]]),
    ):
        with pytest.raises(TransferError, match="closed"):
            call()


@pytest.mark.parametrize("op", ["store_chunk", "retrieve_chunk"])
def test_a_transfer_racing_close_is_refused_with_transfer_error(
    engine_and_context: tuple[list[torch.Tensor], lp.BaseCacheContext],
    monkeypatch: pytest.MonkeyPatch,
    op: str,
) -> None:
    """Deterministic: close() runs right after the request was validated, before the lock."""
    _, ctx = engine_and_context
    validate = ctx._planner.check  # the step between the open check and the lock

    def validate_then_close(*args: Any, **kwargs: Any) -> Any:
        plan = validate(*args, **kwargs)
        threading.Thread(target=ctx.close).start()  # another thread closes...
        while not ctx.closed:  # ...and has won by the time this one takes the lock
            pass
        return plan

    monkeypatch.setattr(ctx._planner, "check", validate_then_close)
    with pytest.raises(TransferError, match="closed"):
        getattr(ctx, op)([[4, 5]])


# -- fork ---------------------------------------------------------------------------------------


def test_a_fork_after_wrap_never_unlinks_in_the_child(
    engine_and_context: tuple[list[torch.Tensor], lp.BaseCacheContext],
) -> None:
    """The child (and a grandchild) runs every cleanup path there is; the parent loses nothing.

    The process is both a producer (it wrapped the engine tensors) and a consumer (the
    context reopened them). The child writes through the shared mapping, closes the
    context, drops every tensor, exports a segment of its own, and runs its atexit
    handlers; a grandchild does the same. The parent then finds every segment, sees
    the child's write, and the child's own segment gone.
    """
    tensors, ctx = engine_and_context
    names = [w.shm_name for w in ctx.kv_caches]  # type: ignore[attr-defined]
    read, write = os.pipe()

    def cleanup_everything(depth: int) -> None:
        tensors[0][0, 0, 0, 0, 0] = float(depth + 1)  # visible to the parent: MAP_SHARED
        if depth == 0:  # a grandchild, forked from the child before the child cleans up
            pid = os.fork()
            if pid == 0:
                os._exit(run_child(1))
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError("grandchild failed")
        ctx.close()
        own = CpuShmIPCWrapper.wrap(torch.ones(64))
        os.write(write, (json.dumps({"depth": depth, "own": own.shm_name}) + "\n").encode())
        tensors.clear()
        gc.collect()
        atexit._run_exitfuncs()  # what a normal exit runs, in full

    def run_child(depth: int) -> int:
        try:
            cleanup_everything(depth)
            return 0
        except BaseException:
            import traceback

            traceback.print_exc()
            return 1

    pid = os.fork()
    if pid == 0:
        os._exit(run_child(0))
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        reports = [json.loads(line) for line in f]
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(r["depth"] for r in reports) == [0, 1]
    for name in names:
        assert os.path.exists(os.path.join(SHM_DIR, name)), f"a child unlinked {name}"
    for r in reports:  # each child's own export died with it
        assert not os.path.exists(os.path.join(SHM_DIR, r["own"]))
    assert tensors[0][0, 0, 0, 0, 0].item() == 2.0  # the grandchild wrote last
    again = CpuShmIPCWrapper.from_fields(ctx.kv_caches[0].fields())
    assert torch.equal(again.to_tensor(), tensors[0])
    again.close()
    assert not ctx.closed  # the parent's context is untouched by the child's close()


# -- spawn --------------------------------------------------------------------------------------


def test_spawned_workers_each_resolve_on_their_own(
    child_pids: set[int], request: pytest.FixtureRequest
) -> None:
    """Each child starts with nothing loaded, scans metadata once, and decodes with its own allow-list."""
    from lmcache_platform.testing import fake_backend
    from support.fakes import context_class, wrapper_class
    from support.reliability_workers import resolve_worker

    tensors = [torch.arange(256, dtype=torch.float32) * (i + 1) for i in range(3)]
    wrappers = lp.wrap_kv_caches(tensors)
    checksum = float(sum(t.double().sum().item() for t in tensors))
    lp.register_backend(
        fake_backend(
            "relworker", context_class=context_class("relworker"), wrapper_class=wrapper_class("relworker")
        ),
        "relworker",
    )
    try:
        with Workers(resolve_worker, [(wire.encode(wrappers), checksum)] * WORKERS, child_pids) as workers:
            reports = workers.gather(120)
            workers.join()
    finally:
        lp.unregister_backend("relworker")
        for w in wrappers:
            w.close()
    assert len({r["pid"] for r in reports}) == WORKERS and os.getpid() not in {r["pid"] for r in reports}
    for r in reports:
        assert r["backend_module_loaded"] is False and r["torch_loaded"] is False
        assert r["scans"] == 1
        assert r["backend"] == ["cpu", "lmcache-platform-cpu"]
        assert r["checksum_ok"] is True
        assert r["parent_state_leaked"] is False
    emit(
        request,
        "5 spawned workers",
        f"{WORKERS} spawned workers: each started with no backend loaded, "
        "scanned metadata once and reopened the parent's wrappers bit-exact",
    )

"""Case 4: resource leaks, killed producers, a killed server.

Figures come from the kernel (``/proc/<pid>/fd``, ``/proc/<pid>/maps``,
``/proc/<pid>/statm``, ``/dev/shm``), taken after a warm-up (first-use allocations
of torch and of the allocator are not leaks) and after a ``gc.collect()``. Flat
means: the same number of fds, /dev/shm entries and /dev/shm mappings, and RSS
within ``RSS_SLACK``, far below what one leaked segment per cycle would add
(each cycle moves at least 16 KiB through a fresh segment, so 10,000 leaked
segments would be 160 MiB).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import KVFormat, LayoutHints, ServerError, wire
from lmcache_platform.server import ServerClient, ServerProcess
from lmcache_platform_cpu import CpuShmIPCWrapper
from support import commands
from support.reliability import SHM_DIR, Resources, Workers, describe, emit, mappings_of, sized

RSS_SLACK = 16 << 20
WRAP_CYCLES = sized(10_000, 100_000)
CONSUMER_CYCLES = sized(300, 3_000)
CONTEXT_CYCLES = sized(1_000, 10_000)
WARMUP = 100


def flat(before: Resources, after: Resources) -> None:
    d = before.delta(after)
    assert (d["fds"], d["shm_entries"], d["shm_maps"]) == (0, 0, 0), describe(before, after)
    assert d["rss"] < RSS_SLACK, describe(before, after)


def settled() -> Resources:
    gc.collect()
    return Resources.of()


# -- wrap, reopen, close -------------------------------------------------------------------------


def _cycle(i: int, wrap: Any) -> None:
    """One engine wrap, one server reopen, both closed; three tensor shapes in turn."""
    kind = i % 3
    if kind == 0:  # one layer
        tensors = [torch.full((4096,), float(i))]
    elif kind == 1:  # two layers that are views of one allocation (vLLM hybrid models)
        whole = torch.full((2, 2048), float(i), dtype=torch.float64)
        tensors = list(whole.unbind(0))
    else:  # a strided view at an offset
        tensors = [torch.full((64, 130), float(i), dtype=torch.bfloat16)[3:, 1:129]]
    wrappers = [wrap(t) for t in tensors]
    reopened = [CpuShmIPCWrapper.from_fields(w.fields()) for w in wrappers]
    views = [r.to_tensor() for r in reopened]
    assert all(torch.equal(v, t) for v, t in zip(views, tensors, strict=True))
    del views
    for r in reopened:
        r.close()
    for w in wrappers:
        w.close()


def test_10k_wrap_reopen_close_cycles_stay_flat(request: pytest.FixtureRequest) -> None:
    wrap = lp.get_kv_wrapper_factory("cpu")
    for i in range(WARMUP):
        _cycle(i, wrap)
    before = settled()
    for i in range(WRAP_CYCLES):
        _cycle(i, wrap)
    after = settled()
    flat(before, after)
    emit(
        request,
        "4 wrap/reopen/close",
        f"{WRAP_CYCLES:,} cycles in process: {describe(before, after)}",
        **before.delta(after),
    )


def test_a_spawned_consumer_reopening_hundreds_of_models_stays_flat(
    child_pids: set[int], request: pytest.FixtureRequest
) -> None:
    """The consumer is another process, as in production; both sides' figures are checked."""
    from support.reliability_workers import reopen_consumer

    with Workers(reopen_consumer, [()], child_pids) as consumer:
        channel = commands.PipeChannel(consumer.conns[0])

        def ask(op: str, **args: Any) -> Any:
            return commands.request(channel, op, args, timeout=120)  # a hang guard

        def one(i: int) -> None:
            tensors = [
                torch.full((2, 16, 4, 2, 8), float(i + layer), dtype=torch.float16) for layer in range(2)
            ]
            wrappers = lp.wrap_kv_caches(tensors)
            got = ask("reopen", data=wire.encode(wrappers).hex())["checksum"]
            assert got == float(sum(t.double().sum().item() for t in tensors))
            for w in wrappers:
                w.close()

        assert consumer.gather() == [{"ready": True}]
        for i in range(20):
            one(i)
        ask("mark")
        before = settled()
        for i in range(CONSUMER_CYCLES):
            one(i)
        ask("mark")
        after = settled()
        report = ask("exit")
        consumer.join()
    flat(before, after)  # the producer: this process
    c_before, c_after = (Resources(**report["marks"][k]) for k in sorted(report["marks"], key=int))
    flat(c_before, c_after)  # the consumer
    emit(
        request,
        "4 spawned consumer",
        f"{CONSUMER_CYCLES} models reopened in a spawned consumer: "
        f"producer {describe(before, after)}; consumer {describe(c_before, c_after)}",
    )


# -- context create and close ------------------------------------------------------------------

HINTS = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=4, num_kv_heads=2)


@pytest.fixture
def engine() -> Iterator[tuple[list[torch.Tensor], list[lp.DeviceIPCWrapper]]]:
    tensors = [torch.randn(2, 16, 4, 2, 16).to(torch.float16) for _ in range(4)]
    wrappers = lp.wrap_kv_caches(tensors)
    yield tensors, wrappers
    for w in wrappers:
        w.close()


def test_1000_context_create_close_cycles_stay_flat(
    engine: tuple[list[torch.Tensor], list[lp.DeviceIPCWrapper]], request: pytest.FixtureRequest
) -> None:
    """Each cycle reopens the layers, builds a context, moves one chunk out and back, closes."""
    tensors, wrappers = engine
    expected = [t.clone() for t in tensors]

    def cycle() -> None:
        reopened = [CpuShmIPCWrapper.from_fields(w.fields()) for w in wrappers]
        ctx = lp.create_cache_context(reopened, lmcache_tokens_per_chunk=8, layout_hints=HINTS)
        ctx.store_chunk([[0, 1]], slot=0)
        ctx.retrieve_chunk([[0, 1]], slot=0)  # the same blocks: contents must not change
        ctx.close()
        assert all(r.closed for r in reopened)

    for _ in range(20):
        cycle()
    before = settled()
    for _ in range(CONTEXT_CYCLES):
        cycle()
    after = settled()
    flat(before, after)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))
    emit(
        request,
        "4 context create/close",
        f"{CONTEXT_CYCLES:,} contexts: {describe(before, after)}",
        **before.delta(after),
    )


# -- a producer killed with SIGKILL ---------------------------------------------------------------


#: The gc scenario, in its own process: a producer wraps a model and is SIGKILLed while this
#: test maps its segments; then `lmcache-platform gc` (dry run) and `gc --yes` run. The
#: scenario's process keeps a live segment of its own, which gc must leave alone.
GC_SCENARIO = textwrap.dedent("""
    import json, os, subprocess, sys
    import torch
    from lmcache_platform_cpu import CpuShmIPCWrapper

    PRODUCER = "; ".join([
        "import json, time, torch, lmcache_platform as lp",
        "ts = [torch.full((2, 16, 4, 2, 8), float(i), dtype=torch.float16) for i in range(6)]",
        "print(json.dumps([w.shm_name for w in lp.wrap_kv_caches(ts)]), flush=True)",
        "time.sleep(600)",
    ])

    def gc(*args):
        env = {**os.environ, "LMCACHE_PLATFORM_DISABLE": "cuda"}  # its probe imports torch; not under test
        return subprocess.run([sys.executable, "-m", "lmcache_platform._cli", "gc", *args],
                              capture_output=True, text=True, env=env, timeout=120)

    def present(names):
        return [n for n in names if os.path.exists("/dev/shm/" + n)]

    kept = torch.ones(256)
    live = CpuShmIPCWrapper.wrap(kept).shm_name
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER], stdout=subprocess.PIPE, text=True)
    names = json.loads(producer.stdout.readline())
    print(json.dumps({"names": names}), flush=True)
    sys.stdin.readline()  # the test maps every segment, as a server would
    producer.kill()  # SIGKILL: no cleanup runs
    producer.wait()
    out = {"code": producer.returncode, "after_kill": present(names)}
    dry = gc()
    out["dry"] = [dry.returncode, dry.stdout, present(names)]
    real = gc("--yes")
    out["real"] = [real.returncode, real.stdout, present(names)]
    out["live"] = [live, present([live])]
    print(json.dumps(out), flush=True)
""")


def _in_own_pid_namespace(command: list[str]) -> list[str]:
    """Run ``command`` in a fresh pid namespace when possible (root).

    Segment names carry the pid namespace, and gc judges only its own: so this
    scenario's gc cannot touch segments of concurrently running tests (another
    xdist worker's gc test), nor theirs this one's. Without root it runs as is.
    """
    unshare = shutil.which("unshare")
    if os.geteuid() == 0 and unshare:
        probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
        if probe.returncode == 0:
            return [unshare, "--pid", "--fork", "--mount-proc", *command]
    return command


def test_gc_reclaims_every_segment_of_a_sigkilled_producer_while_a_consumer_maps_them(
    request: pytest.FixtureRequest,
) -> None:
    command = _in_own_pid_namespace([sys.executable, "-c", GC_SCENARIO])
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        names = json.loads(proc.stdout.readline())["names"]
        views = [
            CpuShmIPCWrapper.from_fields(
                {
                    "dtype": "float16",
                    "shape": [2, 16, 4, 2, 8],
                    "stride": [1024, 64, 16, 8, 1],
                    "storage_offset": 0,
                    "device_uuid": "cpu",
                    "shm_name": n,
                    "shm_nbytes": 4096,
                }
            ).to_tensor()
            for n in names
        ]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["code"] == -signal.SIGKILL
    assert out["after_kill"] == names  # a killed process cleans nothing up
    dry_code, dry_out, after_dry = out["dry"]
    assert dry_code == 0 and after_dry == names  # a dry run deletes nothing...
    assert all(f"would remove {SHM_DIR}/{n}" in dry_out for n in names)  # ...but lists every one
    real_code, real_out, after_real = out["real"]
    assert real_code == 0 and after_real == []
    assert all(f"removed {SHM_DIR}/{n}" in real_out for n in names)
    live, live_left = out["live"]
    assert live_left == [live] and live not in dry_out + real_out  # a live producer's segment stays
    # POSIX: unlinking removed the names; this consumer's mappings still hold the bytes.
    assert all(torch.equal(v, torch.full_like(v, float(i))) for i, v in enumerate(views))
    del views
    gc.collect()
    assert all(mappings_of(n) == 0 for n in names)
    where = "in a private pid namespace" if command[0] != sys.executable else "in this pid namespace"
    emit(
        request,
        "4 SIGKILLed producer",
        f"{len(names)} segments of a SIGKILLed producer ({where}): `gc` listed "
        f"all and removed none, `gc --yes` removed all; a live producer's segment and a consumer's mappings "
        f"were unaffected",
    )


# -- the reference server killed ----------------------------------------------------------------


def test_a_killed_server_leaves_the_engine_working_and_a_new_server_takes_over(
    engine: tuple[list[torch.Tensor], list[lp.DeviceIPCWrapper]], request: pytest.FixtureRequest
) -> None:
    tensors, wrappers = engine
    names = [w.shm_name for w in wrappers]  # type: ignore[attr-defined]
    first = ServerProcess(max_host_bytes=1 << 20).start()
    try:
        old = ServerClient(first.socket_path, timeout=30)
        ctx = old.register(wrappers, lmcache_tokens_per_chunk=8, layout_hints=HINTS).context
        old.store(ctx, [("a", [[0, 1]]), ("b", [[2, 3]])])
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)
        with pytest.raises((ServerError, OSError)):  # the old connection is dead, and says so
            old.status()
        old.close()
    finally:
        first.stop()  # reaps the dead process, removes its socket directory
    assert first.directory is None

    # The engine is unaffected: segments, contents and writes.
    assert all(os.path.exists(f"{SHM_DIR}/{n}") for n in names)
    snapshot = [t.clone() for t in tensors]
    tensors[0][0, 5].fill_(3.0)
    snapshot[0][0, 5].fill_(3.0)
    assert all(torch.equal(t, s) for t, s in zip(tensors, snapshot, strict=True))

    # Registering the same wrappers with a new server works, bit-exact.
    with (
        ServerProcess(max_host_bytes=1 << 20) as second,
        ServerClient(second.socket_path, timeout=30) as client,
    ):
        ctx = client.register(wrappers, lmcache_tokens_per_chunk=8, layout_hints=HINTS).context
        client.store(ctx, [("a", [[4, 5]])])
        for t in tensors:
            t[:, 10:12] = 0
        client.retrieve(ctx, [("a", [[10, 11]])])
        assert all(torch.equal(t[:, 10:12], s[:, 4:6]) for t, s in zip(tensors, snapshot, strict=True))
        client.unregister(ctx)
    emit(
        request,
        "4 killed server",
        "server SIGKILLed mid-session: old client gets an error, engine tensors "
        "and segments intact, a new server registers the same wrappers and round-trips bit-exact",
    )

"""``LMCachePlatformTier`` behind vLLM's own native offloading, engines as separate processes.

Each engine is ``support/vllm_tier_engine.py`` in the vLLM venv: vLLM's
``TieringOffloadingSpec(...).get_manager()`` (its /dev/shm primary region, primary tier,
cascade and promotion logic) with our tier configured as vLLM loads it (``type`` and
``module_path``); the script fills the primary rows as vLLM's GPU worker would (there is
no GPU here) and checks, byte for byte, the rows vLLM promotes. Servers, stores and
faults are real: ``lmcache-platform serve`` processes, a file store, ``valkey-server``,
SIGKILL and SIGSTOP.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from support.procs import sigcont, sigstop
from support.serve import Serve, private_dir
from support.valkey import ValkeyNode
from support.vllm_engines import ROOT, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-tier")]

#: Run as a module: as a script, its directory (tests/support, which has a valkey.py) would shadow packages.
DRIVER = "support.vllm_tier_engine"
CHUNKS, CHUNK_BYTES = 16, 64 << 10
#: A tier call that waited on the server would take its deadline (seconds); vLLM's thread must never.
BLOCKED_S = 1.0


#: Deadlines for tests that are not about deadlines: the suite runs beside engines that take
#: the host's cores for seconds, and the tier's defaults (1 s lookups) are a quiet host's.
PATIENT = {"lookup_timeout_ms": 10_000, "transfer_timeout_ms": 30_000}


def tier(**config: Any) -> list[dict[str, Any]]:
    return [{"type": "LMCachePlatformTier", "module_path": "lmcache_platform.vllm.tier", **PATIENT, **config}]


def start(spec: dict[str, Any]) -> subprocess.Popen[str]:
    spec = {
        "engine_id": uuid.uuid4().hex[:12],
        "model": "m1",
        "chunks": CHUNKS,
        "chunk_bytes": CHUNK_BYTES,
        **spec,
    }
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.Popen(
        [str(vllm_python()), "-m", DRIVER, json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"engine exited {proc.returncode}: {err[-4000:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no report: {out[-2000:]} {err[-3000:]}"
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    return finish(start(spec))


def phase(report: dict[str, Any], i: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = report["phases"][i]
    return out


def never_blocked(report: dict[str, Any]) -> None:
    for calls in report["tier_calls"]:
        assert calls["max_ms"] < BLOCKED_S * 1e3, f"a tier call blocked vLLM's thread: {calls}"


def loaded_all(report: dict[str, Any], i: int = 0) -> None:
    """Every chunk hit and promoted byte-identical (this engine's primary tier started empty)."""
    p = phase(report, i)
    assert (p["identical"], p["wrong"], p["hits"]) == (CHUNKS, 0, CHUNKS), p


def missed_all(report: dict[str, Any], i: int = 0) -> None:
    p = phase(report, i)
    assert (p["hits"], p["identical"], p["wrong"]) == (0, 0, 0), p
    assert p["load_settled"], p


@pytest.fixture
def serve(tmp_path: Path) -> Any:
    sock = private_dir(tmp_path) / "kv.sock"
    with Serve(sock, "--max-host-bytes", "256M") as server:
        yield server


def test_engine_b_loads_what_engine_a_stored_through_serve(serve: Serve) -> None:
    tiers = tier(socket=str(serve.socket_path))
    a = engine({"mode": "store", "tiers": tiers})
    assert a["stats"][0]["store_chunks"] == CHUNKS and a["stats"][0]["store_failures"] == 0, a
    b = engine({"mode": "load", "tiers": tiers})
    loaded_all(b)
    never_blocked(a)
    never_blocked(b)
    other = engine({"mode": "load", "model": "m2", "tiers": tiers})  # same keys, another model
    missed_all(other)


def test_straight_to_a_file_store_and_damaged_entries_are_never_served(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    tiers = tier(remote=f"file://{store}", remote_prefix="t39")
    a = engine({"mode": "store", "tiers": tiers})
    assert a["stats"][0]["store_chunks"] == CHUNKS, a
    loaded_all(engine({"mode": "load", "tiers": tiers}))
    missed_all(engine({"mode": "load", "model": "m2", "tiers": tiers}))
    files = sorted(p for p in store.rglob("*") if p.is_file() and p.stat().st_size > CHUNK_BYTES)
    assert len(files) >= CHUNKS
    for f in files:  # one flipped byte in the payload of every entry
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
    damaged = engine({"mode": "load", "tiers": tiers})
    p = phase(damaged)
    assert p["wrong"] == 0 and p["identical"] == 0, p
    assert damaged["stats"][0].get("load_failures", 0) >= 1, damaged


def test_straight_to_valkey(tmp_path: Path) -> None:
    with ValkeyNode(tmp_path / "valkey") as node:
        tiers = tier(remote=node.url, remote_prefix="t39")
        a = engine({"mode": "store", "tiers": tiers})
        assert a["stats"][0]["store_chunks"] == CHUNKS, (a["stats"], a["last_error"])
        loaded_all(engine({"mode": "load", "tiers": tiers}))
        missed_all(engine({"mode": "load", "model": "m2", "tiers": tiers}))


def test_serve_with_a_disk_tier_restarted_between_the_engines(tmp_path: Path) -> None:
    store = tmp_path / "disk"
    store.mkdir()
    sock = private_dir(tmp_path) / "kv.sock"
    tiers = tier(socket=str(sock))
    with Serve(sock, "--max-host-bytes", "256M", "--remote", f"file://{store}") as first:
        a = engine({"mode": "store", "tiers": tiers})
        assert a["stats"][0]["store_chunks"] == CHUNKS, a
        assert first.stop() == 0  # a clean stop flushes the write-behind queue to disk
    with Serve(sock, "--max-host-bytes", "256M", "--remote", f"file://{store}"):
        loaded_all(engine({"mode": "load", "tiers": tiers}))


@pytest.mark.parametrize("fault", ["kill", "sigstop"])
def test_a_server_killed_or_stopped_fails_jobs_without_blocking_and_the_tier_recovers(
    tmp_path: Path, fault: str
) -> None:
    """Engine A's second phase stores while the server is dead or hung (SIGSTOP: requests are
    sent and never answered, so its jobs are in flight when they time out), and engine B
    looks up and loads meanwhile; A's third phase stores, in the same process and tier,
    once a new server answers, and engine C loads that."""
    sock = private_dir(tmp_path) / "kv.sock"
    flags = {name: tmp_path / name for name in ("stored", "faulted", "hurt", "back", "done")}
    tiers = tier(socket=str(sock), transfer_timeout_ms=1500, lookup_timeout_ms=500)
    server = Serve(sock, "--max-host-bytes", "256M").wait_ready()
    try:
        a = start({
            "tiers": tiers, "chunks": 64,
            "phases": [
                {"mode": "store", "seed": 1, "ready_file": str(flags["stored"])},
                {"mode": "store", "seed": 2, "wait_file": str(flags["faulted"]), "ready_file": str(flags["hurt"])},
                # a failed server is dialed again after at most 5 s (the pause doubles up to that)
                {"mode": "store", "seed": 3, "wait_file": str(flags["back"]), "settle_s": 6, "timeout_s": 90},
            ],
        })  # fmt: skip
        wait_for(flags["stored"], a)
        if fault == "kill":
            server.kill()
        else:
            sigstop(server.proc.pid)
        flags["faulted"].write_text("go")
        b = engine({"tiers": tiers, "chunks": 64, "phases": [{"mode": "load", "seed": 1}]})
        wait_for(flags["hurt"], a)
        if fault == "sigstop":
            sigcont(server.proc.pid)
        server.kill()
        server = Serve(sock, "--max-host-bytes", "256M").wait_ready()
        flags["back"].write_text("go")
        report = finish(a)
        c = engine({"tiers": tiers, "chunks": 64, "phases": [{"mode": "load", "seed": 3}]})
    finally:
        server.kill()
    for r in (report, b, c):
        never_blocked(r)
    assert report["stats"][0]["store_failures"] >= 1, report["stats"]  # the fault was met
    missed = phase(b)
    assert (missed["identical"], missed["wrong"]) == (0, 0), missed
    recovered = phase(c)  # what A's tier stored after the new server came up
    assert (recovered["identical"], recovered["wrong"]) == (64, 0), (recovered, report["stats"])


def wait_for(flag: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the engine never wrote {flag.name}"
        time.sleep(0.01)


def test_drain_waits_for_the_jobs_in_flight(serve: Serve) -> None:
    tiers = tier(socket=str(serve.socket_path), parallel_requests=2)  # each job split over two connections
    report = engine({"tiers": tiers, "chunks": 64,
                     "phases": [{"mode": "store", "drain": True}]})  # fmt: skip
    p = phase(report)
    assert p["in_flight_before_drain"] >= 1, p  # submitted, not yet done
    assert p["in_flight_after_drain"] == 0 and p["finished_after_drain"] >= 1, p
    assert report["stats"][0]["store_chunks"] == 64
    b = phase(engine({"tiers": tiers, "chunks": 64, "phases": [{"mode": "load"}]}))  # split loads too
    assert (b["identical"], b["wrong"]) == (64, 0), b


def test_an_engine_of_two_workers_shares_rows_holding_both_ranks(serve: Serve) -> None:
    tiers = tier(socket=str(serve.socket_path))
    a = engine({"mode": "store", "tiers": tiers, "world": 2})
    assert a["row_bytes"] >= 2 * CHUNK_BYTES, a  # each row holds both workers' parts
    loaded_all(engine({"mode": "load", "tiers": tiers, "world": 2}))
    missed_all(engine({"mode": "load", "tiers": tiers, "world": 1}))  # another parallel layout


def test_events_and_metrics_report_stored_and_evicted_chunks(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    with Serve(sock, "--max-host-bytes", str(20 * CHUNK_BYTES)):  # the second store evicts the first's
        tiers = tier(socket=str(sock), enable_kv_events=True, locality="LOCAL")
        phases = [{"mode": "store", "seed": 1}, {"mode": "store", "seed": 2, "hold_s": 2.5}]
        report = engine({"tiers": tiers, "events": True, "phases": phases})
    assert report["events"]["stored"] == 2 * CHUNKS, (report["events"], report["last_error"])
    assert report["events"]["removed"] >= CHUNKS - 4, report["events"]  # from the server's removal log
    metrics = report["prometheus"][0]
    assert metrics["lmcache_platform_tier_stored_chunks"] == 2 * CHUNKS, metrics
    assert metrics["lmcache_platform_tier_stored_bytes"] == 2 * CHUNKS * report["row_bytes"], metrics
    assert metrics["lmcache_platform_tier_job_seconds"] > 0, metrics

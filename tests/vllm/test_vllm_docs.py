"""docs/vllm.md's commands, run as the page writes them: the server, vLLM's OpenAI server, one request.

The commands are read from the page's ``console`` blocks, not copied here, so a change
to the page is tested as it stands. Only placeholders are replaced: ``MODEL`` by a tiny
dummy-weight model (``support.vllm_models``) and the socket's directory
``/run/user/$UID/lmcache`` by a private temporary one. Both commands run from the vLLM
venv's ``bin`` (where ``lmcache-platform`` and ``python`` are the ones that have vLLM and
the project), each through ``bash`` exactly as a reader pastes it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from lmcache_platform.server import ServerClient
from support.vllm_engines import ROOT, vllm_python

DOC = ROOT / "docs" / "vllm.md"
#: The page's socket directory, bare or spliced into a single-quoted JSON string.
SOCKET_DIR = re.compile(r"/run/user/'?\$UID'?/lmcache")
#: Appended to the page's vLLM command; the page says to add vLLM's own options as needed.
EXTRA_VLLM_FLAGS = [
    *("--load-format", "dummy"),  # the tiny model has a config and a tokenizer, no weights
    "--enforce-eager",  # no graph compilation: start-up in seconds rather than minutes on 2 cores
    *("--max-model-len", "2048"),  # the model's 4096 positions would need more KV memory than given
    *("--kv-cache-memory-bytes", str(64 << 20)),  # not vLLM's default share of host memory
    *("--host", "127.0.0.1"),  # loopback only, on a free port (below) rather than the default 8000
]
START_TIMEOUT = 300  # seconds; a shared 2-core machine starts an engine in 10-60 s

pytestmark = pytest.mark.vllm


def console_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```console\n(.*?)^```", markdown, flags=re.M | re.S)


def documented(program: str) -> tuple[list[str], str]:
    """The page's block running ``program``: the lines before it, and the command from it on."""
    for block in console_blocks(DOC.read_text()):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(program):
                return lines[:i], "\n".join(lines[i:])
    raise AssertionError(f"{DOC} has no console block that runs {program!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Command:
    """One documented command in the foreground of its own session, logging to a file."""

    def __init__(self, command: str, env: dict[str, str], log: Path) -> None:
        self.log = log
        # exec: the command itself, not a shell around it, gets the signal that stops it.
        with log.open("w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=log.parent,
            )

    def alive(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.log.name}: exited {self.proc.returncode}:\n{self.tail()}")

    def stop(self) -> int:
        """SIGTERM, as an operator stops it; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.log.name}: still running 90 s after SIGTERM:\n{self.tail()}")

    def kill(self) -> None:
        """What a failed test leaves: nothing of the command's session."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(30)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def http_json(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        payload = None if body is None else json.dumps(body)
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        return reply.status, json.loads(data) if data else {}
    finally:
        conn.close()


def metric(port: int, name: str) -> float:
    """The sum of a Prometheus series over its labels in vLLM's ``/metrics`` (0 when absent)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


def wait_healthy(vllm: Command, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        vllm.alive()
        try:
            healthy = http_json(port, "GET", "/health")[0] == 200
        except ConnectionError:  # not listening yet
            healthy = False
        if healthy:
            return
        time.sleep(1)
    pytest.fail(f"vLLM did not answer /health within {START_TIMEOUT} s:\n{vllm.tail()}")


def test_the_pages_commands_serve_a_completion(tmp_path: Path) -> None:
    python = vllm_python()
    model = tmp_path / "model"
    subprocess.run(
        [str(python), str(ROOT / "tests" / "support" / "vllm_models.py"), str(model)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    socket_dir = tmp_path / "lmcache"
    assert "'" not in str(tmp_path)  # it is spliced into single-quoted shell words

    def placed(text: str) -> str:
        return re.sub(r"\bMODEL\b", str(model), SOCKET_DIR.sub(str(socket_dir), text))

    env = {
        **os.environ,
        "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",
        "VLLM_LOG_STATS_INTERVAL": "1",
    }
    env.pop("LMCACHE_PLATFORM_SOCKET", None)  # the socket must come from the commands

    setup, serve_command = documented("lmcache-platform serve")
    for line in setup:
        subprocess.run(["bash", "-c", placed(line)], env=env, check=True, timeout=30)
    assert socket_dir.is_dir() and (socket_dir.stat().st_mode & 0o777) == 0o700
    _, vllm_command = documented("python -m vllm.entrypoints.openai.api_server")
    port = free_port()

    server = Command(placed(serve_command), env, tmp_path / "serve.log")
    vllm = None
    try:
        sock = socket_dir / "server.sock"
        deadline = time.monotonic() + 60
        while not sock.exists():
            server.alive()
            assert time.monotonic() < deadline, f"no socket after 60 s:\n{server.tail()}"
            time.sleep(0.1)

        extra = " ".join([*EXTRA_VLLM_FLAGS, "--port", str(port)])
        vllm = Command(f"{placed(vllm_command)} {extra}", env, tmp_path / "vllm.log")
        wait_healthy(vllm, port)

        prompt = " ".join(["hello world"] * 200)  # several 256-token chunks
        # ignore_eos: a dummy-weight model may sample the end-of-text token at any step.
        request = {"model": str(model), "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        status, reply = http_json(port, "POST", "/v1/completions", request)
        assert status == 200, reply
        assert isinstance(reply["choices"][0]["text"], str)
        assert reply["usage"]["prompt_tokens"] > 256 and reply["usage"]["completion_tokens"] == 4

        # The connector the command configures registered the engine's KV and stored chunks.
        with ServerClient(str(sock)) as client:
            deadline = time.monotonic() + 30
            while (counters := client.status()["server"])["chunks"] == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
        assert counters["contexts"] == 1 and counters["chunks"] >= 1, counters

        # vLLM's own metrics show the connector's counters: its Prometheus series and its
        # "KV Transfer metrics" log line (VLLM_LOG_STATS_INTERVAL is 1 s here). vLLM takes
        # connector stats only when it runs a step: a store answered after the engine went
        # idle is counted with the next request's step, so keep a trickle of requests going.
        deadline = time.monotonic() + 60
        tick = {"model": str(model), "prompt": "hello", "max_tokens": 1, "ignore_eos": True}
        while (stored := metric(port, "vllm:lmcache_platform_stored_chunks_total")) == 0:
            assert time.monotonic() < deadline, "vllm:lmcache_platform_stored_chunks_total stayed 0"
            time.sleep(0.5)
            assert http_json(port, "POST", "/v1/completions", tick)[0] == 200
        assert stored == counters["chunks"]
        assert metric(port, "vllm:lmcache_platform_lookups_total") >= 1
        while "KV Transfer metrics" not in vllm.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"no 'KV Transfer metrics' log line:\n{vllm.tail()}"
            time.sleep(0.5)

        assert vllm.stop() == 0, vllm.tail()
        assert server.stop() == 0, server.tail()
        assert not sock.exists()
    finally:
        for command in (vllm, server):
            if command is not None:
                command.kill()

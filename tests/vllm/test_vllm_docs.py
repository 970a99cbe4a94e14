"""docs/vllm.md's commands, run as the page writes them: the server, vLLM's OpenAI server, one request.

The commands are read from the page's ``console`` blocks, not copied here, so a change
to the page is tested as it stands. Only placeholders are replaced: ``MODEL`` by a tiny
dummy-weight model (``support.vllm_models``) and the socket's directory
``/run/user/$UID/lmcache`` by a private temporary one. Both commands run from the vLLM
venv's ``bin`` (where ``lmcache-platform`` and ``python`` are the ones that have vLLM and
the project), each through ``bash`` exactly as a reader pastes it.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from lmcache_platform.server import ServerClient
from support.vllm_engines import ROOT, vllm_python
from support.vllm_openai import Command, free_port, http_json, metric, wait_healthy

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

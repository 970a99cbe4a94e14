"""AsyncClient against real server processes: healthy, hung (SIGSTOP), killed, and trickling.

The server is a spawned :class:`ServerProcess` (so this process's thread and fd counts
are the client's alone); the engine is real CPU KV tensors in shared memory, registered
by the client's ``on_connect`` hook. Timing assertions are generous bounds that prove
"does not wait for a socket timeout" (seconds against a 1 s deadline, never the old
60 s); the measured figures are printed (``-s``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_platform import WireFormatError
from lmcache_platform.protocol import _messages as P
from lmcache_platform.server import (
    AsyncClient,
    LookupResult,
    Pending,
    ReferenceServer,
    Registration,
    ServerClient,
    ServerError,
    ServerProcess,
    ServerUnavailable,
    new_lease_id,
)
from support.procs import sigstop
from support.serve import Serve, TinyEngine, namespace, private_dir
from support.waits import wait_until

WAIT_S = 60  # a bound for waits, never a measured time
LOGGER = "lmcache_platform.client._async"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess() as proc:
        yield proc


@pytest.fixture
def own_server() -> Iterator[ServerProcess]:
    """A server of the test's own, to stop, continue or kill."""
    proc = ServerProcess().start()
    yield proc
    if proc.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
    proc.stop()


class Registrar:
    """An ``on_connect`` hook: registers the engine, counts its runs, can be made to fail."""

    def __init__(self, engine: TinyEngine, ns: bytes, failures: int = 0) -> None:
        self.engine, self.ns, self.failures = engine, ns, failures
        self.runs = 0
        self.thread: threading.Thread | None = None

    def __call__(self, client: ServerClient) -> Registration:
        self.runs += 1
        self.thread = threading.current_thread()
        if self.failures:
            self.failures -= 1
            raise RuntimeError("registration refused (on purpose)")
        assert client.ping().pid > 0  # a blocking, deadline-bounded client
        return self.engine.registration(client, self.ns)


_models = itertools.count()


def fresh() -> bytes:
    """A namespace no other test uses (the module's server keeps every test's chunks)."""
    return namespace(model=f"async-{next(_models)}")


def key(i: int) -> bytes:
    return i.to_bytes(4, "big").ljust(32, b"a")


def context_of(client: AsyncClient) -> int:
    """The context the client's latest ``on_connect`` registered."""
    assert client.session is not None, "on_connect has not registered a context"
    return client.session.context


def healthy(client: AsyncClient) -> AsyncClient:
    wait_until(lambda: client.state == "healthy", f"{client} to connect")
    return client


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


CTX = AsyncClient.SESSION_CONTEXT


# -- a healthy server -------------------------------------------------------------------


def test_pipelined_requests_come_back_through_futures(server: ServerProcess, engine: TinyEngine) -> None:
    ns = fresh()
    hook = Registrar(engine, ns)
    with healthy(AsyncClient(server.socket_path, name="t", on_connect=hook)) as client:
        assert hook.runs == 1 and hook.thread is not threading.current_thread()
        assert context_of(client) > 0
        for i in range(8):
            engine.fill(i, seed=10 + i)
        start = time.monotonic()
        puts = [client.put(CTX, [(key(i), [engine.blocks(i)])]) for i in range(8)]
        submitted = time.monotonic() - start
        assert all(isinstance(p, Pending) and p.future is p for p in puts)
        assert [p.result(WAIT_S).stored for p in puts] == [1] * 8
        assert all(p.resolved.is_set() for p in puts)
        lease = new_lease_id()
        look = client.lookup([ns], [key(i) for i in range(10)], lease=lease, lease_ms=10_000)
        assert look.result(WAIT_S) == LookupResult(hits=8, remote=0)
        gets = [client.get(CTX, [(key(i), [engine.blocks(8 + i)])], lease=lease) for i in range(8)]
        assert [g.result(WAIT_S).retrieved for g in gets] == [1] * 8
        assert all(engine.holds(8 + i, seed=10 + i) for i in range(8))
        assert client.status().result(WAIT_S)["server"]["leases"] == 0  # the gets used it up
        ping = client.ping()
        assert ping.finished_at is None or ping.done()
        assert ping.result(WAIT_S).pid == server.pid
        time.sleep(0.2)  # a caller that polls late: the answer's time is when it came, not now
        assert ping.finished_at is not None and ping.finished_at <= time.monotonic() - 0.2
        done: list[Pending[Any]] = [*puts, *gets]
        assert all(p.finished_at is not None and p.finished_at >= start for p in done)
        stats = client.stats()
        assert stats["answered"] >= 19 and stats.get("deadline_misses", 0) == 0
        print(f"8 pipelined puts submitted in {submitted * 1e3:.2f} ms")


def test_errors_travel_on_the_future_and_submit_never_raises(
    server: ServerProcess, engine: TinyEngine
) -> None:
    with healthy(AsyncClient(server.socket_path, name="t", on_connect=Registrar(engine, fresh()))) as client:
        refused = client.get(CTX, [(key(0), [[0, 0]])])
        with pytest.raises(ServerError, match="some repeat") as info:
            refused.result(WAIT_S)
        assert info.value.remote_type == "TransferError" and refused.resolved.is_set()
        malformed = client.submit("get", context=CTX, chunks=[(b"", [[1, 2]])])  # an empty key
        with pytest.raises(WireFormatError, match="must not be empty"):
            malformed.result(WAIT_S)
        assert malformed.resolved.is_set()  # never sent
        unknown = client.submit("frobnicate")
        with pytest.raises(WireFormatError, match="unknown op"):
            unknown.result(WAIT_S)
        late = client.ping(deadline_ms=-1)  # already late: not even sent
        with pytest.raises(ServerUnavailable, match="deadline passed before it was sent"):
            late.result(WAIT_S)
        assert client.state == "healthy"
        assert not refused.cancel()  # only the client settles a Pending


def test_submit_is_thread_safe(server: ServerProcess, engine: TinyEngine) -> None:
    ns = fresh()
    with healthy(AsyncClient(server.socket_path, name="t", on_connect=Registrar(engine, ns))) as client:
        out: list[Pending] = []
        lock = threading.Lock()

        def many() -> None:
            mine = [client.lookup(ns, [key(0)]) for _ in range(100)]
            with lock:
                out.extend(mine)

        threads = [threading.Thread(target=many) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert [p.result(WAIT_S).hits for p in out] == [0] * 400
        assert len({p.request_id for p in out}) == 400


def test_on_connect_failures_are_logged_once_and_retried(
    server: ServerProcess, engine: TinyEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    hook = Registrar(engine, fresh(), failures=3)
    client = AsyncClient(
        server.socket_path, name="flaky", on_connect=hook, retry_first_s=0.05, retry_max_s=0.1
    )
    with client:
        healthy(client)
        assert hook.runs == 4 and client.session is not None
        assert client.put(CTX, []).result(WAIT_S).stored == 0
    lines = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]
    text = [r.getMessage() for r in lines]
    assert len([t for t in text if "unavailable" in t]) == 1, text
    assert "on_connect failed: RuntimeError: registration refused (on purpose)" in text[0]
    assert len([t for t in text if "available again" in t]) == 1, text


def test_no_socket_path_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LMCACHE_PLATFORM_SOCKET", raising=False)
    with pytest.raises(ValueError, match="no socket path"):
        AsyncClient(None, name="t")


def test_a_slow_transfer_fails_its_future_but_the_server_stays_healthy(
    engine: TinyEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The data connection is stuck in a transfer; the control connection still answers pings."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    directory = tempfile.mkdtemp(prefix="lmcache-slow-")
    server = ReferenceServer(os.path.join(directory, "kv.sock"))
    server.bind()
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        with healthy(
            AsyncClient(
                server.socket_path, name="slow", on_connect=Registrar(engine, fresh()), deadline_ms=300
            )
        ) as client:
            # What the connect cost is not this test's (a loaded host may retry the register).
            since = len(caplog.records)
            engine.fill(0, seed=4)
            assert client.put(CTX, [(key(0), [engine.blocks(0)])]).result(WAIT_S).stored == 1
            ctx = server._entries[context_of(client)].ctx
            go = threading.Event()
            retrieve = ctx.write_chunk

            def stuck(*args: Any, **kwargs: Any) -> Any:
                assert go.wait(WAIT_S)
                return retrieve(*args, **kwargs)

            ctx.write_chunk = stuck  # type: ignore[method-assign]
            load = client.get(CTX, [(key(0), [engine.blocks(3)])])
            with pytest.raises(ServerUnavailable, match="no reply within its deadline"):
                load.result(WAIT_S)
            wait_until(lambda: client.stats().get("slow", 0) == 1, "the health ping's answer")
            assert client.state == "healthy" and not load.resolved.is_set()
            go.set()  # the late reply still comes, and resolves the load
            assert load.resolved.wait(WAIT_S)
            # The batch under way when the deadline passed was written: that is why an engine
            # keeps a load's blocks until it is resolved, not merely done.
            assert engine.holds(3, seed=4)
    finally:
        server.stop()
        serving.join(WAIT_S)
        os.rmdir(directory)
    text = [r.getMessage() for r in caplog.records[since:] if r.name == LOGGER]
    assert len([t for t in text if "is slow" in t]) == 1, text
    assert not [t for t in text if "unavailable" in t], text


# -- a hung server (SIGSTOP) --------------------------------------------------------------


def quick_to_retry(server: ServerProcess, hook: Registrar, retry_max_s: float, **options: Any) -> AsyncClient:
    """A client of ``server`` whose reconnects start 0.2 s apart: its recovery after SIGCONT
    shows well within the tests' bounds. ``options``: more of the client's."""
    options.setdefault("name", "t")
    return AsyncClient(
        server.socket_path, on_connect=hook, retry_first_s=0.2, retry_max_s=retry_max_s, **options
    )


def test_a_hung_server_costs_a_deadline_not_a_timeout_and_recovers(
    own_server: ServerProcess, engine: TinyEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    ns = fresh()
    hook = Registrar(engine, ns)
    client = quick_to_retry(own_server, hook, 0.5, name="hung", deadline_ms=1000)
    with client:
        healthy(client)
        first_context = context_of(client)
        engine.fill(0, seed=7)
        assert client.put(CTX, [(key(0), [engine.blocks(0)])]).result(WAIT_S).stored == 1
        assert own_server.pid is not None
        sigstop(own_server.pid)

        t0 = time.monotonic()
        load = client.get(CTX, [(key(0), [engine.blocks(5)])])
        submit_s = time.monotonic() - t0
        assert submit_s < 1.0  # no socket wait (a full GC pass may land here: generous)
        with pytest.raises(ServerUnavailable, match="no reply within its deadline"):
            load.result(WAIT_S)
        failed_s = time.monotonic() - t0
        assert failed_s < 5.0
        wait_until(lambda: client.state == "unavailable", "the failed ping", 10)
        unavailable_s = time.monotonic() - t0
        assert unavailable_s < 5.0
        assert not load.resolved.is_set(), "the hung server can still act on the load"
        t1 = time.monotonic()
        refused = client.lookup(ns, [key(0)])
        refused_s = time.monotonic() - t1
        assert refused.done() and refused.resolved.is_set() and refused_s < 1.0
        time.sleep(1.0)  # several reconnect attempts fail meanwhile: no log line for them
        assert engine.is_zero(5)

        os.kill(own_server.pid, signal.SIGCONT)
        t2 = time.monotonic()
        assert load.resolved.wait(10), "the load was never resolved"
        resolved_s = time.monotonic() - t2
        assert engine.is_zero(5), "the server wrote into blocks after the load's deadline"
        healthy_s = wait_until(lambda: client.state == "healthy", "recovery", 10)
        assert hook.runs == 2 and context_of(client) != first_context  # registered anew
        assert client.get(CTX, [(key(0), [engine.blocks(6)])]).result(WAIT_S).retrieved == 1
        assert engine.holds(6, seed=7)
        status = client.status().result(WAIT_S)["server"]
        assert status["deadline_drops"] >= 1  # the load, dropped when the server woke
        print(
            f"SIGSTOP: submit {submit_s * 1e3:.2f} ms, future failed after {failed_s:.2f} s, unavailable "
            f"after {unavailable_s:.2f} s, refused submit {refused_s * 1e3:.2f} ms; SIGCONT: load resolved "
            f"after {resolved_s * 1e3:.0f} ms, healthy after {healthy_s:.2f} s; client stats {client.stats()}"
        )
    text = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len([t for t in text if "unavailable" in t]) == 1, text  # one line per state change
    assert "no answer to a ping within 1000 ms" in next(t for t in text if "unavailable" in t)
    assert len([t for t in text if "available again" in t]) == 1, text


def test_a_connect_to_a_hung_server_is_caught_by_the_first_ping(
    own_server: ServerProcess, engine: TinyEngine
) -> None:
    assert own_server.pid is not None
    sigstop(own_server.pid)
    hook = Registrar(engine, fresh())
    t0 = time.monotonic()
    client = quick_to_retry(own_server, hook, 0.2, ping_deadline_ms=500)
    with client:
        assert time.monotonic() - t0 < 1.0  # the constructor does not connect
        waited = wait_until(lambda: client.state == "unavailable", "the first ping to fail", 10)
        assert waited < 5.0 and hook.runs == 0  # connect() succeeded into the backlog; the ping did not
        assert "no answer in time" in client.reason or "deadline" in client.reason
        os.kill(own_server.pid, signal.SIGCONT)
        recovered = wait_until(lambda: client.state == "healthy", "recovery", 10)
        assert hook.runs == 1
        print(f"hung at connect: unavailable after {waited:.2f} s; healthy {recovered:.2f} s after SIGCONT")


def test_close_during_a_connect_to_a_hung_server_returns_promptly(own_server: ServerProcess) -> None:
    assert own_server.pid is not None
    sigstop(own_server.pid)
    threads, files = threading.active_count(), fds()
    client = AsyncClient(own_server.socket_path, name="t", ping_deadline_ms=30_000)
    time.sleep(0.3)  # the I/O thread now waits for the first ping's reply
    assert client.state == "connecting"
    t0 = time.monotonic()
    client.close()
    closed_s = time.monotonic() - t0
    assert closed_s < 2.0 and client.state == "closed"
    assert threading.active_count() == threads and fds() == files
    print(f"close during a hung connect took {closed_s * 1e3:.0f} ms (ping deadline 30 s)")


def test_close_while_hung_returns_promptly_and_fails_everything(
    own_server: ServerProcess, engine: TinyEngine
) -> None:
    client = healthy(AsyncClient(own_server.socket_path, name="t", on_connect=Registrar(engine, fresh())))
    assert own_server.pid is not None
    sigstop(own_server.pid)
    loads = [client.get(CTX, [(key(i), [engine.blocks(i)])], deadline_ms=30_000) for i in range(4)]
    t0 = time.monotonic()
    client.close()
    closed_s = time.monotonic() - t0
    assert closed_s < 2.0 and client.state == "closed"
    for load in loads:
        with pytest.raises(ServerUnavailable, match="closed"):
            load.result(0)
        assert load.resolved.is_set()
    with pytest.raises(ServerUnavailable, match="the client is closed"):
        client.ping().result(0)
    client.close()  # idempotent


# -- a killed server -----------------------------------------------------------------------


def test_a_killed_server_resolves_pending_requests_at_once(
    own_server: ServerProcess, engine: TinyEngine
) -> None:
    client = healthy(
        AsyncClient(
            own_server.socket_path, name="t", on_connect=Registrar(engine, fresh()), deadline_ms=30_000
        )
    )
    with client:
        assert own_server.pid is not None
        sigstop(own_server.pid)  # so the requests stay pending in the server
        loads = [client.get(CTX, [(key(i), [engine.blocks(i)])]) for i in range(4)]
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(own_server.pid, signal.SIGKILL)
        for load in loads:
            assert load.resolved.wait(10)
            with pytest.raises(ServerUnavailable):
                load.result(0)
        resolved_s = time.monotonic() - t0
        assert resolved_s < 5.0  # the EOF, not the 30 s deadline
        wait_until(lambda: client.state == "unavailable", "the client to notice", 10)
        print(f"SIGKILL: 4 pending loads failed and resolved {resolved_s * 1e3:.0f} ms after the kill")


# -- a server that trickles bytes ---------------------------------------------------------


class Trickler:
    """A fake server: for every frame it reads, it answers one byte of a reply per 100 ms."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="lmcache-trickle-")
        self.path = os.path.join(self.directory, "kv.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                payload = P.recv_frame(conn)
                if payload is None:
                    return
                reply = P.frame(P.encode_reply(P.decode_request(payload).request_id, {"now": 0, "pid": 1}))
                for i in range(len(reply)):
                    if self.stop.wait(0.1):
                        return
                    conn.sendall(reply[i : i + 1])
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT_S)
        self.sock.close()
        os.unlink(self.path)
        os.rmdir(self.directory)


def test_a_trickling_server_does_not_extend_a_deadline() -> None:
    fake = Trickler()
    try:
        t0 = time.monotonic()
        blocking = ServerClient(fake.path, timeout=30, deadline_ms=500)
        with pytest.raises(ServerUnavailable, match="no reply within its deadline of 500 ms"):
            blocking.ping()  # 4 bytes of prefix + ~30 bytes at 10 bytes/s: > 3 s if each byte reset it
        blocking.close()
        blocking_s = time.monotonic() - t0
        assert blocking_s < 2.0
        with AsyncClient(fake.path, name="t", ping_deadline_ms=500, retry_first_s=30) as client:
            waited = wait_until(lambda: client.state == "unavailable", "the trickled ping to fail", 10)
        assert waited < 2.0
        print(
            f"trickling server: blocking call gave up after {blocking_s:.2f} s, async connect after {waited:.2f} s"
        )
    finally:
        fake.close()


# -- leaks ---------------------------------------------------------------------------------


def test_no_thread_or_fd_leaks(own_server: ServerProcess, engine: TinyEngine) -> None:
    # Earlier tests' garbage first: a collection in the middle of this test would close their
    # sockets and pipes, and the count would drop below the baseline (seen: 42 before, 38 after).
    gc.collect()
    threads, files = threading.active_count(), fds()
    for _ in range(3):
        client = healthy(AsyncClient(own_server.socket_path, name="t", on_connect=Registrar(engine, fresh())))
        assert client.lookup(fresh(), [key(0)]).result(WAIT_S).hits == 0
        assert threading.active_count() == threads + 1  # one I/O thread per client
        client.close()
    # the hung case: a zombie link, reconnect attempts, then close
    assert own_server.pid is not None
    client = healthy(
        AsyncClient(
            own_server.socket_path,
            name="t",
            on_connect=Registrar(engine, fresh()),
            deadline_ms=300,
            retry_first_s=0.05,
            retry_max_s=0.1,
        )
    )
    sigstop(own_server.pid)
    loads: list[Pending] = []

    def noticed() -> bool:
        # A load the I/O thread could not send within its 300 ms (a loaded machine) fails
        # unsent and proves nothing about the server: send another, as an engine would.
        if client.state == "healthy" and (not loads or loads[-1].done()):
            loads.append(client.get(CTX, [(key(0), [engine.blocks(0)])]))
        return client.state == "unavailable"

    wait_until(noticed, "the hung server to be noticed", 10)
    assert client.stats()["zombies"] == 1 and not all(load.resolved.is_set() for load in loads)
    time.sleep(0.5)  # a few failed reconnects
    client.close()
    os.kill(own_server.pid, signal.SIGCONT)
    wait_until(lambda: threading.active_count() == threads, "the client's threads to end", 10)
    assert fds() == files, "file descriptors leaked"


# -- a server that comes back ---------------------------------------------------------------


@contextlib.contextmanager
def orphaned(tmp_path: Path, hook: Registrar, **client_kw: Any) -> Iterator[tuple[Path, AsyncClient]]:
    """A client that was healthy, and its socket path, once its server is killed and it noticed.

    The killed server's socket file stays, as a killed server's does: where a new server
    will listen, and what the client must not keep retrying.
    """
    path = private_dir(tmp_path) / "kv.sock"
    with Serve(path) as first, AsyncClient(str(path), name="t", on_connect=hook, **client_kw) as client:
        healthy(client)
        first.kill()
        wait_until(lambda: client.state == "unavailable", "the client to notice")
        yield path, client


def test_a_restarted_server_is_found_at_once_however_long_the_backoff_grew(
    tmp_path: Path, engine: TinyEngine
) -> None:
    hook = Registrar(engine, fresh())
    with orphaned(tmp_path, hook, retry_first_s=30, retry_max_s=60) as (path, client):
        assert client.sessions == 1
        attempts = client.stats()["connects"]
        time.sleep(0.5)
        assert client.stats()["connects"] == attempts  # the dead socket is not retried before the backoff
        with Serve(path):
            listening = time.monotonic()
            wait_until(lambda: client.state == "healthy", "the client to find the new server", 20)
            found = time.monotonic() - listening
            print(f"a restarted server found {found * 1e3:.0f} ms after it listened (backoff 30 s)")
            assert client.sessions == 2 and client.healthy_since >= listening
            engine.fill(0, seed=5)
            assert client.put(CTX, [(key(0), [engine.blocks(0)])]).result(WAIT_S).stored == 1


def test_a_hung_server_is_not_asked_more_often_than_the_backoff(tmp_path: Path, engine: TinyEngine) -> None:
    path = private_dir(tmp_path) / "kv.sock"
    with (
        Serve(path) as hung,
        AsyncClient(
            str(path), name="t", deadline_ms=300, retry_first_s=30, on_connect=Registrar(engine, fresh())
        ) as client,
    ):
        healthy(client)
        sigstop(hung.proc.pid)
        try:
            client.ping()
            wait_until(lambda: client.state == "unavailable", "the client to give up on the hung server")
            before = client.stats()
            time.sleep(1.0)  # ten looks at the socket path: the same socket, so no new attempt
            after = client.stats()
            assert after["connects"] == before["connects"], (
                f"a new attempt on the hung server's own socket ({client.state}: {client.reason}): "
                f"before {before}, after {after}"
            )
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)


class HeldRegistrar(Registrar):
    """Registers as :class:`Registrar`, but from its second session on only once released."""

    def __init__(self, engine: TinyEngine, ns: bytes, failures: int = 0) -> None:
        super().__init__(engine, ns, failures)
        self.release = threading.Event()
        self.held = threading.Event()

    def __call__(self, client: ServerClient) -> Registration:
        if self.runs:
            self.held.set()
            assert self.release.wait(WAIT_S)
        return super().__call__(client)


def test_requests_while_a_restarted_server_is_being_reached_wait_for_it(
    tmp_path: Path, engine: TinyEngine
) -> None:
    """The moment between a new server's listening and the connect costs no request."""
    hook = HeldRegistrar(engine, fresh())
    with orphaned(tmp_path, hook, deadline_ms=10_000, retry_first_s=30) as (path, client):
        accepting = lambda: client.accepting  # noqa: E731 (read afresh each time)
        assert not accepting()  # the dead server's socket: nothing to wait for
        assert client.put(CTX, [(key(0), [engine.blocks(0)])]).exception(WAIT_S) is not None
        refused = client.stats()["refused"]
        with Serve(path).wait_ready():
            assert accepting()  # a socket this client has not tried
            hook.held.wait(WAIT_S)  # the client is connecting, and still unavailable
            assert client.state == "unavailable"
            engine.fill(1, seed=7)
            put = client.put(CTX, [(key(1), [engine.blocks(1)])])
            found = client.lookup([hook.ns], [key(1)])
            assert not put.done()
            hook.release.set()
            assert put.result(WAIT_S).stored == 1  # sent once registered, into the new context
            found.result(WAIT_S)  # answered (sent before the put, so it found nothing yet)
            assert client.stats()["refused"] == refused
            assert client.lookup([hook.ns], [key(1)]).result(WAIT_S).hits == 1


def test_a_new_server_whose_connect_failed_is_not_waited_for(tmp_path: Path, engine: TinyEngine) -> None:
    hook = Registrar(engine, fresh())
    with orphaned(tmp_path, hook, retry_first_s=30, retry_max_s=60) as (path, client):
        hook.failures = 10**6  # the new server refuses every registration
        with Serve(path).wait_ready():
            wait_until(lambda: hook.runs >= 2, "an attempt at the new server")
            wait_until(lambda: not client.accepting, "the failed attempt to count")
            assert client.state == "unavailable"
            failed = client.put(CTX, [(key(2), [engine.blocks(0)])])
            assert failed.done() and isinstance(failed.exception(0), ServerUnavailable)

"""``lmcache-platform serve --remote``: real ``serve`` processes (two = two nodes) sharing a real Valkey.

An engine here is :class:`support.serve.TinyEngine` (real CPU KV tensors, the calls a
connector makes): these checks are about the server's wiring (write-behind after a put,
lookups and gets that reach the store, refusals, failures and counters), where a vLLM
engine would add only start-up time; ``tests/vllm/test_vllm_remote.py`` runs real
engines. What is asserted is what the servers did (replies, counters, log events and
the bytes that landed in the engine's blocks), never how long it took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_platform.server import ServerClient
from support.serve import CHUNK_BYTES, Serve, TinyEngine, namespace, private_dir
from support.valkey import ValkeyNode
from support.waits import until

NS = namespace()
OTHER_NS = namespace(model="other")
KEYS = [bytes([i]) * 32 for i in range(1, 200)]


def start(tmp: Path, name: str, url: str, *flags: str, env: dict[str, str] | None = None) -> Serve:
    """A ``serve`` with ``--remote url`` whose tier answered its first probe."""
    srv = Serve(private_dir(tmp, name) / "kv.sock", "--json-log", "--remote", url, *flags, env=env)
    srv.wait_ready()
    assert until(lambda: remote(srv)["state"] == "healthy"), srv.log()
    return srv


def counters(srv: Serve) -> dict[str, Any]:
    with ServerClient(str(srv.socket_path), timeout=30) as c:
        return dict(c.status()["server"])


def remote(srv: Serve) -> dict[str, Any]:
    return dict(counters(srv)["remote"])


def written(srv: Serve, n: int) -> None:
    """Wait until ``srv``'s tier has written ``n`` chunks in all."""
    assert until(lambda: remote(srv)["written"] >= n), remote(srv)


def settled(since: Since) -> int:
    """Chunks the tier wrote, saw refused or dropped since ``since`` began."""
    d = since()
    kinds = ("written", "write_errors", "dropped_full", "dropped_down", "dropped_degraded")
    return sum(d[f"remote.{k}"] for k in kinds)


def events(srv: Serve, name: str) -> list[dict[str, Any]]:
    return [e for e in srv.events() if e["event"] == name]


class Since:
    """A server's counters (``remote.<name>`` for the tier's) from now on: tests share servers."""

    def __init__(self, srv: Serve) -> None:
        self.srv = srv
        self.base = self._flat()

    def _flat(self) -> dict[str, int]:
        c = counters(self.srv)
        out = {k: v for k, v in c.items() if isinstance(v, int) and not isinstance(v, bool)}
        out.update({f"remote.{k}": v for k, v in c.get("remote", {}).items() if isinstance(v, int)})
        return out

    def __call__(self) -> dict[str, int]:
        return {k: v - self.base.get(k, 0) for k, v in self._flat().items()}


class Node:
    """One node's engine side: a client of its server and a tiny engine registered in ``ns``."""

    def __init__(self, srv: Serve, ns: bytes = NS, deadline_ms: float | None = 5000) -> None:
        self.srv = srv
        self.ns = ns
        self.engine = TinyEngine()
        self.client = ServerClient(str(srv.socket_path), timeout=30, deadline_ms=deadline_ms)
        self.ctx = self.engine.register(self.client, ns)

    def put(self, keys: list[bytes], seed: int = 0) -> Any:
        """Fill slot ``i`` with the pattern of ``seed + key[0]`` and put it under ``keys[i]``."""
        for i, key in enumerate(keys):
            self.engine.fill(i, seed + key[0])
        return self.client.put(self.ctx, [(k, [self.engine.blocks(i)]) for i, k in enumerate(keys)])

    def lookup(self, keys: list[bytes]) -> dict[str, Any]:
        return self.client.call("lookup", namespace=self.ns, keys=list(keys))

    def get(self, keys: list[bytes]) -> int:
        self.engine.zero()
        return self.client.get(self.ctx, [(k, [self.engine.blocks(i)]) for i, k in enumerate(keys)]).retrieved

    def holds(self, keys: list[bytes], seed: int = 0) -> list[bool]:
        return [self.engine.holds(i, seed + k[0]) for i, k in enumerate(keys)]

    def close(self) -> None:
        self.client.close()
        self.engine.close()


def shut(*nodes: Node) -> None:
    """Close each node, then stop its server: one its test started for itself, not a shared one."""
    for n in nodes:
        n.close()
        n.srv.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ValkeyNode, Serve, Serve]]:
    """One Valkey and two servers on it (``a``, ``b``, prefix ``t``), shared by this module's tests.

    Each test registers its engines in a namespace of its own, and reads counters as
    differences (:class:`Since`), so tests do not see each other's chunks.
    """
    tmp = tmp_path_factory.mktemp("serve-remote")
    with ValkeyNode(tmp / "valkey") as node:
        a = start(tmp, "a", node.url, "--remote-prefix", "t", "--metrics-port", "0")
        b = start(tmp, "b", node.url, "--remote-prefix", "t")
        try:
            yield node, a, b
        finally:
            for srv in (a, b):
                assert srv.stop() == 0, srv.log()


@pytest.fixture
def nodes(
    shared: tuple[ValkeyNode, Serve, Serve], request: pytest.FixtureRequest
) -> Iterator[tuple[Node, Node]]:
    """A tiny engine on each of the shared servers, in a namespace of this test's own."""
    _, a_srv, b_srv = shared
    # An earlier test may have killed or hung the store: wait until both servers found it again.
    assert until(lambda: remote(a_srv)["state"] == remote(b_srv)["state"] == "healthy", 60)
    ns = namespace(model=request.node.name)
    a, b = Node(a_srv, ns), Node(b_srv, ns)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def valkey_node(shared: tuple[ValkeyNode, Serve, Serve]) -> ValkeyNode:
    """The shared servers' store (this module's own ``valkey_node``)."""
    return shared[0]


def wrote(since: Since, n: int) -> None:
    """Wait until the server of ``since`` has written ``n`` more chunks."""
    assert until(lambda: since()["remote.written"] >= n), since()


def new_keys(node: ValkeyNode, before: set[bytes]) -> set[bytes]:
    return set(node.client().keys("t:*")) - before


# -- configuration ------------------------------------------------------------------------------


def serve_once(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    sock = private_dir(tmp, f"cfg{time.monotonic_ns()}") / "kv.sock"
    return subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", str(sock), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--remote", "valkey://lmcache:s3cret-pw@127.0.0.1:6379/0"], "password in the URL"),
        (["--remote-prefix", "x"], "--remote-prefix needs --remote"),
        (["--remote", "nosuch://127.0.0.1:1"], "no installed remote store serves the URL scheme 'nosuch'"),
        (["--remote", "valkey://127.0.0.1:1", "--remote-password-env", "NO_SUCH_VAR_X"], "NO_SUCH_VAR_X"),
        (["--remote", "valkey://127.0.0.1:1", "--remote-prefix", "a{b}"], "remote prefix 'a{b}'"),
        (
            ["--remote", "valkey://127.0.0.1:1", "--remote-option", "speed=11"],
            "unknown Valkey store settings",
        ),
        (["--remote", "valkey://127.0.0.1:1", "--remote-option", "speed"], "expected KEY=VALUE"),
        (["--remote", "valkey://127.0.0.1:1", "--remote-key-file", "/nonexistent/key"], "remote key file"),
    ],
    ids=["password", "no-url", "scheme", "password-env", "prefix", "option", "option-form", "key-file"],
)
def test_a_remote_configuration_error_stops_serve_with_one_line(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    out = serve_once(tmp_path, *flags)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "cannot start: remote tier" in lines[0] and says in lines[0]
    assert "s3cret-pw" not in out.stderr  # the refused URL's password is never echoed


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (
            "/tmp/kv",
            "remote URL '/tmp/kv': a directory is file:///tmp/kv (three slashes, then the absolute path)",
        ),
        (
            "file:/tmp/kv",
            "remote URL 'file:/tmp/kv': a directory is file:///tmp/kv (three slashes, then the absolute path)",
        ),
        (
            "file://tmp/kv",
            "remote URL file://tmp/kv: a file store takes no host: file:///tmp/kv (three slashes; "
            "a shared file system is mounted, not addressed)",
        ),
        (
            "nosuch://127.0.0.1:1",
            "no installed remote store serves the URL scheme 'nosuch' (installed: file, valkey, "
            "valkey+cluster, valkeys, valkeys+cluster); a store is a distribution advertising its scheme "
            "in the lmcache.remote entry-point group (see docs/remote-stores.md); `lmcache-platform list` "
            "shows the installed ones",
        ),
    ],
    ids=["path", "file-one-slash", "file-two-slashes", "unknown-scheme"],
)
def test_a_remote_url_mistake_is_one_line_with_the_fix(tmp_path: Path, url: str, says: str) -> None:
    out = serve_once(tmp_path, "--json-log", "--remote", url)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert json.loads(lines[0])["message"] == f"cannot start: remote tier: {says}"


def test_durations_and_sizes_are_checked_by_the_parser(tmp_path: Path) -> None:
    for flags in (["--remote-ttl", "0"], ["--remote-ttl", "1y"], ["--remote-queue-bytes", "lots"]):
        out = serve_once(tmp_path, "--remote", "valkey://127.0.0.1:1", *flags)
        assert out.returncode == 2 and flags[0] in out.stderr, out.stderr


def test_a_store_down_at_start_is_no_obstacle(tmp_path: Path) -> None:
    # Nothing listens there: serve starts, serves locally, and says once that the store is down.
    srv = Serve(
        private_dir(tmp_path) / "kv.sock",
        "--json-log",
        "--remote",
        "valkey://127.0.0.1:1",
        "--remote-ttl",
        "2h",
    )
    with srv:
        node = Node(srv)
        try:
            assert node.put(KEYS[:2]).stored == 2
            assert node.lookup(KEYS[:3]) == {"hits": 2, "remote": 0}
            assert node.get(KEYS[:2]) == 2 and node.holds(KEYS[:2]) == [True, True]
            assert until(lambda: remote(srv)["state"] == "down")
        finally:
            node.close()
        assert srv.stop() == 0
    assert len(events(srv, "remote_down")) == 1


# -- two nodes ----------------------------------------------------------------------------------


def test_node_b_loads_what_node_a_stored(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    sa, sb = Since(a.srv), Since(b.srv)
    assert a.put(KEYS[:4]).stored == 4
    wrote(sa, 4)
    assert b.lookup(KEYS[:6]) == {"hits": 4, "remote": 4}
    assert b.get(KEYS[:4]) == 4 and b.holds(KEYS[:4]) == [True] * 4  # the very bytes A stored
    # Now B holds them itself: a lookup answers without the store.
    assert b.lookup(KEYS[:4]) == {"hits": 4, "remote": 0}
    db = sb()
    assert (db["remote_hits"], db["remote_loaded"], db["get_missing"], db["chunks"]) == (4, 4, 0, 4)
    assert (db["remote.fetched"], db["remote.bytes_fetched"], db["remote.queued"]) == (4, 4 * CHUNK_BYTES, 0)
    assert sa()["remote.written"] == 4 and sa()["remote_loaded"] == 0  # B wrote nothing back


def test_a_lookup_adds_remote_hits_after_local_ones(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    sa, sb = Since(a.srv), Since(b.srv)
    a.put(KEYS[:6])
    wrote(sa, 6)
    b.put(KEYS[:2])  # B computed the first two itself (the same bytes: same seed)
    assert b.lookup(KEYS[:8]) == {"hits": 6, "remote": 4}
    assert b.get(KEYS[:6]) == 6 and b.holds(KEYS[:6]) == [True] * 6
    assert sb()["remote.fetched"] == 4


def test_another_namespace_or_deployment_gets_nothing(nodes: tuple[Node, Node], tmp_path: Path) -> None:
    a, b = nodes
    sa = Since(a.srv)
    a.put(KEYS[:3])
    wrote(sa, 3)
    other = Node(b.srv, a.ns[::-1])  # another model or layout: another namespace
    c_srv = start(tmp_path, "c", _url_of(a.srv), "--remote-prefix", "u")  # another deployment
    c = Node(c_srv, a.ns)
    try:
        assert other.lookup(KEYS[:3]) == {"hits": 0, "remote": 0} and other.get(KEYS[:3]) == 0
        assert c.lookup(KEYS[:3]) == {"hits": 0, "remote": 0} and c.get(KEYS[:3]) == 0
        assert other.engine.is_zero(0) and c.engine.is_zero(0)
    finally:
        other.close()
        shut(c)


def _url_of(srv: Serve) -> str:
    args = srv.proc.args
    assert isinstance(args, list)
    return str(args[args.index("--remote") + 1])


def test_local_eviction_no_longer_loses_a_chunk_the_store_holds(
    tmp_path: Path, valkey_node: ValkeyNode
) -> None:
    srv = start(
        tmp_path, "small", valkey_node.url, "--remote-prefix", "t", "--max-host-bytes", str(4 * CHUNK_BYTES)
    )
    ns = namespace(model="eviction")
    node = Node(srv, ns)
    try:
        for i in range(0, 16, 4):  # each put evicts the one before
            assert node.put(KEYS[i : i + 4]).stored == 4
        written(srv, 16)
        s = counters(srv)
        assert s["chunks"] == 4 and s["evictions"] == 12
        assert node.lookup(KEYS[:16]) == {"hits": 16, "remote": 16}
        fresh = Node(srv, ns)  # another engine of the namespace loads all sixteen, four at a time
        try:
            for i in range(0, 16, 4):
                assert fresh.get(KEYS[i : i + 4]) == 4 and fresh.holds(KEYS[i : i + 4]) == [True] * 4
        finally:
            fresh.close()
    finally:
        shut(node)


def test_a_chunk_gone_between_lookup_and_get_is_not_written_and_is_counted(
    nodes: tuple[Node, Node], valkey_node: ValkeyNode
) -> None:
    a, b = nodes
    sa, sb = Since(a.srv), Since(b.srv)
    before = set(valkey_node.client().keys("t:*"))
    a.put(KEYS[:4])
    wrote(sa, 4)
    mine = new_keys(valkey_node, before)
    assert b.lookup(KEYS[:4]) == {"hits": 4, "remote": 4}  # not pinned: the store has no leases
    gone = [k for k in mine if k.endswith((KEYS[2].hex().encode(), KEYS[3].hex().encode()))]
    valkey_node.client().delete(*gone)  # flushed, evicted or expired meanwhile
    assert b.get(KEYS[:4]) == 2 and b.holds(KEYS[:2]) == [True, True]
    assert b.engine.is_zero(2) and b.engine.is_zero(3)  # nothing past the run was written
    d = sb()
    assert (d["get_missing"], d["remote.fetch_misses"], d["remote_loaded"]) == (2, 2, 2)


# -- the trust boundary -------------------------------------------------------------------------


def test_bad_entries_in_the_store_are_refused_counted_and_never_written(
    nodes: tuple[Node, Node], valkey_node: ValkeyNode
) -> None:
    a, b = nodes
    raw = valkey_node.client()
    sa, sb = Since(a.srv), Since(b.srv)
    before = set(raw.keys("t:*"))
    other = Node(a.srv, a.ns[::-1])  # the same keys in another namespace, for a foreign entry
    try:
        other.put(KEYS[:5], seed=50)
    finally:
        other.close()
    wrote(sa, 5)
    foreign_keys = new_keys(valkey_node, before)
    a.put(KEYS[:5])
    wrote(sa, 10)
    mine = new_keys(valkey_node, before | foreign_keys)
    assert len(mine) == 5 and len({k.split(b":")[1] for k in mine}) == 1  # one remote namespace
    key_of = {i: next(k for k in mine if k.endswith(KEYS[i].hex().encode())) for i in range(5)}
    foreign = next(k for k in foreign_keys if k.endswith(KEYS[2].hex().encode()))
    entry = bytearray(raw.get(key_of[0]))
    entry[-1] ^= 0x01
    raw.set(key_of[0], bytes(entry))  # one flipped bit in the payload
    raw.set(key_of[1], raw.get(key_of[1])[:-64])  # a truncated write
    raw.set(key_of[2], raw.get(foreign))  # another namespace's chunk under this key
    raw.set(key_of[3], raw.get(key_of[4]))  # another key's chunk
    raw.set(key_of[4], b"\x80\x04\x95" + b"x" * 200)  # not an entry at all (a pickle is never loaded)
    logged = len(events(b.srv, "remote_refused"))
    for i, reason in enumerate(("checksum", "truncated", "namespace", "key", "magic")):
        assert b.lookup([KEYS[i]])["remote"] == 1  # a lookup only asks whether the key is there
        assert b.get([KEYS[i]]) == 0 and b.engine.is_zero(0), reason
        assert sb()[f"remote.refused_{reason}"] == 1, sb()
    d = sb()
    assert (d["get_missing"], d["remote_loaded"], d["chunks"], d["errors"]) == (5, 0, 0, 0)
    assert 0 <= len(events(b.srv, "remote_refused")) - logged <= 1  # one line per 10 s, not one per entry


def test_a_keyed_deployment_refuses_entries_of_writers_without_its_key(
    tmp_path: Path, valkey_node: ValkeyNode, nodes: tuple[Node, Node]
) -> None:
    plain, _ = nodes  # the shared server ``a``: an unkeyed writer
    key = tmp_path / "remote.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    flags = ("--remote-prefix", "t", "--remote-key-file", str(key))
    ka = Node(start(tmp_path, "ka", valkey_node.url, *flags), plain.ns)
    kb = Node(start(tmp_path, "kb", valkey_node.url, *flags), plain.ns)
    try:
        s_plain, s_ka, s_kb = Since(plain.srv), Since(ka.srv), Since(kb.srv)
        ka.put(KEYS[:2])
        plain.put(KEYS[2:4])  # its entries are not the deployment's
        wrote(s_ka, 2)
        wrote(s_plain, 2)
        assert kb.get(KEYS[:2]) == 2 and kb.holds(KEYS[:2]) == [True, True]
        assert kb.get(KEYS[2:4]) == 0 and s_kb()["remote.refused_auth"] == 2  # both entries were checked
        before = s_plain()["remote.refused_auth"]
        other = Node(plain.srv, plain.ns)
        try:
            assert other.get(KEYS[:2]) == 0 and s_plain()["remote.refused_auth"] - before == 2
        finally:
            other.close()
        assert any(e.get("keyed") for e in events(ka.srv, "remote"))
    finally:
        shut(ka, kb)


# -- failures: every request completes, the counters say what happened -------------------------


def test_remote_killed_mid_run_then_restarted(nodes: tuple[Node, Node], valkey_node: ValkeyNode) -> None:
    a, b = nodes
    sa, sb = Since(a.srv), Since(b.srv)
    logged = {n: (len(events(n.srv, "remote_down")), len(events(n.srv, "remote_up"))) for n in (a, b)}
    a.put(KEYS[:4])
    wrote(sa, 4)
    valkey_node.kill()
    for i in range(5):  # puts, lookups and gets all answer; only local chunks are served
        assert a.put(KEYS[10 + 2 * i : 12 + 2 * i]).stored == 2
        assert a.lookup(KEYS[:4]) == {"hits": 4, "remote": 0}
        assert b.lookup(KEYS[:4]) == {"hits": 0, "remote": 0}
        assert b.get(KEYS[:4]) == 0
    da, db = sa(), sb()
    assert remote(a.srv)["state"] == "down" and remote(b.srv)["state"] == "down", (da, db)
    assert da["remote.dropped_down"] >= 1 and db["remote.skipped"] >= 1, (da, db)
    valkey_node.restart()  # empty: nothing was persisted
    assert until(lambda: remote(a.srv)["state"] == "healthy" and remote(b.srv)["state"] == "healthy", 60)
    a.put(KEYS[20:22])
    wrote(sa, 6)
    assert b.get(KEYS[20:22]) == 2 and b.holds(KEYS[20:22]) == [True, True]
    for n in (a, b):
        down, up = logged[n]
        assert len(events(n.srv, "remote_down")) == down + 1, n.srv.log()
        assert len(events(n.srv, "remote_up")) == up + 1, n.srv.log()
    assert sa()["errors"] == 0 and sb()["errors"] == 0  # no request failed for it


def test_remote_restarted_in_the_middle_of_writes(nodes: tuple[Node, Node], valkey_node: ValkeyNode) -> None:
    """Valkey restarts while a stream of puts is being written: every put answers, what B
    loads afterwards is exactly what A stored, and the tier comes back by itself."""
    a, b = nodes
    sa = Since(a.srv)
    stop, answered, failures = threading.Event(), [], []

    def stream() -> None:
        i = 0
        while not stop.is_set():
            keys = [bytes([j % 250 + 1, j // 250 + 1]) * 16 for j in (2 * i, 2 * i + 1)]  # new each time
            try:
                answered.append(a.put(keys).stored)
            except Exception as exc:  # a put that raised fails the test below, with its reason
                failures.append(exc)
            i += 1

    writer = threading.Thread(target=stream)
    writer.start()
    try:
        assert until(lambda: len(answered) >= 5)
        valkey_node.restart()  # mid-write: the batch in flight and the queue are dropped and counted
        assert until(lambda: remote(a.srv)["state"] == "healthy", 60)
        seen = len(answered)
        assert until(lambda: len(answered) >= seen + 5)
    finally:
        stop.set()
        writer.join(60)
    assert not failures and answered and all(n == 2 for n in answered), (failures, answered[:10])
    assert a.put(KEYS[190:192]).stored == 2
    assert until(lambda: b.get(KEYS[190:192]) == 2), remote(b.srv)
    assert b.holds(KEYS[190:192]) == [True, True]
    streamed = [bytes([j % 250 + 1, j // 250 + 1]) * 16 for j in range(2 * len(answered))]
    for at in range(0, len(streamed), 8):  # whatever the store kept is whole: every byte right
        batch = streamed[at : at + 8]
        b.get(batch)
        assert all(b.engine.holds(i, k[0]) or b.engine.is_zero(i) for i, k in enumerate(batch))
    d = sa()
    assert d["errors"] == 0 and d["remote.written"] >= 1, d


def test_a_hung_remote_costs_a_request_part_of_its_deadline_and_no_error(
    nodes: tuple[Node, Node], valkey_node: ValkeyNode
) -> None:
    a, b = nodes
    sa, sb = Since(a.srv), Since(b.srv)
    a.put(KEYS[:3])
    wrote(sa, 3)
    valkey_node.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        slow = Node(b.srv, b.ns, deadline_ms=1500)
        try:
            for _ in range(3):
                assert slow.lookup(KEYS[:3])["hits"] == 0 and slow.get(KEYS[:3]) == 0
        finally:
            slow.close()
        d = sb()
        assert d["remote.timeouts"] >= 1 and d["remote.fetched"] == 0
        assert until(lambda: remote(b.srv)["state"] == "down")  # the probe's ping failed too
    finally:
        valkey_node.resume()
    assert until(lambda: remote(b.srv)["state"] == "healthy", 60)
    assert b.get(KEYS[:3]) == 3 and b.holds(KEYS[:3]) == [True] * 3
    assert sb()["deadline_drops"] == 0 and sb()["errors"] == 0


def test_a_flushed_remote_means_misses(nodes: tuple[Node, Node], valkey_node: ValkeyNode) -> None:
    a, b = nodes
    sa, sb = Since(a.srv), Since(b.srv)
    a.put(KEYS[:3])
    wrote(sa, 3)
    valkey_node.client().flushall()
    assert b.lookup(KEYS[:3]) == {"hits": 0, "remote": 0}
    assert b.get(KEYS[:3]) == 0
    assert a.lookup(KEYS[:3]) == {"hits": 3, "remote": 0}  # A's own copies are untouched
    d = sb()
    assert d["remote.misses"] == 3 and d["remote.fetch_misses"] == 3 and d["get_missing"] == 3
    assert remote(b.srv)["state"] == "healthy"


def test_a_remote_at_its_memory_limit_refuses_or_evicts(tmp_path: Path) -> None:
    with ValkeyNode(tmp_path / "full", config=["maxmemory 3mb", "maxmemory-policy noeviction"]) as node:
        a = Node(start(tmp_path, "fa", node.url, "--remote-timeout-ms", "5000"))
        b = Node(start(tmp_path, "fb", node.url))

        def fill(round: int, policy: str) -> None:
            node.client().config_set("maxmemory-policy", policy)
            if policy != "noeviction":  # the tier degraded in the first round: a trial write heals it
                trial = iter(bytes([i, 200 + round]) * 16 for i in range(1, 200))
                healed = until(
                    lambda: a.put([next(trial)]).stored == 1 and remote(a.srv)["state"] == "healthy"
                )
                assert healed, f"{policy}: the tier did not heal: {remote(a.srv)}"
            sa, sb = Since(a.srv), Since(b.srv)
            keys = [bytes([i % 250 + 1, i // 250 + 1 + 10 * round]) * 16 for i in range(1600)]  # 2 KiB each
            for i in range(0, len(keys), 16):
                put = a.put(keys[i : i + 16])
                assert put.stored == 16, f"{policy}: batch {i // 16}: {put}; {sa()}"
            assert until(lambda: settled(sa) == 1600, 120), sa()  # 1,600 writes behind, on a busy host
            da, evicted = sa(), int(node.client().info()["evicted_keys"])
            seen = f"{policy}: {evicted} evicted, state {remote(a.srv)['state']}, {da}"
            if policy == "noeviction":  # the store refuses what does not fit: counted, then degraded
                assert da["remote.write_errors"] > 0 and remote(a.srv)["state"] == "degraded", seen
                assert settled(sa) == 1600 and da["remote.dropped_degraded"] > 0, seen
            else:  # the store makes room: old entries go whole
                assert evicted > 0 and da["remote.write_errors"] == 0 and da["remote.written"] == 1600, seen
            got = [b.get(keys[i : i + 16]) for i in range(0, len(keys), 16)]  # every get answers
            assert sum(got) > 0 and sb()["errors"] == 0 and da["errors"] == 0, f"{seen}; B: {sb()}; got {got}"
            print(
                f"\n{policy}: {da['remote.written']} written, {da['remote.write_errors']} refused, {evicted} evicted"
            )

        try:
            for round, policy in enumerate(("noeviction", "allkeys-lru")):
                fill(round, policy)
        finally:
            shut(a, b)


# -- status and metrics -------------------------------------------------------------------------


def test_status_and_metrics_report_the_tier(nodes: tuple[Node, Node], valkey_node: ValkeyNode) -> None:
    a, _ = nodes
    sa = Since(a.srv)
    a.put(KEYS[:2])
    wrote(sa, 2)
    url = str(next(e for e in a.srv.events() if e["event"] == "metrics")["url"])
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    written_now = remote(a.srv)["written"]
    assert f'lmcache_platform_server_remote_up{{store="{valkey_node.url}"}} 1' in text
    assert f"lmcache_platform_server_remote_written_total {written_now}" in text
    assert 'lmcache_platform_server_remote_refused_total{reason="checksum"}' in text
    assert 'lmcache_platform_server_remote_dropped_total{reason="full"}' in text
    assert "# TYPE lmcache_platform_server_chunks_missing_total counter" in text
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "status", "--socket", str(a.srv.socket_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines()[1:])
    assert rows["remote.state"] == "healthy" and rows["remote.written"] == str(written_now), out.stdout
    assert rows["remote.store"] == valkey_node.url and "remote_hits" in rows
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_platform._cli",
            "status",
            "--json",
            "--socket",
            str(a.srv.socket_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(out.stdout)["remote"]["written"] == written_now

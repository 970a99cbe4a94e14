"""The reference server in a real spawned process, over its real UNIX socket.

The engine side is this test process: real CPU tensors, wrapped into real POSIX
shared memory by the installed cpu backend. Every error path is driven over the
socket, and after each error the server is shown to keep serving.
"""

from __future__ import annotations

import os
import pickle
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import lmcache_platform
from lmcache_platform import KVFormat, LayoutHints, WireFormatError, wire
from lmcache_platform.protocol import _messages as P
from lmcache_platform.server import ReferenceServer, ServerClient, ServerError, ServerProcess

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 32, 4, 2, 8
CHUNK = 8  # tokens: two blocks per chunk
HOST_CAP = 64 << 10
HINTS = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=BLOCK, num_kv_heads=HEADS)


@pytest.fixture(scope="module", autouse=True)
def named_segments() -> Iterator[None]:
    """These cases name /dev/shm segments: export with the cpu backend's ``shm`` kind."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMCACHE_PLATFORM_CPU_IPC", "shm")
        lmcache_platform.refresh()
        yield
    lmcache_platform.refresh()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(max_host_bytes=HOST_CAP) as proc:
        yield proc


class Engine:
    """Paged KV caches of a tiny model, in shared memory, with their wrappers."""

    def __init__(self) -> None:
        shape = (2, BLOCKS, BLOCK, HEADS, HEAD)
        n = 2 * BLOCKS * BLOCK * HEADS * HEAD
        self.tensors = [
            (torch.arange(n, dtype=torch.int32) * 7 + layer * 1000003).to(torch.float32).view(shape)
            for layer in range(LAYERS)
        ]
        self.original = [t.clone() for t in self.tensors]
        self.wrappers = lmcache_platform.wrap_kv_caches(self.tensors)
        self.segments = [w.shm_name for w in self.wrappers]  # type: ignore[attr-defined]

    def block(self, layer: int, b: int, source: list[torch.Tensor] | None = None) -> torch.Tensor:
        return (source or self.tensors)[layer][:, b]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors]

    def unchanged_since(self, snap: list[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.tensors, snap, strict=True))


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = Engine()
    yield eng
    for w in eng.wrappers:
        w.close()  # the producer's last wrapper unlinks the segment
    assert not [s for s in eng.segments if os.path.exists(f"/dev/shm/{s}")], "segments leaked"


@pytest.fixture
def client(server: ServerProcess) -> Iterator[ServerClient]:
    with ServerClient(server.socket_path, timeout=60) as c:
        yield c


def register(client: ServerClient, engine: Engine) -> int:
    return client.register(engine.wrappers, lmcache_tokens_per_chunk=CHUNK, layout_hints=HINTS).context


@contextmanager
def refused(match: str, remote_type: str | None = None) -> Iterator[None]:
    """The block must raise ServerError matching ``match``, from ``remote_type`` on the server."""
    with pytest.raises(ServerError, match=match) as info:
        yield
    if remote_type is not None:
        assert info.value.remote_type == remote_type, info.value


def assert_serving(client: ServerClient) -> None:
    assert client.status()["server"]["pid"] > 0


# -- the happy path -------------------------------------------------------------------


def test_round_trip_moves_exact_bytes_into_other_blocks(client: ServerClient, engine: Engine) -> None:
    reg = client.register(engine.wrappers, lmcache_tokens_per_chunk=CHUNK, layout_hints=HINTS)
    assert reg.device_type == "cpu" and reg.num_layers == LAYERS
    assert reg.backend["name"] == "cpu" and reg.backend["distribution"] == "lmcache-platform-cpu"
    expected_chunk = LAYERS * 2 * CHUNK * HEADS * HEAD * 4
    assert reg.chunk_bytes == expected_chunk

    stored = client.store(reg.context, [("a", [[0, 1]]), ("b", [[5, 2]])])
    assert stored == 2 * expected_chunk
    for t in engine.tensors:
        t.zero_()
    assert client.retrieve(reg.context, [("a", [[10, 11]]), ("b", [[13, 12]])]) == stored
    for layer in range(LAYERS):
        for src, dst in [(0, 10), (1, 11), (5, 13), (2, 12)]:
            assert torch.equal(engine.block(layer, dst), engine.block(layer, src, engine.original))
        others = [b for b in range(BLOCKS) if b not in (10, 11, 12, 13)]
        assert not engine.tensors[layer][:, others].any(), "a block outside the request changed"

    status = client.status(reg.context)
    assert status["context"]["num_layers"] == LAYERS and status["context"]["stored_chunks"] == 2
    assert status["context"]["kernel_groups"][0]["kv_format"] == "flash_attn"
    client.unregister(reg.context)


def test_socket_is_private(server: ServerProcess) -> None:
    assert server.directory is not None
    assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
    st = os.stat(server.socket_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_restoring_a_chunk_id_replaces_it(client: ServerClient, engine: Engine) -> None:
    ctx = register(client, engine)
    client.store(ctx, [("a", [[0, 1]])])
    client.store(ctx, [("a", [[3, 4]])])
    assert client.status(ctx)["context"]["stored_chunks"] == 1
    client.retrieve(ctx, [("a", [[20, 21]])])
    assert torch.equal(engine.block(0, 20), engine.block(0, 3, engine.original))


# -- bad frames and bad messages ------------------------------------------------------


def test_oversized_frame_gets_an_error_then_the_connection_closes(
    server: ServerProcess, client: ServerClient
) -> None:
    with ServerClient(server.socket_path, timeout=30) as bad:
        bad._sock.sendall(struct.pack(">I", P.MAX_FRAME_BYTES + 1))
        reply = bad.recv_reply()
        assert not reply.ok and reply.error_type == "WireFormatError"
        assert "exceeds the limit" in reply.error_message
        assert P.recv_frame(bad._sock) is None  # the server hung up: the stream is out of sync
    assert_serving(client)


def test_frame_cut_short_by_a_disconnect(server: ServerProcess, client: ServerClient) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(server.socket_path)
    raw.sendall(struct.pack(">I", 100) + b"only part")
    raw.close()
    assert_serving(client)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"garbage", "header"),
        (pickle.dumps({"op": "shutdown", "id": 1}), "pickle"),
        (P.MAGIC + bytes([P.VERSION]) + b"\xc1", "malformed"),
        (P.MAGIC + bytes([P.VERSION + 1]) + b"\x80", "version"),
    ],
)
def test_bad_message_gets_an_error_and_the_connection_stays_usable(
    client: ServerClient, payload: bytes, match: str
) -> None:
    client.send_raw(payload)
    reply = client.recv_reply()
    assert not reply.ok and reply.error_type == "WireFormatError" and match in reply.error_message
    assert_serving(client)


def test_invalid_request_is_answered_with_its_id(client: ServerClient) -> None:
    import msgpack

    client.send_raw(P.MAGIC + bytes([P.VERSION]) + msgpack.packb({"op": "frobnicate", "id": 77}))
    reply = client.recv_reply()
    assert (reply.ok, reply.request_id) == (False, 77)
    assert "unknown op 'frobnicate'" in reply.error_message
    assert_serving(client)


def test_pickled_wrappers_are_refused_at_registration(client: ServerClient, engine: Engine) -> None:
    fields = [w.fields() for w in engine.wrappers]
    with refused("pickle", "WireFormatError"):
        client.call("register", wrappers=pickle.dumps(fields), config={})
    assert_serving(client)


def test_unknown_device_type_and_tag_are_refused(client: ServerClient, engine: Engine) -> None:
    import msgpack

    def blob(device: str, tag: str) -> bytes:
        records = [[device, tag, w.fields()] for w in engine.wrappers]
        return wire.MAGIC + bytes([1]) + msgpack.packb(records, use_bin_type=True)  # one wrapper a record

    with refused("'npu' is not served", "WireFormatError"):
        client.call("register", wrappers=blob("npu", "npu.ipc/1"), config={})
    with refused("'cpu.evil/1' is not accepted", "WireFormatError"):
        client.call("register", wrappers=blob("cpu", "cpu.evil/1"), config={})
    assert_serving(client)


def test_descriptor_outside_our_prefix_is_refused(client: ServerClient, engine: Engine) -> None:
    fields = engine.wrappers[0].fields()
    fields["shm_name"] = "../../etc/passwd"
    import msgpack

    blob = wire.MAGIC + bytes([1]) + msgpack.packb([["cpu", "cpu.shm/1", fields]])  # version 1 record
    with refused("not a segment of this project", "WireFormatError"):
        client.call("register", wrappers=blob, config={})


def test_missing_segment_is_refused(client: ServerClient, engine: Engine) -> None:
    """A well-formed name of a segment that does not exist: the server stays up."""
    w = engine.wrappers[0]
    name = w.shm_name[:-32] + "0" * 32  # type: ignore[attr-defined]
    ghost = type(w)(**{**w.fields(), "dtype": w.dtype, "shm_name": name})
    assert wait_for(client, "connections", 1) == 1  # earlier tests' contexts closed with their connections
    before = client.status()["server"]["contexts"]
    with refused("does not exist", "DescriptorError"):
        client.register([ghost], lmcache_tokens_per_chunk=CHUNK, layout_hints=HINTS)
    assert client.status()["server"]["contexts"] == before
    assert_serving(client)


def test_unusable_layout_is_refused(client: ServerClient) -> None:
    tensors = [torch.zeros(7, 3)]  # not a paged KV layout
    wrappers = lmcache_platform.wrap_kv_caches(tensors)
    try:
        with refused("register refused", "LayoutError"):
            client.register(wrappers, lmcache_tokens_per_chunk=CHUNK)
    finally:
        for w in wrappers:
            w.close()
    assert_serving(client)


# -- bad transfers: refused before anything is written ------------------------------------


def test_unknown_context(client: ServerClient) -> None:
    for op in ("store", "retrieve"):
        with refused("unknown context 999", "TransferError"):
            client.call(op, context=999, chunks=[P.Chunk("a", ((0, 1),))])
    with refused("unknown context 999", "TransferError"):
        client.unregister(999)
    with refused("unknown context 999", "TransferError"):
        client.status(999)


def test_contexts_are_private_to_their_connection(
    server: ServerProcess, client: ServerClient, engine: Engine
) -> None:
    ctx = register(client, engine)
    with (
        ServerClient(server.socket_path, timeout=30) as other,
        refused(f"unknown context {ctx}", "TransferError"),
    ):
        other.store(ctx, [("a", [[0, 1]])])
    client.store(ctx, [("a", [[0, 1]])])


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([("a", [[0, BLOCKS]])], f"block id {BLOCKS} at position 1 is out of range"),
        ([("ok", [[0, 1]]), ("a", [[0, 10**9]])], "chunk 1 \\('a'\\).*out of range"),
        ([("a", [[0]])], "need 2 block ids, got 1"),
        ([("a", [[0, 1, 2]])], "need 2 block ids, got 3"),
        ([("a", [[0, 1], [2, 3]])], "expected block ids for 1 engine group"),
        ([("a", [[0, 1]]), ("a", [[2, 3]])], "appears twice"),
        (
            [("a", [[0, -1]])],
            "engine group 0: block id -1 \\(skip\\) at position 1 is allowed only in a retrieve",
        ),
    ],
)
def test_bad_store_writes_nothing(
    client: ServerClient, engine: Engine, chunks: list[Any], match: str
) -> None:
    ctx = register(client, engine)
    with refused(match, "TransferError"):
        client.store(ctx, chunks)
    assert client.status(ctx)["context"]["stored_chunks"] == 0
    client.store(ctx, [("fine", [[0, 1]])])  # the context still works


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([("a", [[20, 21]]), ("missing", [[22, 23]])], "unknown chunk ids \\['missing'\\]"),
        ([("a", [[20, 21]]), ("a", [[22, -2]])], "is outside|out of range"),
        ([("a", [[20, 21]]), ("a", [[22, BLOCKS + 5]])], "chunk 1 \\('a'\\).*out of range"),
        ([("a", [[20, 21]]), ("a", [[22]])], "need 2 block ids"),
        ([("a", [[20, 20]])], "repeat"),
        # A repeated block in the *last* chunk is refused before the first chunk is written.
        ([("a", [[20, 21]]), ("a", [[22, 22]])], "chunk 1 \\('a'\\).*repeat"),
    ],
)
def test_bad_retrieve_writes_nothing(
    client: ServerClient, engine: Engine, chunks: list[Any], match: str
) -> None:
    ctx = register(client, engine)
    client.store(ctx, [("a", [[0, 1]])])
    snap = engine.snapshot()
    with pytest.raises((ServerError, WireFormatError), match=match):
        client.retrieve(ctx, chunks)
    assert engine.unchanged_since(snap), "a refused retrieve wrote into the engine's blocks"
    client.retrieve(ctx, [("a", [[20, 21]])])
    assert torch.equal(engine.block(1, 21), engine.block(1, 1, engine.original))


def test_host_memory_cap_refuses_the_whole_store(client: ServerClient, engine: Engine) -> None:
    assert wait_for(client, "host_bytes", 0) == 0, "earlier tests' connections were not cleaned up"
    ctx = register(client, engine)
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * HEAD * 4
    too_many = HOST_CAP // chunk_bytes + 1
    with refused("exceeds the server's host memory", "TransferError"):
        client.store(ctx, [(f"c{i}", [[0, 1]]) for i in range(too_many)])
    assert client.status(ctx)["context"]["stored_chunks"] == 0
    client.store(ctx, [(f"c{i}", [[0, 1]]) for i in range(too_many - 1)])


# -- lifetimes ------------------------------------------------------------------------------


def wait_for(client: ServerClient, key: str, expected: int) -> int:
    """Poll (bounded) the server's ``key`` counter: it frees a disconnected client's
    contexts asynchronously, on that client's thread."""
    deadline = time.monotonic() + 30
    while True:
        n = int(client.status()["server"][key])
        if n == expected or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_unregister_closes_the_context(client: ServerClient, engine: Engine) -> None:
    ctx = register(client, engine)
    client.store(ctx, [("a", [[0, 1]])])
    client.unregister(ctx)
    with refused(f"unknown context {ctx}", "TransferError"):
        client.retrieve(ctx, [("a", [[2, 3]])])
    with refused(f"unknown context {ctx}", "TransferError"):
        client.unregister(ctx)


def test_disconnect_closes_that_clients_contexts(
    server: ServerProcess, client: ServerClient, engine: Engine
) -> None:
    assert wait_for(client, "connections", 1) == 1  # earlier tests' contexts closed with their connections
    baseline = int(client.status()["server"]["contexts"])
    mine = register(client, engine)
    with ServerClient(server.socket_path, timeout=30) as other:
        theirs = register(other, engine)
        other.store(theirs, [("x", [[0, 1]])])
        assert int(client.status()["server"]["contexts"]) == baseline + 2
    assert wait_for(client, "contexts", baseline + 1) == baseline + 1
    client.store(mine, [("still", [[0, 1]])])  # the remaining client is unaffected


def test_a_connection_the_server_no_longer_counts_holds_no_fd(
    server: ServerProcess, client: ServerClient
) -> None:
    """Leak checks wait for ``connections`` to drop, then count fds: the two must agree."""
    fd_dir = f"/proc/{server.pid}/fd"
    assert wait_for(client, "connections", 1) == 1
    fds = len(os.listdir(fd_dir))
    for _ in range(20):
        with ServerClient(server.socket_path, timeout=30) as other:
            assert int(other.status()["server"]["connections"]) == 2
        assert wait_for(client, "connections", 1) == 1
        assert len(os.listdir(fd_dir)) == fds


def test_shutdown_stops_the_process_and_removes_the_socket(engine: Engine) -> None:
    proc = ServerProcess().start()
    try:
        directory, path = proc.directory, proc.socket_path
        with ServerClient(path, timeout=30) as c:
            register(c, engine)
            c.shutdown()
        assert proc._process is not None
        proc._process.join(30)
        assert proc._process.exitcode == 0
        assert not os.path.exists(path)
    finally:
        proc.stop()
    assert directory is not None and not os.path.exists(directory)


def test_stop_without_a_shutdown_request_also_cleans_up() -> None:
    proc = ServerProcess().start()
    directory, pid = proc.directory, proc.pid
    proc.stop()
    proc.stop()  # idempotent
    assert directory is not None and not os.path.exists(directory)
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_refuses_a_socket_directory_others_can_enter(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        ReferenceServer(str(loose / "kv.sock")).bind()
    assert not (loose / "kv.sock").exists()


def test_a_server_that_cannot_start_says_why_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 100)  # a UNIX socket path must fit in 108 bytes
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    proc = ServerProcess(start_timeout=60)
    with pytest.raises(ServerError, match="failed to start: OSError"):
        proc.start()
    assert list(deep.iterdir()) == [], "the private directory survived a failed start"
    assert proc.pid is None


def test_connections_beyond_the_cap_are_refused_with_an_error_reply() -> None:
    """Each connection may pin one announced frame buffer, so their number is bounded."""
    import os
    import socket
    import tempfile
    import threading
    import time

    from lmcache_platform.protocol import _messages as P
    from lmcache_platform.server import ReferenceServer

    directory = tempfile.mkdtemp(prefix="lmcache-cap-")  # 0700, as the server requires
    server = ReferenceServer(os.path.join(directory, "kv.sock"), max_connections=2)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        held = []
        for _ in range(2):
            client = ServerClient(server.socket_path, timeout=30)
            client.status()  # accepted and served
            held.append(client)
        with socket.socket(socket.AF_UNIX) as extra:
            extra.settimeout(30)
            extra.connect(server.socket_path)
            reply = P.decode_reply(P.recv_frame(extra))  # type: ignore[arg-type]
            assert not reply.ok and "too many connections (limit 2)" in reply.error_message
            assert P.recv_frame(extra) is None  # and the server hung up
        held.pop().close()
        deadline = time.monotonic() + 30
        while True:  # the closed slot frees up once the server notices the hang-up
            with ServerClient(server.socket_path, timeout=30) as again:
                try:
                    again.status()
                    break
                except (ServerError, WireFormatError, OSError):  # refused: the reply, or a hang-up first
                    assert time.monotonic() < deadline
        for client in held:
            client.close()
    finally:
        server.stop()
        thread.join(30)
        os.rmdir(directory)

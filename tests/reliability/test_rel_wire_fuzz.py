"""Case 1: hostile wire input. Only ``WireFormatError``; no other exception, hang or mapping.

Targets: the wrapper decoder (:func:`lmcache_platform.wire.decode`) over every wire
class we ship (cpu shm, cuda torch IPC, cuda raw IPC), the reference server's
request and reply decoders, its best-effort request-id reader, and its frame reader
over a real socket. Inputs: a seeded byte-level mutator (:mod:`support.fuzz`) over
valid messages made from real wrapped tensors, plus hypothesis for
structure-aware generation (derandomized, so every run is the same).

"No mapping" is checked three ways: ``to_tensor`` of every allowed class is
spied on (it must never be called), and this process's /dev/shm mappings, its
/dev/shm entries and its open fds are the same before and after. "No hang": a
C-level watchdog (``faulthandler``) kills the process with a traceback if any
batch of 1,000 decodes runs for a minute; the slowest single decode is printed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_platform import DeviceIPCWrapper, EngineGroupInfo, KVFormat, LayoutHints, WireFormatError, wire
from lmcache_platform.protocol import _messages as P
from lmcache_platform.server import RegisterRequest
from lmcache_platform_cpu import CpuShmIPCWrapper
from lmcache_platform_cuda import CudaIPCWrapper, RawCudaIPCWrapper
from support.fuzz import Mutator
from support.reliability import (
    PREFIX,
    SHM_DIR,
    Resources,
    emit,
    fd_targets,
    mapped_shm,
    mappings_of,
    pid_namespace,
    segments_of,
    sized,
)

SEED = 0x1A7E_5EED
N_WIRE = sized(100_000, 1_000_000)
N_PROTOCOL = sized(40_000, 400_000)
N_STREAMS = sized(3_000, 30_000)
N_LIVE = sized(1_000, 20_000)
N_HYPOTHESIS = sized(400, 8_000)
BATCH = 1_000
WATCHDOG_S = 60.0

CLASSES: tuple[type[DeviceIPCWrapper], ...] = (CpuShmIPCWrapper, CudaIPCWrapper, RawCudaIPCWrapper)
ALLOWED = {cls.wire_tag: cls for cls in CLASSES}
CUDA_UUID = "GPU-6f1d6c3e-2a5b-4c1e-9d3f-0a1b2c3d4e5f"
CUDA_LAYER: dict[str, Any] = {
    "dtype": "bfloat16",
    "shape": [2, 8, 16, 2, 64],
    "stride": [16384, 2048, 128, 64, 1],
    "storage_offset": 0,
    "device_uuid": CUDA_UUID,
}


def cuda_fields() -> list[dict[str, Any]]:
    """Descriptors shaped like real CUDA ones; decoding them opens nothing."""
    nbytes = 2 * 16384 * 2
    return [
        {
            **CUDA_LAYER,
            "handle": b"\x01" + bytes(range(64)),
            "storage_nbytes": nbytes,
            "storage_offset_bytes": 4096,
            "ref_counter_handle": b"/torch_4242_2983412_7",
            "ref_counter_offset": 3,
            "event_handle": bytes(64),
            "event_sync_required": 1,
        },
        {**CUDA_LAYER, "ipc_handle": bytes(range(64, 128)), "alloc_offset": 8192, "storage_nbytes": nbytes},
    ]


# -- the outcome of one decode -------------------------------------------------------------


@dataclass
class Tally:
    """Counts per outcome; any exception other than WireFormatError fails at once."""

    accepted: int = 0
    refused: int = 0
    slowest_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    @property
    def total(self) -> int:
        return self.accepted + self.refused

    def run(self, decode: Callable[[bytes], object], data: bytes, what: str) -> None:
        t0 = time.perf_counter()
        try:
            decode(data)
        except WireFormatError:
            self.refused += 1
        except Exception as exc:
            raise AssertionError(
                f"{what}: {type(exc).__name__} escaped instead of WireFormatError: {exc}\n"
                f"input ({len(data)} bytes): {data.hex()}"
            ) from exc
        else:
            self.accepted += 1
        self.slowest_s = max(self.slowest_s, time.perf_counter() - t0)

    def summary(self) -> str:
        elapsed = time.perf_counter() - self.started
        return (
            f"{self.total:,} messages in {elapsed:.2f} s ({self.total / elapsed:,.0f}/s): "
            f"{self.refused:,} refused with WireFormatError, {self.accepted:,} valid" + "; "
            f"slowest decode {self.slowest_s * 1e3:.2f} ms"
        )


@pytest.fixture
def watchdog() -> Iterator[Callable[[], None]]:
    """Call it at each batch: a batch that runs past WATCHDOG_S kills the process loudly."""

    def arm() -> None:
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)

    arm()
    yield arm
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def never_mapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Spies on every allowed class's ``to_tensor``, and on this process's mappings, fds and segments.

    Nothing may *appear*: garbage of earlier tests may release mappings meanwhile.
    """
    calls: list[str] = []
    for cls in CLASSES:
        monkeypatch.setattr(cls, "to_tensor", lambda self: calls.append(repr(self)))
    maps, fds, segments = mapped_shm(), fd_targets(), set(segments_of({os.getpid()}))
    yield calls
    assert calls == [], f"decoding called to_tensor: {calls[:3]}"
    assert not mapped_shm() - maps, f"decoding mapped {mapped_shm() - maps}"
    assert not fd_targets() - fds, f"decoding left fds open: {fd_targets() - fds}"
    assert set(segments_of({os.getpid()})) <= segments


def decode_wrappers(data: bytes, allowed: dict[str, type[DeviceIPCWrapper]] | None = ALLOWED) -> None:
    for w in wire.decode(data, allowed=allowed):
        assert isinstance(w, CLASSES), type(w)
        w.close()


def decode_with_the_registry(data: bytes) -> None:
    """The default allow-list: each record's device type is resolved in this process."""
    decode_wrappers(data, None)


def decode_request_like_the_server(data: bytes) -> None:
    """What the server does with a frame: the request id (never raises), then the request."""
    rid = P.request_id_of(data)
    assert type(rid) is int and 0 <= rid <= P.MAX_ID
    req = P.decode_request(data)
    if isinstance(req, RegisterRequest):
        decode_wrappers(req.wrappers)


# -- the corpus of valid messages ------------------------------------------------------------


#: Segments the corpus names: (dtype, shape, stride, storage offset, segment bytes).
SEGMENTS = [
    ("float16", [2, 8, 4, 2, 8], [512, 64, 16, 8, 1], 0, 2048),
    ("int8", [64], [3], 1, 192),
    ("bfloat16", [5], [1], 2, 14),
]


@pytest.fixture(scope="module")
def wrappers() -> Iterator[list[DeviceIPCWrapper]]:
    """Descriptors of real segments (so decoding *could* map them), plus CUDA ones.

    The segment names are fixed-length (zero-padded pid namespace and pid, fixed random
    part), so the seeded mutator makes the same edits at the same places on every run;
    only the pid's digits differ. Each segment is shown to be reopenable before the
    spies go in.
    """
    made: list[DeviceIPCWrapper] = []
    names = [
        f"{PREFIX}{pid_namespace():020d}_{os.getpid():010d}_{tag * 8}" for tag in ("5eed", "c0de", "f00d")
    ]
    try:
        for name, (dtype, shape, stride, offset, nbytes) in zip(names, SEGMENTS, strict=True):
            fd = os.open(f"{SHM_DIR}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.ftruncate(fd, nbytes)
            os.close(fd)
            w: DeviceIPCWrapper = CpuShmIPCWrapper.from_fields(
                {
                    "dtype": dtype,
                    "shape": shape,
                    "stride": stride,
                    "storage_offset": offset,
                    "device_uuid": "cpu",
                    "shm_name": name,
                    "shm_nbytes": nbytes,
                }
            )
            probe = CpuShmIPCWrapper.from_fields(w.fields())
            assert probe.to_tensor().shape == tuple(shape)  # the view dies at once
            probe.close()
            assert mappings_of(name) == 0
            made.append(w)
        made.append(CpuShmIPCWrapper.wrap(torch.empty(0, 4)))
        made += [cls.from_fields(f) for cls, f in zip(CLASSES[1:], cuda_fields(), strict=True)]
        yield made
    finally:
        for w in made:
            w.close()
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{SHM_DIR}/{name}")


def wire_corpus(ws: list[DeviceIPCWrapper]) -> list[bytes]:
    return [
        wire.encode(ws),
        wire.encode(ws[:1]),
        wire.encode(ws[4:]),
        wire.encode([ws[3]]),
        wire.encode([]),
        wire.encode(ws[1:3] * 3),
    ]


def protocol_corpus(ws: list[DeviceIPCWrapper]) -> list[bytes]:
    hints = LayoutHints(
        kv_format=KVFormat.FLASH_ATTN, per_layer={1: KVFormat.MLA}, block_size=4, num_kv_heads=2
    )
    groups = (
        EngineGroupInfo(layer_indices=(0, 1), block_size=4),
        EngineGroupInfo(layer_indices=(2,), block_size=4, sliding_window=8),
    )
    chunks = [P.Chunk("c0", ((1, 2), (3,))), P.Chunk("chunk-\u00e9", ((0, 5), (6, 7)))]
    return [
        P.encode_request(
            "register",
            1,
            wrappers=wire.encode(ws[:3]),
            config={"lmcache_tokens_per_chunk": 8, "layout_hints": hints, "engine_group_infos": groups},
        ),
        P.encode_request("register", 2, wrappers=wire.encode(ws[4:]), config={}),
        P.encode_request("store", 3, context=7, chunks=chunks),
        P.encode_request("retrieve", 4, context=7, chunks=chunks[::-1]),
        P.encode_request("unregister", 5, context=7),
        P.encode_request("status", 6, context=7),
        P.encode_request("status", 7),
        P.encode_request("shutdown", 8),
    ]


# -- the mutator ---------------------------------------------------------------------------


def test_mutated_wrapper_messages_raise_only_wire_format_error(
    wrappers: list[DeviceIPCWrapper],
    never_mapped: list[str],
    watchdog: Callable[[], None],
    request: pytest.FixtureRequest,
) -> None:
    """Every tenth message goes through the default allow-list (the real registry)."""
    mutate = Mutator(wire_corpus(wrappers), SEED)
    tally = Tally()
    for i in range(N_WIRE):
        if i % BATCH == 0:
            watchdog()
        tally.run(decode_wrappers if i % 10 else decode_with_the_registry, mutate(), f"#{i}")
    assert tally.refused > 0.9 * N_WIRE and tally.accepted > 0  # the mutator reached both outcomes
    emit(request, "1 wire mutator", f"seed {SEED:#x}: " + tally.summary(), messages=tally.total)


def test_mutated_requests_and_replies_raise_only_wire_format_error(
    wrappers: list[DeviceIPCWrapper],
    never_mapped: list[str],
    watchdog: Callable[[], None],
    request: pytest.FixtureRequest,
) -> None:
    replies = [P.encode_reply(9, {"context": 1, "bytes": 4096}), P.encode_error(9, "TransferError", "no")]
    mutate_requests = Mutator(protocol_corpus(wrappers), SEED + 1)
    mutate_replies = Mutator(replies, SEED + 2)
    tally = Tally()
    for i in range(N_PROTOCOL):
        if i % BATCH == 0:
            watchdog()
        if i % 8:
            tally.run(decode_request_like_the_server, mutate_requests(), f"request #{i}")
        else:
            tally.run(P.decode_reply, mutate_replies(), f"reply #{i}")
    assert tally.refused > 0.9 * N_PROTOCOL and tally.accepted > 0
    emit(request, "1 protocol mutator", f"seed {SEED + 1:#x}: " + tally.summary(), messages=tally.total)


_PREFIX = struct.Struct(">I")


def _stream(mutate: Mutator, rng_pick: Callable[[list[int]], int]) -> bytes:
    """A few frames whose length prefixes may lie (short, long, huge, or over the cap)."""
    out = b""
    for _ in range(rng_pick([1, 2, 3])):
        payload = mutate()
        length = rng_pick(
            [len(payload)] * 4
            + [
                0,
                max(len(payload) - 1, 0),
                len(payload) + 1,
                P.MAX_FRAME_BYTES,
                P.MAX_FRAME_BYTES + 1,
                0xFFFFFFFF,
            ]
        )
        out += _PREFIX.pack(length) + payload
    return out[: rng_pick([len(out)] * 3 + [len(out) // 2, 3])]


def test_hostile_byte_streams_through_the_frame_reader(
    wrappers: list[DeviceIPCWrapper],
    never_mapped: list[str],
    watchdog: Callable[[], None],
    request: pytest.FixtureRequest,
) -> None:
    """The server's read loop over a real socket: frames, then requests, until EOF or refusal."""
    mutate = Mutator(protocol_corpus(wrappers), SEED + 3)
    pick = mutate.rng.choice
    tally, frames = Tally(), 0
    for i in range(N_STREAMS):
        if i % BATCH == 0:
            watchdog()
        data = _stream(mutate, pick)
        a, b = socket.socketpair()
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            b.settimeout(WATCHDOG_S)  # a reader waiting for bytes that never come would hang

            def serve(_: bytes, sock: socket.socket = b) -> None:
                nonlocal frames
                while (payload := P.recv_frame(sock)) is not None:
                    frames += 1
                    decode_request_like_the_server(payload)

            tally.run(serve, data, f"stream #{i}")
        finally:
            a.close()
            b.close()
    emit(
        request,
        "1 frame reader",
        f"seed {SEED + 3:#x}: {frames:,} frames read; " + tally.summary(),
        messages=tally.total,
    )


@pytest.fixture
def live_server() -> Iterator[str]:
    """The reference server, in this process (a thread), on a socket in a private directory."""
    import tempfile

    from lmcache_platform.server import ReferenceServer

    directory = tempfile.mkdtemp(prefix="lmcache-rel-")  # mode 0700, as the server requires
    server = ReferenceServer(os.path.join(directory, "kv.sock"), max_host_bytes=1 << 20)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.socket_path
    server.stop()
    thread.join(30)
    os.rmdir(directory)


def test_a_live_server_answers_every_hostile_frame_and_keeps_serving(
    wrappers: list[DeviceIPCWrapper], live_server: str, request: pytest.FixtureRequest
) -> None:
    """Mutated requests over the real socket: each gets a reply; the server outlives them all."""
    corpus = [c for c in protocol_corpus(wrappers) if P.decode_request(c).op != "shutdown"]
    mutate = Mutator(corpus, SEED + 4)
    replies = {"ok": 0, "error": 0}
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(WATCHDOG_S)
    sock.connect(live_server)
    try:
        for _ in range(N_LIVE):
            data = mutate()
            with contextlib.suppress(WireFormatError):
                if P.decode_request(data).op == "shutdown":
                    continue  # a valid shutdown would end the test, not the server's robustness
            P.send_frame(sock, data)
            try:
                payload = P.recv_frame(sock)
            except OSError:
                payload = None
            assert payload is not None, f"the server dropped the connection on {data.hex()}"
            reply = P.decode_reply(payload)
            replies["ok" if reply.ok else "error"] += 1
    finally:
        sock.close()
    from lmcache_platform.server import ServerClient

    with ServerClient(live_server, timeout=30) as client:
        status = client.status()["server"]
    assert status["contexts"] == 0  # contexts of closed connections were closed
    assert replies["error"] > 0.9 * sum(replies.values())
    emit(
        request,
        "1 live server",
        f"seed {SEED + 4:#x}: {sum(replies.values()):,} hostile frames to a live "
        f"server: {replies['error']:,} error replies, {replies['ok']:,} ok, 0 connections dropped; "
        "still serving",
    )


def test_the_server_answers_an_unhashable_op_with_an_error_reply(live_server: str) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(live_server)
        P.send_frame(sock, P.MAGIC + bytes([P.VERSION]) + msgpack.packb({"op": [], "id": 7}))
        payload = P.recv_frame(sock)
        assert payload is not None, "the server hung up instead of answering"
        reply = P.decode_reply(payload)
        assert (reply.ok, reply.request_id, reply.error_type) == (False, 7, "WireFormatError")


# -- hypothesis: structure-aware generation ----------------------------------------------------

_INT64 = st.integers(-(1 << 63), (1 << 64) - 1)
_EDGE_INTS = st.sampled_from(
    [-1, 0, 1, 2**31, 2**32, 2**48, 2**48 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
)
_HOSTILE_STR = st.sampled_from(
    [
        "",
        "..",
        "../../etc/passwd",
        "/dev/shm/lmcache_platform_1_2_" + "0" * 32,
        "lmcache_platform_",
        "lmcache_platform_1_1_" + "a" * 32 + "/..",
        "complex64",
        "torch.float32",
        "float",
        "object",
        "\x00",
        "x" * 200,
        "cpu",
        "cuda",
        "GPU-0",
    ]
)
HOSTILE = st.one_of(
    _INT64,
    _EDGE_INTS,
    _HOSTILE_STR,
    st.text(max_size=40),
    st.binary(max_size=80),
    st.lists(st.one_of(_INT64, _EDGE_INTS), max_size=10),
    st.floats(),
    st.none(),
    st.booleans(),
    st.dictionaries(st.text(max_size=4), _INT64, max_size=3),
    st.lists(st.text(max_size=4), max_size=3),
)


@st.composite
def records(draw: st.DrawFn, ws: list[DeviceIPCWrapper]) -> list[object]:
    """A record near a valid one: right tag and device type, fields partly replaced."""
    valid = draw(st.sampled_from(ws))
    fields: dict[object, object] = dict(valid.fields().items())
    for key in draw(st.lists(st.sampled_from(sorted(valid.fields())), max_size=3, unique=True)):
        action = draw(st.sampled_from(["replace", "replace", "drop"]))
        if action == "drop":
            del fields[key]
        else:
            fields[key] = draw(HOSTILE)
    if draw(st.booleans()) and draw(st.booleans()):
        fields[draw(st.one_of(st.text(max_size=8), _INT64))] = draw(HOSTILE)
    device = draw(st.one_of(st.just(type(valid).device_type), st.sampled_from(["cpu", "cuda"]), HOSTILE))
    tag = draw(st.one_of(st.just(type(valid).wire_tag), st.sampled_from(sorted(ALLOWED)), HOSTILE))
    return draw(st.sampled_from([[device, tag, fields], [device, tag], [device, tag, fields, None]]))


@st.composite
def export_records(draw: st.DrawFn, ws: list[DeviceIPCWrapper]) -> list[object]:
    """A version-2 record near a valid one: its export fields and views partly replaced."""
    valid = draw(st.sampled_from(ws))
    export: dict[object, object] = dict(valid.export_fields().items())
    for key in draw(st.lists(st.sampled_from(sorted(export)), max_size=2, unique=True)):  # type: ignore[type-var]
        if draw(st.booleans()):
            del export[key]
        else:
            export[key] = draw(HOSTILE)
    good = list(valid.view_fields().values())
    views: list[object] = []
    for _ in range(draw(st.integers(0, 3))):
        row: list[object] = list(good)
        if draw(st.booleans()):
            row[draw(st.integers(0, 3))] = draw(HOSTILE)
        views.append(draw(st.one_of(st.sampled_from([row, row, row[:3], [*row, 0]]), HOSTILE)))
    tag = draw(st.one_of(st.just(type(valid).wire_tag), HOSTILE))
    return draw(
        st.sampled_from(
            [
                [type(valid).device_type, tag, export, views],
                [type(valid).device_type, tag, export, draw(HOSTILE)],
            ]
        )
    )


def _envelope(body: object, magic: bytes = wire.MAGIC, version: int = 1) -> bytes:
    """A message of ``body``: version 1 (one wrapper a record) unless told otherwise."""
    body_bytes: bytes = msgpack.packb(body, use_bin_type=True)
    return magic + bytes([version]) + body_bytes


_SETTINGS = settings(
    max_examples=N_HYPOTHESIS,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(
    ("version", "label"), [(1, "1 hypothesis records"), (2, "1b hypothesis export records")]
)
def test_generated_wrapper_records(
    wrappers: list[DeviceIPCWrapper],
    never_mapped: list[str],
    request: pytest.FixtureRequest,
    version: int,
    label: str,
) -> None:
    """Records near valid ones (version 2: one export, several views): refused cleanly, or
    accepted and surviving a re-encode unchanged."""
    tally = Tally()
    round_trips = 0
    near_valid = records(wrappers) if version == 1 else export_records(wrappers)

    @_SETTINGS
    @given(st.lists(near_valid, max_size=4 if version == 1 else 3))
    def check(body: list[object]) -> None:
        nonlocal round_trips
        data = _envelope(body, version=version)
        tally.run(decode_wrappers, data, f"generated version-{version} record")
        if tally.accepted > round_trips:  # accepted: it must survive a re-encode unchanged
            got = wire.decode(data, allowed=ALLOWED)
            assert wire.decode(wire.encode(got), allowed=ALLOWED) == got
            round_trips = tally.accepted

    check()
    assert tally.refused > 0 and tally.accepted > 0
    emit(request, label, "derandomized: " + tally.summary(), messages=tally.total)


def _containers(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5)


_ANY = st.recursive(
    st.one_of(_INT64, st.text(max_size=10), st.binary(max_size=10), st.floats(), st.none(), st.booleans()),
    _containers,
    max_leaves=30,
)


def test_generated_arbitrary_bodies(never_mapped: list[str], request: pytest.FixtureRequest) -> None:
    """Any msgpack value behind a valid header, for both envelopes."""
    tally = Tally()

    @_SETTINGS
    @given(_ANY, st.booleans())
    def check(body: object, as_request: bool) -> None:
        if as_request:
            tally.run(
                decode_request_like_the_server, _envelope(body, P.MAGIC, P.VERSION), "generated request"
            )
        else:
            tally.run(decode_wrappers, _envelope(body), "generated body")

    check()
    emit(request, "1 hypothesis bodies", "derandomized: " + tally.summary(), messages=tally.total)


#: The fields each op carries (beyond "op" and "id"), as the reference client sends them.
OP_FIELDS = {
    "register": ("wrappers", "config"),
    "store": ("context", "chunks"),
    "retrieve": ("context", "chunks"),
    "unregister": ("context",),
    "status": ("context",),
    "shutdown": (),
}


@st.composite
def requests(draw: st.DrawFn, ws: list[DeviceIPCWrapper]) -> dict[object, object]:
    """A request map near a valid one: each field is valid, hostile, missing or extra."""
    good = {
        "context": 1,
        "wrappers": wire.encode(ws[:2]),
        "config": P.encode_config(),
        "chunks": [["c", [[1, 2]]], ["d", [[3, 4], [5]]]],
    }
    op = draw(st.sampled_from(sorted(OP_FIELDS)))
    msg: dict[object, object] = {"op": op, "id": draw(st.integers(0, 100))}
    for key in OP_FIELDS[op]:
        msg[key] = good[key]
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(["op", "id", *good, "extra"]))
        if draw(st.booleans()) and key in msg:
            del msg[key]
        else:
            msg[key] = draw(HOSTILE)
    config = msg.get("config")
    if isinstance(config, dict) and config and draw(st.booleans()):
        config = dict(config)
        config[draw(st.sampled_from(sorted(config)))] = draw(HOSTILE)
        msg["config"] = config
    return msg


def test_generated_requests(
    wrappers: list[DeviceIPCWrapper], never_mapped: list[str], request: pytest.FixtureRequest
) -> None:
    tally = Tally()

    @_SETTINGS
    @given(requests(wrappers))
    def check(msg: dict[object, object]) -> None:
        tally.run(decode_request_like_the_server, _envelope(msg, P.MAGIC, P.VERSION), "generated request")

    check()
    assert tally.refused > 0 and tally.accepted > 0
    emit(request, "1 hypothesis requests", "derandomized: " + tally.summary(), messages=tally.total)


# -- caps: each limit holds exactly at its boundary --------------------------------------------


def _record(shape: list[int] | None = None, **over: Any) -> list[object]:
    """A CPU record of an empty tensor (it needs no segment), fields overridden."""
    shape = [0, 16] if shape is None else shape
    fields = {
        "dtype": "uint8",
        "shape": shape,
        "stride": [1] * len(shape),
        "storage_offset": 0,
        "device_uuid": "cpu",
        "shm_name": "",
        "shm_nbytes": 0,
        **over,
    }
    return ["cpu", CpuShmIPCWrapper.wire_tag, fields]


def _export(views: int) -> list[object]:
    """A version-2 CPU record: one empty export and ``views`` views of it."""
    _, tag, fields = _record()
    assert isinstance(fields, dict)
    export = {k: v for k, v in fields.items() if k not in ("dtype", "shape", "stride", "storage_offset")}
    return ["cpu", tag, export, [["uint8", [0, 16], [1, 1], 0]] * views]


def _name_of_length(n: int) -> str:
    """A well-formed segment name of ``n`` characters (the longest is the cap), or longer."""
    pidns = "1" * min(20, n - 17 - 1 - 10 - 1 - 32)
    return "lmcache_platform_" + pidns + "_" + "2" * 10 + "_" + "a" * 32 + "b" * max(0, n - 81)


CAPS: list[tuple[str, Callable[[int], bytes], int | None, Callable[[bytes], object], str]] = [
    # (what, build(n), limit, decode, refusal message)
    (
        "wrappers per message",
        lambda n: _envelope([_record()] * n),
        wire.MAX_WRAPPERS,
        decode_wrappers,
        "exceed",
    ),
    (
        "views per message",
        lambda n: _envelope([_export(n // 2), _export(n - n // 2)], version=2),
        wire.MAX_WRAPPERS,
        decode_wrappers,
        "exceed",
    ),
    (
        "fields per record",
        lambda n: _envelope([["cpu", CpuShmIPCWrapper.wire_tag, {f"f{i}": 0 for i in range(n)}]]),
        wire.MAX_FIELDS,
        decode_wrappers,
        "exceed",
    ),
    (
        "shm name length",
        lambda n: _envelope([_record([16], shm_name=_name_of_length(n), shm_nbytes=16)]),
        CpuShmIPCWrapper.wire_fields["shm_name"].max_len,
        decode_wrappers,
        "exceeds",
    ),
    ("dimensions", lambda n: _envelope([_record([0] + [1] * (n - 1))]), 8, decode_wrappers, "exceed"),
    ("dimension size", lambda n: _envelope([_record([0, n])]), 1 << 48, decode_wrappers, "above"),
    (
        "chunks per request",
        lambda n: (
            P.MAGIC
            + b"\x01"
            + msgpack.packb({"op": "store", "id": 1, "context": 1, "chunks": [["c", [[0]]]] * n})
        ),
        P.MAX_CHUNKS,
        P.decode_request,
        "exceed",
    ),
    (
        "chunk id length",
        lambda n: (
            P.MAGIC
            + b"\x01"
            + msgpack.packb({"op": "store", "id": 1, "context": 1, "chunks": [["c" * n, [[0]]]]})
        ),
        P.MAX_CHUNK_ID_LEN,
        P.decode_request,
        "exceeds",
    ),
    (
        "groups per chunk",
        lambda n: (
            P.MAGIC
            + b"\x01"
            + msgpack.packb({"op": "store", "id": 1, "context": 1, "chunks": [["c", [[0]] * n]]})
        ),
        P.MAX_GROUPS,
        P.decode_request,
        "exceed",
    ),
    (
        "block ids per group",
        lambda n: (
            P.MAGIC
            + b"\x01"
            + msgpack.packb({"op": "store", "id": 1, "context": 1, "chunks": [["c", [[0] * n]]]})
        ),
        P.MAX_BLOCKS_PER_GROUP,
        P.decode_request,
        "exceed",
    ),
    (
        "block id value",
        lambda n: (
            P.MAGIC
            + b"\x01"
            + msgpack.packb({"op": "store", "id": 1, "context": 1, "chunks": [["c", [[n]]]]})
        ),
        P.MAX_ID,
        P.decode_request,
        "outside",
    ),
    (
        "tokens per chunk",
        lambda n: (
            P.MAGIC
            + b"\x01"
            + msgpack.packb(
                {
                    "op": "register",
                    "id": 1,
                    "wrappers": b"",
                    "config": {**P.encode_config(), "lmcache_tokens_per_chunk": n},
                }
            )
        ),
        1 << 24,
        lambda d: P.decode_request(d),
        "outside",
    ),
]


@pytest.mark.parametrize("what, build, limit, decode, refusal", CAPS, ids=[c[0] for c in CAPS])
def test_caps_hold_at_their_boundary(
    never_mapped: list[str],
    what: str,
    build: Callable[[int], bytes],
    limit: int | None,
    decode: Callable[[bytes], object],
    refusal: str,
) -> None:
    assert limit is not None
    at, over = build(limit), build(limit + 1)
    try:
        decode(at)
    except WireFormatError as exc:  # at the limit, only a *different* check may refuse
        assert not any(w in str(exc) for w in ("exceed", "above", "outside")), exc
    with pytest.raises(WireFormatError, match=refusal):
        decode(over)


@pytest.mark.parametrize("declared", [1 << 16, 1 << 24, 0xFFFFFFFF])
@pytest.mark.parametrize(
    "header", [b"\xdb", b"\xc6", b"\xdd", b"\xdf"], ids=["str32", "bin32", "array32", "map32"]
)
def test_huge_declared_lengths_are_refused_without_reading(
    never_mapped: list[str], header: bytes, declared: int
) -> None:
    """A 4-byte length field claiming up to 4 GiB, with nothing behind it."""
    rss = Resources.of().rss
    for magic, decode in ((wire.MAGIC, decode_wrappers), (P.MAGIC, P.decode_request)):
        data = magic + b"\x01" + b"\x91" + header + struct.pack(">I", declared)
        with pytest.raises(WireFormatError):
            decode(data)
    assert Resources.of().rss - rss < 64 << 20  # nothing near the declared size was allocated


def test_whole_messages_over_the_byte_caps_are_refused_before_parsing(never_mapped: list[str]) -> None:
    big = wire.MAGIC + b"\x01" + b"\xc0" * wire.MAX_MESSAGE_BYTES
    with pytest.raises(WireFormatError, match="exceed the limit"):
        wire.decode(big, allowed=ALLOWED)
    big = P.MAGIC + b"\x01" + b"\xc0" * P.MAX_FRAME_BYTES
    with pytest.raises(WireFormatError, match="exceed the limit"):
        P.decode_request(big)
    assert P.request_id_of(big) == 0


@pytest.mark.parametrize(
    "op", [[], {}, ["store"], {"op": "store"}], ids=["array", "map", "list-of-op", "map-op"]
)
def test_an_unhashable_op_is_refused(op: object) -> None:
    data = P.MAGIC + bytes([P.VERSION]) + msgpack.packb({"op": op, "id": 1})
    assert P.request_id_of(data) == 1
    with pytest.raises(WireFormatError, match="unknown op"):
        P.decode_request(data)

"""The reference server's framing and message schema, without a server."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platform import EngineGroupInfo, EngineType, KVFormat, LayoutHints, WireFormatError
from lmcache_platform.protocol import _messages as P


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def raw(msg: object) -> bytes:
    return P.MAGIC + bytes([P.VERSION]) + msgpack.packb(msg, use_bin_type=True)


# -- framing ----------------------------------------------------------------------------


def test_frames_round_trip_in_order(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payloads = [b"", b"x", bytes(range(256)) * 300]
    sender = threading.Thread(target=lambda: [P.send_frame(a, p) for p in payloads])  # type: ignore[func-returns-value]
    sender.start()
    got = [P.recv_frame(b) for _ in payloads]
    sender.join()
    assert got == payloads


def test_clean_end_of_stream_is_none(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    assert P.recv_frame(b) is None


def test_oversized_length_is_refused_before_reading(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", P.MAX_FRAME_BYTES + 1))  # and no body at all
    with pytest.raises(WireFormatError, match="exceeds the limit"):
        P.recv_frame(b)


@pytest.mark.parametrize("sent", [b"\x00\x00", b"\x00\x00\x00\x10abc"])
def test_stream_cut_inside_a_frame(pair: tuple[socket.socket, socket.socket], sent: bytes) -> None:
    a, b = pair
    a.sendall(sent)
    a.close()
    with pytest.raises(WireFormatError, match="closed inside a frame"):
        P.recv_frame(b)


def test_send_refuses_oversized_frames(pair: tuple[socket.socket, socket.socket]) -> None:
    with pytest.raises(WireFormatError, match="exceeds the limit"):
        P.send_frame(pair[0], b"\x00" * (P.MAX_FRAME_BYTES + 1))


# -- requests -----------------------------------------------------------------------------

CONFIG: dict[str, Any] = dict(
    lmcache_tokens_per_chunk=128,
    layout_hints=LayoutHints(
        kv_format=KVFormat.FLASH_ATTN,
        per_layer={3: KVFormat.MLA},
        block_size=16,
        num_kv_heads=8,
        engine_layout="LBNHC",
        head_size=64,
    ),
    engine_group_infos=(
        EngineGroupInfo(layer_indices=(0, 2), block_size=16),
        EngineGroupInfo(layer_indices=(1, 3), block_size=16, sliding_window=512),
    ),
    engine_type=EngineType.SGLANG,
    separate_object_groups=False,
    full_sw_kv=True,
    layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(4)),
    chunk_format="blocks",
)


def test_every_op_round_trips() -> None:
    chunks = [P.Chunk("a", ((1, 2), (3,))), P.Chunk("b", ((),))]
    keyed = [P.Chunk(b"\x00" * 32, ((1, 2), (3,))), P.Chunk(b"k" * P.MAX_KEY_LEN, ((4, 5), (6,)))]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("register", {"wrappers": b"LMCW\x01\x90", "config": CONFIG}),
        ("register", {"wrappers": b"LMCW\x01\x90", "config": CONFIG, "namespace": b"n" * 32}),
        ("store", {"context": 7, "chunks": chunks}),
        ("retrieve", {"context": 7, "chunks": chunks}),
        ("put", {"context": 7, "chunks": keyed}),
        ("get", {"context": 7, "chunks": keyed}),
        ("put", {"context": 7, "chunks": keyed, "event": b"\x01" * 64}),
        ("get", {"context": 7, "chunks": keyed, "lease": 3, "event": b"h"}),
        ("store", {"context": 7, "chunks": chunks, "event": b"h"}),
        ("lookup", {"namespace": b"n", "keys": (b"a", b"b" * 64)}),
        ("lookup", {"namespace": b"n", "keys": ()}),
        ("unregister", {"context": 7}),
        ("status", {}),
        ("status", {"context": 7}),
        ("shutdown", {}),
    ]
    for i, (op, fields) in enumerate(cases):
        req = P.decode_request(P.encode_request(op, i, **fields))
        assert (req.op, req.request_id) == (op, i)
        for name, value in fields.items():
            expected = tuple(value) if name == "chunks" else value
            assert getattr(req, name) == expected, (op, name)


def test_config_round_trip_rebuilds_the_types() -> None:
    got = P.decode_config(P.encode_config(**CONFIG))
    assert got == CONFIG
    assert got["layout_hints"].per_layer == {3: KVFormat.MLA}


def test_the_config_map_carries_exactly_the_engine_fields() -> None:
    from lmcache_platform._types import ENGINE_KEYWORDS

    assert list(P.encode_config(chunk_format="blocks")) == list(ENGINE_KEYWORDS)
    assert set(P.decode_config(P.encode_config())) == set(ENGINE_KEYWORDS)
    # Fields added after version 1 travel only when they differ from their default, so a
    # server of version 1 still takes a default registration, and this one takes theirs.
    assert "chunk_format" not in P.encode_config()
    assert P.decode_config(P.encode_config())["chunk_format"] == "tokens"
    with pytest.raises(TypeError, match="unknown keywords \\['max_batch_size'\\]"):
        P.encode_config(max_batch_size=2)


def test_default_config_round_trips() -> None:
    got = P.decode_config(P.encode_config())
    assert got["lmcache_tokens_per_chunk"] == 256 and got["layout_hints"] is None
    assert got["engine_type"] is EngineType.VLLM and got["engine_group_infos"] == ()


def good_store(**over: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": "store", "id": 1, "context": 1, "chunks": [["c", [[1, 2]]]]}
    msg.update(over)
    return msg


def good_put(**over: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": "put", "id": 1, "context": 1, "chunks": [[b"k", [[1, 2]]]]}
    msg.update(over)
    return msg


def good_lookup(**over: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": "lookup", "id": 1, "namespace": b"n", "keys": [b"k"]}
    msg.update(over)
    return msg


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        ([1, 2], "expected a map"),
        ({"op": "frobnicate", "id": 1}, "unknown op 'frobnicate'"),
        ({"id": 1}, "unknown op None"),
        ({"op": "shutdown"}, "missing keys \\['id'\\]"),
        ({"op": "shutdown", "id": 1, "x": 1}, "unknown keys"),
        ({"op": "store", "id": 1, "context": 1}, "missing keys \\['chunks'\\]"),
        (good_store(id=-1), "request id: -1 is outside"),
        (good_store(id=True), "expected int, got bool"),
        (good_store(context="1"), "context: expected int"),
        (good_store(chunks={"c": 1}), "chunks: expected a list"),
        (good_store(chunks=[["c"]]), "expected \\[chunk_id"),
        (good_store(chunks=[[1, [[1]]]]), "chunk 0 id: expected str"),
        (good_store(chunks=[["c" * 300, [[1]]]]), "exceeds the limit of 256"),
        (good_store(chunks=[["c", [[1, -2]]]]), "group 0\\[1\\]: -2 is outside"),
        (good_store(chunks=[["c", [[1.5]]]]), "expected int, got float"),
        (good_store(chunks=[["c", [[0]] * 65]]), "exceed the limit of 64"),
        (good_store(chunks=[["c", [[0]]]] * (P.MAX_CHUNKS + 1)), "exceed the limit"),
        ({"op": "register", "id": 1, "wrappers": "x", "config": {}}, "wrappers: expected bytes"),
        ({"op": "register", "id": 1, "wrappers": b"", "config": {}}, "config: missing keys"),
        # keyed chunks and lookups: keys are 1..64 bytes, never text
        (good_put(chunks=[["k", [[1, 2]]]]), "put chunk 0 key: expected bytes, got str"),
        (good_put(chunks=[[b"", [[1, 2]]]]), "put chunk 0 key: must not be empty"),
        (good_put(chunks=[[b"k" * 65, [[1, 2]]]]), "put chunk 0 key: length 65 exceeds the limit of 64"),
        (good_put(chunks=[[b"k"]]), "expected \\[key, block_ids_per_group\\]"),
        (good_put(op="get", chunks=[[b"k", [[1, -2]]]]), "get chunk 0 group 0\\[1\\]: -2 is outside"),
        (good_store(chunks=[[b"k", [[1]]]]), "store chunk 0 id: expected str, got bytes"),
        (good_put(namespace=b"n"), "put request: .*unknown keys \\[\"'namespace'\"\\]"),
        (good_put(event=b""), "put event: must not be empty"),
        (good_put(event="e"), "put event: expected bytes, got str"),
        (good_put(event=b"e" * 257), "put event: length 257 exceeds the limit of 256"),
        (good_lookup(event=b"e"), "unknown keys"),
        (good_lookup(keys=b"k"), "lookup keys: expected a list"),
        (good_lookup(keys=[b"a", "b"]), "lookup key 1: expected bytes, got str"),
        (good_lookup(keys=[b"a", b""]), "lookup key 1: must not be empty"),
        (good_lookup(keys=[b"k"] * (P.MAX_CHUNKS + 1)), "lookup keys: 4097 items exceed the limit of 4096"),
        (good_lookup(namespace=b""), "lookup namespace: must not be empty"),
        (good_lookup(namespace=b"n" * 65), "lookup namespace: length 65 exceeds"),
        (good_lookup(namespace="n"), "lookup namespace: expected bytes"),
        ({"op": "lookup", "id": 1, "keys": [b"k"]}, "exactly one of 'namespace' and 'namespaces'"),
        (good_lookup(context=1), "unknown keys"),
        (
            {"op": "register", "id": 1, "wrappers": b"", "config": P.encode_config(), "namespace": 7},
            "register namespace: expected bytes, got int",
        ),
    ],
)
def test_bad_requests_name_the_culprit(msg: object, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        P.decode_request(raw(msg))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"engine_type": "trt"}, "unknown value 'trt'"),
        ({"lmcache_tokens_per_chunk": 0}, "outside"),
        ({"full_sw_kv": 1}, "expected bool"),
        (
            {
                "layout_hints": {
                    "kv_format": "nope",
                    "per_layer": [],
                    "block_size": None,
                    "num_kv_heads": None,
                    "engine_layout": None,
                    "head_size": None,
                }
            },
            "unknown value 'nope'",
        ),
        (
            {
                "layout_hints": {
                    "kv_format": None,
                    "per_layer": [[0]],
                    "block_size": None,
                    "num_kv_heads": None,
                    "engine_layout": None,
                    "head_size": None,
                }
            },
            "expected \\[layer, kv_format\\]",
        ),
        (
            {"engine_group_infos": [{"layer_indices": [0], "block_size": 0, "sliding_window": None}]},
            "block_size: 0 is outside",
        ),
        ({"engine_group_infos": [{"layer_indices": [0]}]}, "missing keys"),
        ({"layer_names": ["x" * 257]}, r"layer_names\[0\]: length 257"),
        ({"layer_names": [7]}, r"layer_names\[0\]: expected str"),
        ({"chunk_format": "pages"}, "config chunk_format: unknown value 'pages' \\(known: tokens, blocks\\)"),
        ({"chunk_format": 1}, "config chunk_format: expected str"),
    ],
)
def test_bad_config_names_the_culprit(override: dict[str, Any], match: str) -> None:
    config = P.encode_config()
    config.update(override)
    with pytest.raises(WireFormatError, match=match):
        P.decode_config(config)


def test_pickle_and_foreign_bytes_are_refused() -> None:
    with pytest.raises(WireFormatError, match="pickle"):
        P.decode_request(pickle.dumps({"op": "shutdown", "id": 1}))
    with pytest.raises(WireFormatError, match="header"):
        P.decode_request(b"GET / HTTP/1.1\r\n\r\n")


def test_a_wire_blob_is_not_a_request() -> None:
    """Each envelope kind has its own magic: a wrapper message is never read as a request."""
    with pytest.raises(WireFormatError, match="LMCP"):
        P.decode_request(b"LMCW\x01\x90")


def test_encode_request_refuses_what_the_server_would_refuse() -> None:
    with pytest.raises(WireFormatError, match="exceeds the limit of 256"):
        P.encode_request("store", 1, context=1, chunks=[P.Chunk("x" * 300, ((1,),))])


def test_request_id_of_is_best_effort() -> None:
    assert P.request_id_of(raw({"op": "bogus", "id": 42})) == 42
    assert P.request_id_of(raw({"op": "bogus", "id": "x"})) == 0
    assert P.request_id_of(b"garbage") == 0


# -- replies ------------------------------------------------------------------------------


def test_replies_round_trip() -> None:
    ok = P.decode_reply(P.encode_reply(3, {"bytes": 10, "nested": {"a": [1, "b"]}}))
    assert (ok.request_id, ok.ok, ok.result) == (3, True, {"bytes": 10, "nested": {"a": [1, "b"]}})
    err = P.decode_reply(P.encode_error(4, "TransferError", "block 9 out of range"))
    assert (err.ok, err.error_type, err.error_message) == (False, "TransferError", "block 9 out of range")


@pytest.mark.parametrize(
    "msg",
    [
        {"id": 1},
        {"id": 1, "ok": True, "result": [1]},
        {"id": 1, "ok": False, "error": {"type": 1}},
        {"id": 1, "ok": "yes", "result": {}},
    ],
)
def test_malformed_replies_are_refused(msg: object) -> None:
    with pytest.raises(WireFormatError):
        P.decode_reply(raw(msg))


# -- fuzzing: only WireFormatError ----------------------------------------------------------

_VALID_REQUESTS = [
    P.encode_request("store", 5, context=3, chunks=[P.Chunk("a", ((1, 2), (3,)))]),
    P.encode_request("register", 6, wrappers=b"LMCW\x01\x90", config=CONFIG, namespace=b"n" * 32),
    P.encode_request("put", 7, context=3, chunks=[P.Chunk(b"k" * 32, ((1, 2), (3,)))]),
    P.encode_request("lookup", 8, namespace=b"n" * 32, keys=[b"a" * 32, b"b" * 32]),
]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_request_bytes(data: bytes) -> None:
    with pytest.raises(WireFormatError):
        P.decode_request(data)


@settings(max_examples=600, deadline=None)
@given(
    st.sampled_from(_VALID_REQUESTS),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(0, 8),
)
def test_fuzz_mutated_requests(payload: bytes, mutations: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(payload)
    for pos, value in mutations:
        data[pos % len(data)] = value
    data = data[: len(data) - cut]
    try:
        req = P.decode_request(bytes(data))
    except WireFormatError:
        return
    assert req.op in P.OPS  # a benign mutation still yields a fully validated request

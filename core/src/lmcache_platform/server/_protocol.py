"""The reference server's protocol: length-prefixed frames carrying typed messages.

A frame is a 4-byte big-endian length followed by that many bytes, at most
:data:`MAX_FRAME_BYTES`; a larger announced length is refused before anything is
read. Each frame holds one envelope (see :mod:`lmcache_platform._codec`) with magic
``LMCP``: a request map from the engine, or a reply map from the server. Requests
are checked field by field against :data:`_SCHEMA`; registration embeds the
wrapper list as a :mod:`lmcache_platform.wire` message, which the server decodes
with its own allow-list.

Two ways to name a chunk: ``store``/``retrieve`` take chunk ids (``str``) private to
one context; ``put``/``get``/``lookup`` take content keys (``bytes``) in the
namespace a context registered with, shared by every context of that namespace.

Every request may carry ``deadline`` (``time.monotonic_ns()`` of the client's host,
which must be the server's): work still undone when it passes is dropped. Transfers
(``store``, ``retrieve``, ``put``, ``get``) may carry ``event``, a device event's handle
(:func:`lmcache_platform.record_event`): the server's copies wait on it. Fields
added after version 1 shipped are optional, and replies gain keys only for requests
that use one of them (see :attr:`Request.extended`), so older clients keep working.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .. import _codec, wire
from .._checks import (
    expect_bool,
    expect_bytes,
    expect_int,
    expect_int_list,
    expect_list,
    expect_map,
    expect_str,
    show,
)
from .._errors import WireFormatError
from .._events import MAX_HANDLE_BYTES
from .._kv.layout import ENGINE_LAYOUTS
from .._kv.transfer import SKIP_BLOCK  # "skip these positions" in a get/retrieve chunk
from .._types import (
    CHUNK_FORMATS,
    ENGINE_KEYWORDS,
    CacheContextConfig,
    EngineGroupInfo,
    EngineType,
    KVFormat,
    LayoutHints,
)

MAGIC = b"LMCP"
VERSION = 1
#: Largest frame either side accepts, length prefix excluded.
MAX_FRAME_BYTES = 16 << 20
#: Most chunks in one store, retrieve, put or get request, and keys in one lookup.
MAX_CHUNKS = 4096
#: Most KV-cache groups per chunk, and block ids per group.
MAX_GROUPS = 64
MAX_BLOCKS_PER_GROUP = 1 << 16
MAX_CHUNK_ID_LEN = 256
#: Longest content key and namespace (bytes; both at least 1). Also BLAKE2b's key
#: limit, which ``chunk_keys`` relies on: it keys the hash with the namespace.
MAX_KEY_LEN = 64
MAX_ID = (1 << 63) - 1
MAX_LAYERS = wire.MAX_WRAPPERS
#: Most namespaces in one ``lookup``.
MAX_NAMESPACES = 256
#: Longest lease a ``lookup`` may take (milliseconds).
MAX_LEASE_MS = 600_000
#: The error type of a reply to a request whose deadline passed before its work was done.
DEADLINE_EXCEEDED = "DeadlineExceeded"

OPS = (
    "register",
    "store",
    "retrieve",
    "put",
    "get",
    "lookup",
    "release",
    "ping",
    "unregister",
    "status",
    "shutdown",
)

_PREFIX = struct.Struct(">I")
_LIMITS = _codec.Limits(
    max_bytes=MAX_FRAME_BYTES,
    max_array_len=MAX_BLOCKS_PER_GROUP,
    max_map_len=256,
    max_str_len=1 << 20,
    max_bin_len=wire.MAX_MESSAGE_BYTES,
)

# -- framing -----------------------------------------------------------------------------


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Write one frame (blocking)."""
    sock.sendall(frame(payload))


def frame_length(head: bytes) -> int:
    """The body length a 4-byte prefix announces; :class:`WireFormatError` beyond the limit."""
    (length,) = _PREFIX.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise WireFormatError(f"frame of {length} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return int(length)


def frame(payload: bytes) -> bytes:
    """``payload`` with its length prefix, as :func:`send_frame` writes it."""
    if len(payload) > MAX_FRAME_BYTES:
        raise WireFormatError(f"frame of {len(payload)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return _PREFIX.pack(len(payload)) + payload


#: Bytes of a frame's length prefix.
PREFIX_BYTES = _PREFIX.size


def recv_frame(sock: socket.socket, *, deadline_ns: int | None = None) -> bytes | None:
    """Read one frame; ``None`` on a clean end of stream between frames.

    Raises :class:`WireFormatError` for an oversized length or a stream cut short
    inside a frame; the connection is then out of sync and must be closed. With
    ``deadline_ns`` (``time.monotonic_ns()``), :class:`TimeoutError` once it passes,
    however the bytes trickle in (the socket's timeout is set to the time left
    before each read).
    """
    head = _recv_exact(sock, _PREFIX.size, at_boundary=True, deadline_ns=deadline_ns)
    if head is None:
        return None
    length = frame_length(head)
    body = _recv_exact(sock, length, at_boundary=False, deadline_ns=deadline_ns)
    assert body is not None
    return body


def _recv_exact(sock: socket.socket, n: int, *, at_boundary: bool, deadline_ns: int | None) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline_ns is not None:
            left = deadline_ns - time.monotonic_ns()
            if left <= 0:
                raise TimeoutError("deadline passed while reading a reply")
            sock.settimeout(left / 1e9)
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and at_boundary:
                return None
            raise WireFormatError(f"connection closed inside a frame ({got} of {n} bytes)")
        got += k
    return bytes(buf)


# -- messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One chunk to move: its name in server memory and the engine block ids per group.

    The name is a chunk id (``str``, for ``store``/``retrieve``) or a content key
    (``bytes``, for ``put``/``get``).
    """

    chunk_id: str | bytes
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Request:
    """A validated request. Fields an operation does not use keep their defaults."""

    op: str
    request_id: int
    context: int = 0
    wrappers: bytes = b""
    config: dict[str, Any] = field(default_factory=dict)
    chunks: tuple[Chunk, ...] = ()
    namespace: bytes = b""
    keys: tuple[bytes, ...] = ()
    #: ``time.monotonic_ns()`` after which the request must not act; ``None``: no deadline.
    deadline: int | None = None
    #: ``lookup`` over several namespaces (the ``namespaces`` field); empty with ``namespace``.
    namespaces: tuple[bytes, ...] = ()
    #: ``lookup``/``get``/``release``: the lease id (0: none); ``lease_ms`` its life.
    lease: int = 0
    lease_ms: int = 0
    #: Transfers: the handle of an engine's device event to order the copies after
    #: (empty: none).
    event: bytes = b""

    @property
    def extended(self) -> bool:
        """Whether the request uses a field added after version 1 shipped.

        Replies carry their newer keys (``now``, ``remote``) only then, so clients
        that predate those keys, and check reply maps exactly, see what they expect.
        """
        return self.deadline is not None or bool(self.namespaces) or bool(self.lease)

    @property
    def lookup_namespaces(self) -> tuple[bytes, ...]:
        """The namespaces a ``lookup`` covers, given as ``namespace`` or ``namespaces``."""
        return self.namespaces or (self.namespace,)


_ANY_OP = frozenset({"deadline"})

#: op -> (required keys, optional keys), beyond "op" and "id" (and "deadline", always optional).
_SCHEMA: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "register": (frozenset({"wrappers", "config"}), frozenset({"namespace"})),
    "store": (frozenset({"context", "chunks"}), frozenset({"event"})),
    "retrieve": (frozenset({"context", "chunks"}), frozenset({"event"})),
    "put": (frozenset({"context", "chunks"}), frozenset({"event"})),
    "get": (frozenset({"context", "chunks"}), frozenset({"lease", "event"})),
    "lookup": (frozenset({"keys"}), frozenset({"namespace", "namespaces", "lease", "lease_ms"})),
    "release": (frozenset({"lease"}), frozenset()),
    "ping": (frozenset(), frozenset()),
    "unregister": (frozenset({"context"}), frozenset()),
    "status": (frozenset(), frozenset({"context"})),
    "shutdown": (frozenset(), frozenset()),
}


def encode_request(
    op: str,
    request_id: int,
    *,
    context: int | None = None,
    wrappers: bytes | None = None,
    config: dict[str, Any] | None = None,
    chunks: Sequence[Chunk] | None = None,
    namespace: bytes | None = None,
    keys: Sequence[bytes] | None = None,
    deadline: int | None = None,
    namespaces: Sequence[bytes] | None = None,
    lease: int | None = None,
    lease_ms: int | None = None,
    event: bytes | None = None,
) -> bytes:
    """Build a request frame payload; the same schema as :func:`decode_request` checks."""
    msg: dict[str, object] = {"op": op, "id": request_id}
    if context is not None:
        msg["context"] = context
    if wrappers is not None:
        msg["wrappers"] = wrappers
    if config is not None:
        msg["config"] = encode_config(**config)
    if chunks is not None:
        msg["chunks"] = [[c.chunk_id, [list(g) for g in c.block_ids]] for c in chunks]
    if namespace is not None:
        msg["namespace"] = namespace
    if keys is not None:
        msg["keys"] = list(keys)
    if deadline is not None:
        msg["deadline"] = deadline
    if namespaces is not None:
        msg["namespaces"] = list(namespaces)
    if lease is not None:
        msg["lease"] = lease
    if lease_ms is not None:
        msg["lease_ms"] = lease_ms
    if event is not None:
        msg["event"] = event
    payload = _codec.pack(MAGIC, VERSION, msg, max_bytes=MAX_FRAME_BYTES, what="request")
    decode_request(payload)  # refuse to send what the server would refuse
    return payload


def request_id_of(payload: bytes) -> int:
    """Best-effort request id of a payload that failed validation (0 if unknown)."""
    try:
        msg = _codec.unpack(MAGIC, VERSION, payload, _LIMITS, what="request")
    except WireFormatError:
        return 0
    rid = msg.get("id") if isinstance(msg, dict) else None
    return rid if type(rid) is int and 0 <= rid <= MAX_ID else 0


def decode_request(payload: bytes) -> Request:
    """Parse and validate a request; raise :class:`WireFormatError` naming the culprit."""
    msg = _codec.unpack(MAGIC, VERSION, payload, _LIMITS, what="request")
    if not isinstance(msg, dict):
        raise WireFormatError(f"request: expected a map, got {type(msg).__name__}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in _SCHEMA:
        raise WireFormatError(f"request: unknown op {show(op)} (known: {', '.join(OPS)})")
    required, optional = _SCHEMA[op]
    expect_map(msg, f"{op} request", keys=required | {"op", "id"}, optional=optional | _ANY_OP)
    rid = expect_int(msg["id"], f"{op} request id", lo=0, hi=MAX_ID)
    kwargs: dict[str, Any] = {}
    if "context" in msg:
        kwargs["context"] = expect_int(msg["context"], f"{op} context", lo=0, hi=MAX_ID)
    if "wrappers" in msg:
        kwargs["wrappers"] = expect_bytes(msg["wrappers"], f"{op} wrappers", max_len=wire.MAX_MESSAGE_BYTES)
    if "config" in msg:
        kwargs["config"] = decode_config(msg["config"])
    if "chunks" in msg:
        kwargs["chunks"] = _decode_chunks(msg["chunks"], op, keyed=op in ("put", "get"))
    if "namespace" in msg:
        kwargs["namespace"] = _key(msg["namespace"], f"{op} namespace")
    if "keys" in msg:
        keys = expect_list(msg["keys"], f"{op} keys", max_len=MAX_CHUNKS)
        kwargs["keys"] = tuple(_key(k, f"{op} key {i}") for i, k in enumerate(keys))
    if "deadline" in msg:
        kwargs["deadline"] = expect_int(msg["deadline"], f"{op} deadline", lo=0, hi=MAX_ID)
    if "namespaces" in msg:
        spaces = expect_list(msg["namespaces"], f"{op} namespaces", max_len=MAX_NAMESPACES)
        if not spaces:
            raise WireFormatError(f"{op} namespaces: must not be empty")
        kwargs["namespaces"] = tuple(_key(n, f"{op} namespaces[{i}]") for i, n in enumerate(spaces))
    if "lease" in msg:
        kwargs["lease"] = expect_int(msg["lease"], f"{op} lease", lo=1, hi=MAX_ID)
    if "lease_ms" in msg:
        kwargs["lease_ms"] = expect_int(msg["lease_ms"], f"{op} lease_ms", lo=1, hi=MAX_LEASE_MS)
    if "event" in msg:
        kwargs["event"] = expect_bytes(msg["event"], f"{op} event", max_len=MAX_HANDLE_BYTES)
        if not kwargs["event"]:
            raise WireFormatError(f"{op} event: must not be empty (leave the field out for no event)")
    if op == "lookup":
        if ("namespace" in msg) == ("namespaces" in msg):
            raise WireFormatError("lookup request: give exactly one of 'namespace' and 'namespaces'")
        if ("lease" in msg) != ("lease_ms" in msg):
            raise WireFormatError("lookup request: 'lease' and 'lease_ms' go together")
    return Request(op=op, request_id=rid, **kwargs)


def _key(value: object, where: str) -> bytes:
    key = expect_bytes(value, where, max_len=MAX_KEY_LEN)
    if not key:
        raise WireFormatError(f"{where}: must not be empty")
    return key


def _decode_chunks(value: object, op: str, *, keyed: bool) -> tuple[Chunk, ...]:
    chunks = []
    for i, item in enumerate(expect_list(value, f"{op} chunks", max_len=MAX_CHUNKS)):
        where = f"{op} chunk {i}"
        pair = expect_list(item, where, max_len=2)
        if len(pair) != 2:
            raise WireFormatError(
                f"{where}: expected [{'key' if keyed else 'chunk_id'}, block_ids_per_group]"
            )
        chunk_id: str | bytes
        if keyed:
            chunk_id = _key(pair[0], f"{where} key")
        else:
            chunk_id = expect_str(pair[0], f"{where} id", max_len=MAX_CHUNK_ID_LEN)
        groups = expect_list(pair[1], f"{where} block ids", max_len=MAX_GROUPS)
        block_ids = tuple(  # SKIP_BLOCK passes here; the context refuses it outside retrieves
            tuple(
                expect_int_list(
                    g, f"{where} group {j}", lo=SKIP_BLOCK, hi=MAX_ID, max_len=MAX_BLOCKS_PER_GROUP
                )
            )
            for j, g in enumerate(groups)
        )
        chunks.append(Chunk(chunk_id, block_ids))
    return tuple(chunks)


# -- the cache-context config ------------------------------------------------------------
#
# The config travels as a map keyed by ENGINE_KEYWORDS, the fields of CacheContextConfig
# an engine chooses; its defaults are the dataclass's. Each field has one encoder and
# one decoder below, and the hint and group maps are keyed by their dataclasses' fields,
# so a new config field needs exactly its two codec entries (a test checks they exist).
# Fields added after version 1 shipped are optional keys (_OPTIONAL_CONFIG), sent only
# when they differ from their default, so either side may be the older one.

#: Longest engine layer name (``model.layers.3.self_attn.attn`` and the like).
MAX_LAYER_NAME_LEN = 256
_MAX_TOKENS = 1 << 24
_CONFIG_KEYS = frozenset(ENGINE_KEYWORDS)
#: Config keys a map may lack (added after version 1 shipped); the default applies.
_OPTIONAL_CONFIG = frozenset({"chunk_format"})
_HINT_KEYS = frozenset(f.name for f in fields(LayoutHints))
_GROUP_KEYS = frozenset(f.name for f in fields(EngineGroupInfo))
_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default_factory is not MISSING else f.default
    for f in fields(CacheContextConfig)
    if f.name in _CONFIG_KEYS
}


def encode_config(**keywords: Any) -> dict[str, object]:
    """``create_cache_context``'s keywords (after the wrappers) as primitives.

    Keywords not given take :class:`~lmcache_platform.CacheContextConfig`'s defaults.
    """
    unknown = set(keywords) - _CONFIG_KEYS
    if unknown:
        raise TypeError(f"encode_config: unknown keywords {sorted(unknown)} (known: {sorted(_CONFIG_KEYS)})")
    values = {**_DEFAULTS, **keywords}
    return {
        name: _CODEC[name][0](values[name])
        for name in ENGINE_KEYWORDS
        if name not in _OPTIONAL_CONFIG or values[name] != _DEFAULTS[name]
    }


def decode_config(value: object) -> dict[str, Any]:
    """Validate a config map and rebuild the ``create_cache_context`` keyword arguments."""
    msg = expect_map(value, "config", keys=_CONFIG_KEYS - _OPTIONAL_CONFIG, optional=_OPTIONAL_CONFIG)
    return {name: _CODEC[name][1](msg[name]) if name in msg else _DEFAULTS[name] for name in ENGINE_KEYWORDS}


def _encode_hints(hints: LayoutHints | None) -> dict[str, object] | None:
    if hints is None:
        return None
    return {
        "kv_format": hints.kv_format.value if hints.kv_format else None,
        "per_layer": [[i, f.value] for i, f in sorted(hints.per_layer.items())],
        "block_size": hints.block_size,
        "num_kv_heads": hints.num_kv_heads,
        "engine_layout": hints.engine_layout,
        "head_size": hints.head_size,
    }


def _decode_hints(value: object) -> LayoutHints | None:
    if value is None:
        return None
    hints = expect_map(value, "config layout_hints", keys=_HINT_KEYS)
    per_layer = {}
    for i, pair in enumerate(expect_list(hints["per_layer"], "per_layer", max_len=MAX_LAYERS)):
        items = expect_list(pair, f"per_layer[{i}]", max_len=2)
        if len(items) != 2:
            raise WireFormatError(f"config per_layer[{i}]: expected [layer, kv_format]")
        layer = expect_int(items[0], f"config per_layer[{i}] layer", lo=0, hi=MAX_LAYERS)
        per_layer[layer] = _enum(KVFormat, items[1], f"config per_layer[{i}] kv_format")
    return LayoutHints(
        kv_format=_optional(hints["kv_format"], lambda v: _enum(KVFormat, v, "kv_format")),
        per_layer=per_layer,
        block_size=_optional(hints["block_size"], lambda v: _count(v, "block_size")),
        num_kv_heads=_optional(hints["num_kv_heads"], lambda v: _count(v, "num_kv_heads")),
        engine_layout=_optional(hints["engine_layout"], _engine_layout),
        head_size=_optional(hints["head_size"], lambda v: _count(v, "head_size")),
    )


def _encode_groups(groups: Sequence[EngineGroupInfo]) -> list[dict[str, object]]:
    return [
        {
            "layer_indices": list(g.layer_indices),
            "block_size": g.block_size,
            "sliding_window": g.sliding_window,
        }
        for g in groups
    ]


def _decode_groups(value: object) -> tuple[EngineGroupInfo, ...]:
    groups = []
    for i, g in enumerate(expect_list(value, "groups", max_len=MAX_GROUPS)):
        where = f"config engine_group_infos[{i}]"
        info = expect_map(g, where, keys=_GROUP_KEYS)
        groups.append(
            EngineGroupInfo(
                layer_indices=tuple(
                    expect_int_list(
                        info["layer_indices"],
                        f"{where} layer_indices",
                        lo=0,
                        hi=MAX_LAYERS,
                        max_len=MAX_LAYERS,
                    )
                ),
                block_size=_count(info["block_size"], f"{where} block_size"),
                sliding_window=_optional(
                    info["sliding_window"], lambda v, w=where: _count(v, f"{w} sliding_window")
                ),
            )
        )
    return tuple(groups)


def _decode_layer_names(value: object) -> tuple[str, ...]:
    names = expect_list(value, "layer_names", max_len=MAX_LAYERS)
    return tuple(
        expect_str(name, f"config layer_names[{i}]", max_len=MAX_LAYER_NAME_LEN)
        for i, name in enumerate(names)
    )


def _keep(value: Any) -> Any:
    return value


#: config field -> (encode, decode): one entry per name in ENGINE_KEYWORDS.
_CODEC: dict[str, tuple[Callable[[Any], object], Callable[[object], Any]]] = {
    "lmcache_tokens_per_chunk": (
        _keep,
        lambda v: expect_int(v, "config lmcache_tokens_per_chunk", lo=1, hi=_MAX_TOKENS),
    ),
    "layout_hints": (_encode_hints, _decode_hints),
    "engine_group_infos": (_encode_groups, _decode_groups),
    "engine_type": (lambda e: e.value, lambda v: _enum(EngineType, v, "config engine_type")),
    "separate_object_groups": (_keep, lambda v: expect_bool(v, "config separate_object_groups")),
    "full_sw_kv": (_keep, lambda v: expect_bool(v, "config full_sw_kv")),
    "layer_names": (list, _decode_layer_names),
    "chunk_format": (_keep, lambda v: _choice(v, CHUNK_FORMATS, "config chunk_format")),
}


def _choice(value: object, allowed: Sequence[str], where: str) -> str:
    text = expect_str(value, where, max_len=64)
    if text not in allowed:
        raise WireFormatError(f"{where}: unknown value {text!r} (known: {', '.join(allowed)})")
    return text


def _engine_layout(value: object) -> str:
    name = expect_str(value, "config layout_hints engine_layout", max_len=8)
    if name not in ENGINE_LAYOUTS:
        raise WireFormatError(f"config layout_hints engine_layout: {name!r} is not a known layout")
    return name


def _count(value: object, where: str) -> int:
    return expect_int(value, where, lo=1, hi=_MAX_TOKENS)


def _optional(value: object, parse: Any) -> Any:
    return None if value is None else parse(value)


def _enum(kind: Any, value: object, where: str) -> Any:
    text = expect_str(value, where, max_len=64)
    try:
        return kind(text)
    except ValueError:
        known = ", ".join(m.value for m in kind)
        raise WireFormatError(f"{where}: unknown value {text!r} (known: {known})") from None


# -- replies -----------------------------------------------------------------------------


def encode_reply(request_id: int, result: dict[str, Any]) -> bytes:
    """A success reply; ``result`` must hold plain values only."""
    msg = {"id": request_id, "ok": True, "result": result}
    return _codec.pack(MAGIC, VERSION, msg, max_bytes=MAX_FRAME_BYTES, what="reply")


def encode_error(request_id: int, kind: str, message: str) -> bytes:
    """An error reply naming the exception class and its message (truncated)."""
    msg = {"id": request_id, "ok": False, "error": {"type": kind[:128], "message": message[:8192]}}
    return _codec.pack(MAGIC, VERSION, msg, max_bytes=MAX_FRAME_BYTES, what="reply")


@dataclass(frozen=True)
class Reply:
    request_id: int
    ok: bool
    result: dict[str, Any]
    error_type: str = ""
    error_message: str = ""


def decode_reply(payload: bytes) -> Reply:
    """Parse a reply. The server is trusted no more than the client: same limits."""
    msg = expect_map(
        _codec.unpack(MAGIC, VERSION, payload, _LIMITS, what="reply"),
        "reply",
        keys={"id", "ok"},
        optional={"result", "error"},
    )
    rid = expect_int(msg["id"], "reply id", lo=0, hi=MAX_ID)
    if expect_bool(msg["ok"], "reply ok"):
        result = msg.get("result")
        if not isinstance(result, dict):  # op-specific keys, read by the client by name
            raise WireFormatError(f"reply result: expected a map, got {type(result).__name__}")
        return Reply(rid, True, result)
    error = expect_map(msg.get("error"), "reply error", keys={"type", "message"})
    return Reply(
        rid,
        False,
        {},
        expect_str(error["type"], "reply error type", max_len=128),
        expect_str(error["message"], "reply error message", max_len=8192),
    )

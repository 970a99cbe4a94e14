"""The reference server's protocol: typed messages in length-prefixed frames.

Frames (``protocol._frames``) hold one envelope each (see :mod:`lmcache_platform._codec`)
with magic ``LMCP``: a request map from the engine, or a reply map from the server.
Requests are the types of ``protocol._ops`` (one per op, with its result type); this
module turns them into bytes and back, checking every field of a request against its
op's type (required fields are those without a default) and refusing anything else.
Registration embeds the wrapper list as a :mod:`lmcache_platform.wire` message, which
the server decodes with its own allow-list; fds the wrappers name travel beside the
frame (``protocol._frames``).

Two ways to name a chunk: ``store``/``retrieve`` take chunk ids (``str``) private to
one context; ``put``/``get``/``lookup`` take content keys (``bytes``) in the
namespace a context registered with, shared by every context of that namespace.

Every request may carry ``deadline`` (``time.monotonic_ns()`` of the client's host,
which must be the server's): work still undone when it passes is dropped. Transfers
(``store``, ``retrieve``, ``put``, ``get``) may carry ``event``, a device event's handle
(:func:`lmcache_platform.record_event`): the server's copies wait on it. Fields
added after version 1 shipped are optional, and replies gain keys only for requests
that use one of them (see :attr:`~lmcache_platform.protocol._ops.Request.extended`), so
older clients keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
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
from ._frames import (  # the protocol's framing, named here too
    MAX_FRAME_BYTES,
    PREFIX_BYTES,
    frame,
    frame_length,
    recv_frame,
    send_frame,
)
from ._ops import MAX_ID, MAX_KEY_LEN, OPS, REQUEST_TYPES, Chunk, Request

MAGIC = b"LMCP"
VERSION = 1
#: Most chunks in one store, retrieve, put or get request, and keys in one lookup.
MAX_CHUNKS = 4096
#: Most KV-cache groups per chunk, and block ids per group.
MAX_GROUPS = 64
MAX_BLOCKS_PER_GROUP = 1 << 16
MAX_CHUNK_ID_LEN = 256
MAX_LAYERS = wire.MAX_WRAPPERS
#: Most namespaces in one ``lookup``.
MAX_NAMESPACES = 256
#: Longest lease a ``lookup`` may take (milliseconds).
MAX_LEASE_MS = 600_000
#: The error type of a reply to a request whose deadline passed before its work was done.
DEADLINE_EXCEEDED = "DeadlineExceeded"

__all__ = [
    "DEADLINE_EXCEEDED",
    "MAGIC",
    "MAX_BLOCKS_PER_GROUP",
    "MAX_CHUNKS",
    "MAX_CHUNK_ID_LEN",
    "MAX_FRAME_BYTES",
    "MAX_GROUPS",
    "MAX_ID",
    "MAX_KEY_LEN",
    "MAX_LAYERS",
    "MAX_LEASE_MS",
    "MAX_NAMESPACES",
    "OPS",
    "PREFIX_BYTES",
    "VERSION",
    "Chunk",
    "Reply",
    "decode_config",
    "decode_reply",
    "decode_request",
    "encode_config",
    "encode_error",
    "encode_reply",
    "encode_request",
    "frame",
    "frame_length",
    "recv_frame",
    "request_id_of",
    "send_frame",
]

_LIMITS = _codec.Limits(
    max_bytes=MAX_FRAME_BYTES,
    max_array_len=MAX_BLOCKS_PER_GROUP,
    max_map_len=256,
    max_str_len=1 << 20,
    max_bin_len=wire.MAX_MESSAGE_BYTES,
)


# -- requests ----------------------------------------------------------------------------


def _schema(cls: type[Request[Any]]) -> tuple[frozenset[str], frozenset[str]]:
    """An op's wire keys beyond "op", "id" and "deadline": (required, optional), from its type."""
    own = [f for f in fields(cls) if f.name not in ("request_id", "deadline")]
    required = frozenset(f.name for f in own if f.default is MISSING and f.default_factory is MISSING)
    return required, frozenset(f.name for f in own) - required


#: op -> (required keys, optional keys), derived from the request types.
_SCHEMA = {op: _schema(cls) for op, cls in REQUEST_TYPES.items()}


def encode(request: Request[Any]) -> bytes:
    """A request's frame payload; refuses (:class:`WireFormatError`) what the server would refuse."""
    op, values = request.wire()
    return encode_request(op, request.request_id, deadline=request.deadline, **values)


def encode_request(op: str, request_id: int, **values: Any) -> bytes:
    """Build a request frame payload from wire fields; ``None`` values are left out.

    The low-level form of :func:`encode` (tools and tests craft raw requests with it):
    chunks may be :class:`Chunk` values, and ``config`` takes ``create_cache_context``'s
    keywords. The result is checked as :func:`decode_request` checks it.
    """
    msg: dict[str, object] = {"op": op, "id": request_id}
    for key, value in values.items():
        if value is None:
            continue
        if key == "config":
            value = encode_config(**value)
        elif key == "chunks":
            value = [[c.chunk_id, [list(g) for g in c.block_ids]] for c in value]
        elif isinstance(value, tuple):
            value = list(value)
        msg[key] = value
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


def decode_request(payload: bytes) -> Request[Any]:
    """Parse and validate a request into its op's type; raise :class:`WireFormatError` naming the culprit."""
    msg = _codec.unpack(MAGIC, VERSION, payload, _LIMITS, what="request")
    if not isinstance(msg, dict):
        raise WireFormatError(f"request: expected a map, got {type(msg).__name__}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in _SCHEMA:
        raise WireFormatError(f"request: unknown op {show(op)} (known: {', '.join(OPS)})")
    required, optional = _SCHEMA[op]
    expect_map(msg, f"{op} request", keys=required | {"op", "id"}, optional=optional | {"deadline"})
    rid = expect_int(msg["id"], f"{op} request id", lo=0, hi=MAX_ID)
    kwargs = {key: _FIELDS[key](value, op) for key, value in msg.items() if key not in ("op", "id")}
    request = REQUEST_TYPES[op](request_id=rid, **kwargs)
    request.check()
    return request


def _key(value: object, where: str) -> bytes:
    key = expect_bytes(value, where, max_len=MAX_KEY_LEN)
    if not key:
        raise WireFormatError(f"{where}: must not be empty")
    return key


def _decode_chunks(value: object, op: str) -> tuple[Chunk, ...]:
    keyed = getattr(REQUEST_TYPES[op], "keyed", False)
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


def _decode_keys(value: object, op: str) -> tuple[bytes, ...]:
    keys = expect_list(value, f"{op} keys", max_len=MAX_CHUNKS)
    return tuple(_key(k, f"{op} key {i}") for i, k in enumerate(keys))


def _decode_namespaces(value: object, op: str) -> tuple[bytes, ...]:
    spaces = expect_list(value, f"{op} namespaces", max_len=MAX_NAMESPACES)
    if not spaces:
        raise WireFormatError(f"{op} namespaces: must not be empty")
    return tuple(_key(n, f"{op} namespaces[{i}]") for i, n in enumerate(spaces))


def _decode_event(value: object, op: str) -> bytes:
    event = expect_bytes(value, f"{op} event", max_len=MAX_HANDLE_BYTES)
    if not event:
        raise WireFormatError(f"{op} event: must not be empty (leave the field out for no event)")
    return event


#: Wire key -> its decoder ``(value, op) -> field value``: one per field of every request type.
_FIELDS: dict[str, Callable[[object, str], Any]] = {
    "deadline": lambda v, op: expect_int(v, f"{op} deadline", lo=0, hi=MAX_ID),
    "context": lambda v, op: expect_int(v, f"{op} context", lo=0, hi=MAX_ID),
    "wrappers": lambda v, op: expect_bytes(v, f"{op} wrappers", max_len=wire.MAX_MESSAGE_BYTES),
    "config": lambda v, op: decode_config(v),
    "chunks": _decode_chunks,
    "namespace": lambda v, op: _key(v, f"{op} namespace"),
    "keys": _decode_keys,
    "namespaces": _decode_namespaces,
    "lease": lambda v, op: expect_int(v, f"{op} lease", lo=1, hi=MAX_ID),
    "lease_ms": lambda v, op: expect_int(v, f"{op} lease_ms", lo=1, hi=MAX_LEASE_MS),
    "event": _decode_event,
    "since": lambda v, op: expect_int(v, f"{op} since", lo=0, hi=MAX_ID),
}


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

"""The server's operations, each written once: its request type and its result type.

A request is a frozen dataclass whose fields are its wire fields (``op`` names it on
the wire); the type parameter is its result, so both clients are typed end to end:
:meth:`ServerClient.execute(GetRequest(...)) <lmcache_platform.server.ServerClient.execute>`
returns a :class:`GetResult`, and :meth:`AsyncClient.execute
<lmcache_platform.server.AsyncClient.execute>` a ``Pending[GetResult]``. The server
decodes frames into these types (``_messages.decode_request``) and answers each with
its result. A protocol change is a change here, and a type error wherever it matters.

Fields added after version 1 shipped are optional, and a result carries its newer
fields only for requests that use one of them (:attr:`Request.extended`), so older
clients, which check reply maps exactly, keep working.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from .. import _checks
from .._errors import ServerError, WireFormatError

if TYPE_CHECKING:
    from typing_extensions import Self

R = TypeVar("R", covariant=True)
Json = dict[str, Any]

#: Largest id, count or time either side accepts in a message.
MAX_ID = (1 << 63) - 1
#: Longest content key and namespace (bytes; both at least 1).
MAX_KEY_LEN = 64
#: Marks a result field added after version 1: sent only to requests that are :attr:`~Request.extended`.
NEWER = {"newer": True}
#: A newer field sent only when it is not 0: a reader that predates it sees the exact map it
#: expects in the common case, and the rare case is news even to an exact reader.
NEWER_SPARSE = {"newer": True, "sparse": True}


@dataclass(frozen=True)
class Chunk:
    """One chunk to move: its name in server memory and the engine block ids per group.

    The name is a chunk id (``str``, for ``store``/``retrieve``) or a content key
    (``bytes``, for ``put``/``get``).
    """

    chunk_id: str | bytes
    block_ids: tuple[tuple[int, ...], ...]


#: A chunk as callers give it: a :class:`Chunk`, or ``(name, [[block ids of group 0], ...])``.
ChunkLike = Chunk | tuple[str | bytes, Sequence[Sequence[int]]]


def as_chunks(specs: Iterable[ChunkLike]) -> tuple[Chunk, ...]:
    """``(name, block ids per group)`` pairs (or chunks) as :class:`Chunk` values."""
    out = []
    for spec in specs:
        if isinstance(spec, Chunk):
            out.append(spec)
        else:
            name, groups = spec
            out.append(Chunk(name, tuple(tuple(map(operator.index, g)) for g in groups)))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class SessionField:
    """A value the sending client fills in from its session (what its ``on_connect`` returned).

    ``AsyncClient.SESSION_CONTEXT`` stands for the context the connection registered: an
    engine that reconnects to a restarted server registers anew, and requests queued
    before that carry the new id.
    """

    name: str

    def __repr__(self) -> str:
        return f"<session {self.name}>"


def bind(request: Request[R], session: object) -> Request[R]:
    """``request`` with every :class:`SessionField` replaced by the session's attribute of that name.

    Raises :class:`~lmcache_platform.ServerError` naming the op and field when the
    session lacks it (no ``on_connect``, or one that returned nothing).
    """

    def value(name: str, v: Any) -> Any:
        if not isinstance(v, SessionField):
            return v
        if session is None or not hasattr(session, v.name):
            op = request.wire()[0] if isinstance(request, RawRequest) else request.op
            raise ServerError(f"{op}: {name} names the session's {v.name!r}, which on_connect did not set")
        return getattr(session, v.name)

    if isinstance(request, RawRequest):
        changed: Json = {"raw_fields": {k: value(k, v) for k, v in request.raw_fields.items()}}
    else:
        changed = {f.name: value(f.name, getattr(request, f.name)) for f in fields(request)}
    changed = {k: v for k, v in changed.items() if v != getattr(request, k)}
    return dataclasses.replace(request, **changed) if changed else request


# -- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Counts:
    """A result of int fields only; its wire form is a map of them."""

    @classmethod
    def from_wire(cls, result: Json, op: str) -> Self:
        spec = fields(cls)
        required = {f.name for f in spec if not f.metadata.get("newer")}
        optional = {f.name for f in spec} - required
        r = _checks.expect_map(result, f"{op} reply", keys=required, optional=optional)
        return cls(**{k: _checks.expect_int(v, f"{op} reply {k}", lo=0, hi=MAX_ID) for k, v in r.items()})

    def to_wire(self, *, extended: bool) -> Json:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if (extended or not f.metadata.get("newer"))
            and not (f.metadata.get("sparse") and not getattr(self, f.name))
        }


@dataclass(frozen=True)
class StoreResult(_Counts):
    """What a ``store`` copied into the server."""

    stored: int
    bytes: int


@dataclass(frozen=True)
class RetrieveResult(_Counts):
    """What a ``retrieve`` wrote."""

    retrieved: int
    bytes: int


@dataclass(frozen=True)
class PutResult(_Counts):
    """What a keyed store did with each of its chunks."""

    #: Chunks copied into the server.
    stored: int
    #: Chunks not copied because the server already had them (or another engine was
    #: storing them).
    present: int
    #: Chunks not stored because no room could be made (the rest of the request).
    dropped: int
    #: Chunks evicted to make room.
    evicted: int
    #: Bytes copied.
    bytes: int


@dataclass(frozen=True)
class GetResult(_Counts):
    """What a keyed retrieve wrote."""

    #: Leading chunks of the request written into the engine's blocks; the rest were not
    #: in the server and their blocks are untouched.
    retrieved: int
    bytes: int


@dataclass(frozen=True)
class LookupResult(_Counts):
    """How many leading keys the server holds (in every namespace asked)."""

    hits: int
    #: Of those, how many only the remote tier holds (sent to extended requests only).
    remote: int = field(default=0, metadata=NEWER)
    #: How many of the namespaces asked no live context has registered here, so that no
    #: engine of theirs could load a hit now (a restarted server its workers have not
    #: reached yet). Extended requests only, and only when not 0; 0 from older servers.
    unregistered: int = field(default=0, metadata=NEWER_SPARSE)


@dataclass(frozen=True)
class PingResult(_Counts):
    """The server's clock and process."""

    #: The server's ``time.monotonic_ns()`` when it answered.
    now: int
    pid: int


@dataclass(frozen=True)
class RemovalsResult:
    """Shared chunks the server evicted from its memory since a cursor."""

    #: ``(index into the request's namespaces, key)`` per chunk, oldest first.
    removed: tuple[tuple[int, bytes], ...]
    #: Where the next request should start (its ``since``).
    cursor: int
    #: Removals after ``since`` were already forgotten: some chunks went unreported.
    missed: bool

    @classmethod
    def from_wire(cls, result: Json, op: str = "removals") -> RemovalsResult:
        r = _checks.expect_map(result, f"{op} reply", keys={"removed", "cursor", "missed"})
        pairs = []
        for i, item in enumerate(_checks.expect_list(r["removed"], f"{op} reply removed", max_len=1 << 16)):
            pair = _checks.expect_list(item, f"{op} reply removed[{i}]", max_len=2)
            if len(pair) != 2:
                raise WireFormatError(f"{op} reply removed[{i}]: expected [namespace index, key]")
            index = _checks.expect_int(pair[0], f"{op} reply removed[{i}] namespace", lo=0, hi=MAX_ID)
            pairs.append(
                (index, _checks.expect_bytes(pair[1], f"{op} reply removed[{i}] key", max_len=MAX_KEY_LEN))
            )
        return cls(
            removed=tuple(pairs),
            cursor=_checks.expect_int(r["cursor"], f"{op} reply cursor", lo=0, hi=MAX_ID),
            missed=_checks.expect_bool(r["missed"], f"{op} reply missed"),
        )

    def to_wire(self, *, extended: bool) -> Json:
        return {
            "removed": [list(pair) for pair in self.removed],
            "cursor": self.cursor,
            "missed": self.missed,
        }


_REGISTRATION_COUNTS = ("context", "num_layers", "num_object_groups", "max_batch_size", "chunk_bytes")


@dataclass(frozen=True)
class Registration:
    """What the server answered to ``register``."""

    context: int
    device_type: str
    backend: dict[str, Any]
    num_layers: int
    num_object_groups: int
    max_batch_size: int
    #: Bytes of one chunk in server memory (all object groups).
    chunk_bytes: int
    #: The namespace of this context's keyed chunks; ``b""`` when registered without one.
    namespace: bytes = b""
    #: The server's ``time.monotonic_ns()`` when it answered (0 from a server that does not say).
    now: int = field(default=0, metadata=NEWER)

    @classmethod
    def from_wire(cls, result: Json, op: str = "register") -> Registration:
        keys = {f.name for f in fields(cls)} - {"now"}
        r = _checks.expect_map(result, f"{op} reply", keys=keys, optional={"now"})
        backend = r["backend"]
        if not isinstance(backend, dict):
            raise WireFormatError(f"{op} reply: backend must be a map")
        counts = {
            k: _checks.expect_int(r[k], f"{op} reply {k}", lo=0, hi=MAX_ID) for k in _REGISTRATION_COUNTS
        }
        return cls(
            device_type=_checks.expect_str(r["device_type"], f"{op} reply device_type", max_len=32),
            backend=backend,
            namespace=_checks.expect_bytes(r["namespace"], f"{op} reply namespace", max_len=MAX_KEY_LEN),
            now=_checks.expect_int(r.get("now", 0), f"{op} reply now", lo=0, hi=MAX_ID),
            **counts,
        )

    def to_wire(self, *, extended: bool) -> Json:
        out = dataclasses.asdict(self)
        if not extended:
            del out["now"]
        return out


# -- requests ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Request(Generic[R]):
    """Base of every request; the type parameter is what the server answers with.

    ``request_id`` and ``deadline`` are filled in by the client that sends it (a
    deadline is ``time.monotonic_ns()`` of the client's host, which must be the
    server's: work still undone when it passes is dropped).
    """

    #: The op's name on the wire.
    op: ClassVar[str] = ""
    #: Whether :class:`~lmcache_platform.server.AsyncClient` sends it on its control
    #: connection (it never writes into an engine, so a slow transfer must not delay it).
    control: ClassVar[bool] = False
    request_id: int = 0
    #: ``time.monotonic_ns()`` after which the request must not act; ``None``: no deadline.
    deadline: int | None = None

    def wire(self) -> tuple[str, Json]:
        """``(op, fields)``: the fields that differ from their defaults, id and deadline aside."""
        out = {}
        for f in fields(self):
            if f.name in ("request_id", "deadline"):
                continue
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                out[f.name] = value
        return self.op, out

    def check(self) -> None:
        """Refuse field combinations no schema can express (:class:`~lmcache_platform.WireFormatError`)."""

    @property
    def extended(self) -> bool:
        """Whether the request uses a field added after version 1 shipped.

        Replies carry their newer keys (``now``, ``remote``) only then, so clients
        that predate those keys, and check reply maps exactly, see what they expect.
        """
        return self.deadline is not None

    def decode_result(self, result: Json) -> R:
        """The typed result of a reply's result map (validated like any untrusted input)."""
        raise NotImplementedError(type(self).__name__)

    def encode_result(self, result: Any) -> Json:
        """The server side: the result map for the reply to this request."""
        return dict(result.to_wire(extended=self.extended))


@dataclass(frozen=True, kw_only=True)
class _Empty(Request[None]):
    """A request whose reply result is an empty map."""

    def decode_result(self, result: Json) -> None:
        _checks.expect_map(result, f"{self.op} reply", keys=set())

    def encode_result(self, result: Any) -> Json:
        return {}


@dataclass(frozen=True, kw_only=True)
class RegisterRequest(Request[Registration]):
    """Hand a list of wrappers (a ``wire`` message) to the server, which builds a cache context."""

    op: ClassVar[str] = "register"
    wrappers: bytes
    #: ``create_cache_context``'s keywords after the wrappers.
    config: dict[str, Any]
    namespace: bytes = b""

    def decode_result(self, result: Json) -> Registration:
        return Registration.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class _Transfer(Request[R]):
    """A transfer between an engine's blocks and server memory."""

    #: Whether its chunks are named by content keys (``bytes``) rather than chunk ids.
    keyed: ClassVar[bool] = False
    #: The context's id, or a :class:`SessionField` the sending client fills in.
    context: int | SessionField
    chunks: tuple[Chunk, ...]
    #: The handle of an engine's device event to order the copies after (empty: none).
    event: bytes = b""

    @classmethod
    def of(
        cls,
        context: int | SessionField,
        chunks: Iterable[ChunkLike],
        *,
        event: bytes | None = None,
        **more: Any,
    ) -> Self:
        """The request from what callers hold: chunks as pairs or :class:`Chunk` values, no event
        as ``None``. Both clients' per-op methods are this and ``execute``."""
        return cls(context=context, chunks=as_chunks(chunks), event=event or b"", **more)


@dataclass(frozen=True, kw_only=True)
class StoreRequest(_Transfer[StoreResult]):
    """Copy chunks named by chunk ids (private to the context) into server memory."""

    op: ClassVar[str] = "store"

    def decode_result(self, result: Json) -> StoreResult:
        return StoreResult.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class RetrieveRequest(_Transfer[RetrieveResult]):
    """Copy stored chunks (by chunk id) back into the given blocks."""

    op: ClassVar[str] = "retrieve"

    def decode_result(self, result: Json) -> RetrieveResult:
        return RetrieveResult.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class PutRequest(_Transfer[PutResult]):
    """Keyed store: copy the chunks the server does not have into it."""

    op: ClassVar[str] = "put"
    keyed: ClassVar[bool] = True

    def decode_result(self, result: Json) -> PutResult:
        return PutResult.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class GetRequest(_Transfer[GetResult]):
    """Keyed retrieve: write the leading chunks the server has into the given blocks."""

    op: ClassVar[str] = "get"
    keyed: ClassVar[bool] = True
    #: The lease whose pins this get releases once done; 0 for none.
    lease: int = 0

    @classmethod
    def of(
        cls,
        context: int | SessionField,
        chunks: Iterable[ChunkLike],
        *,
        event: bytes | None = None,
        lease: int | None = None,
        **more: Any,
    ) -> Self:
        return super().of(context, chunks, event=event, lease=lease or 0, **more)

    @property
    def extended(self) -> bool:
        return super().extended or bool(self.lease)

    def decode_result(self, result: Json) -> GetResult:
        return GetResult.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class LookupRequest(Request[LookupResult]):
    """Leading ``keys`` held in ``namespace`` (or in every one of ``namespaces``)."""

    op: ClassVar[str] = "lookup"
    control: ClassVar[bool] = True
    keys: tuple[bytes, ...]
    namespace: bytes = b""
    namespaces: tuple[bytes, ...] = ()
    #: A fresh id pinning the hits until a get reads them, 0 for no lease; ``lease_ms`` is its life.
    lease: int = 0
    lease_ms: int = 0

    @classmethod
    def of(
        cls,
        namespaces: bytes | Sequence[bytes],
        keys: Sequence[bytes],
        *,
        lease: int | None = None,
        lease_ms: int | None = None,
    ) -> LookupRequest:
        """A lookup in one namespace (``bytes``) or in every one of several; ``None`` for no lease."""
        where: Json = (
            {"namespace": namespaces} if isinstance(namespaces, bytes) else {"namespaces": tuple(namespaces)}
        )
        return cls(keys=tuple(keys), lease=lease or 0, lease_ms=lease_ms or 0, **where)

    @property
    def lookup_namespaces(self) -> tuple[bytes, ...]:
        """The namespaces covered, given as ``namespace`` or ``namespaces``."""
        return self.namespaces or (self.namespace,)

    @property
    def extended(self) -> bool:
        return super().extended or bool(self.namespaces) or bool(self.lease)

    def check(self) -> None:
        if bool(self.namespace) == bool(self.namespaces):
            raise WireFormatError("lookup request: give exactly one of 'namespace' and 'namespaces'")
        if bool(self.lease) != bool(self.lease_ms):
            raise WireFormatError("lookup request: 'lease' and 'lease_ms' go together")

    def decode_result(self, result: Json) -> LookupResult:
        return LookupResult.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class RemovalsRequest(Request[RemovalsResult]):
    """Which shared chunks of ``namespaces`` the server evicted after cursor ``since``.

    For KV-cache events: an engine reports to its router the chunks it stored and, from
    these answers, the ones the server no longer holds.
    """

    op: ClassVar[str] = "removals"
    control: ClassVar[bool] = True
    namespaces: tuple[bytes, ...]
    since: int = 0

    def decode_result(self, result: Json) -> RemovalsResult:
        return RemovalsResult.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class ReleaseRequest(_Empty):
    """End a lease now (a no-op if it already ended)."""

    op: ClassVar[str] = "release"
    control: ClassVar[bool] = True
    lease: int

    @property
    def extended(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class PingRequest(Request[PingResult]):
    """The server's clock and pid, answered without waiting on any transfer."""

    op: ClassVar[str] = "ping"
    control: ClassVar[bool] = True

    def decode_result(self, result: Json) -> PingResult:
        return PingResult.from_wire(result, self.op)


@dataclass(frozen=True, kw_only=True)
class UnregisterRequest(_Empty):
    """Close a context; its keyed chunks stay in the server, its chunk ids go."""

    op: ClassVar[str] = "unregister"
    context: int


@dataclass(frozen=True, kw_only=True)
class StatusRequest(Request[Json]):
    """The server's counters; with a ``context`` of this connection, its report too."""

    op: ClassVar[str] = "status"
    control: ClassVar[bool] = True
    context: int = 0

    def decode_result(self, result: Json) -> Json:
        return _checks.expect_map(result, "status reply", keys={"server"}, optional={"context"})

    def encode_result(self, result: Any) -> Json:
        return dict(result)


@dataclass(frozen=True, kw_only=True)
class ShutdownRequest(_Empty):
    """Stop the server once this request is answered."""

    op: ClassVar[str] = "shutdown"


@dataclass(frozen=True, kw_only=True)
class RawRequest(Request[Json]):
    """Any op with fields as given, the result map as sent: for tools and tests.

    Nothing checks ``raw_fields`` before the frame is encoded; the encoder refuses what
    the server would refuse, and the reply's result map comes back unchecked.
    """

    raw_op: str
    raw_fields: Json = field(default_factory=dict)
    #: Which of :class:`~lmcache_platform.server.AsyncClient`'s connections carries it
    #: (``None``: the op's own, the control connection for control ops).
    control_link: bool | None = None

    def wire(self) -> tuple[str, Json]:
        return self.raw_op, {k: v for k, v in self.raw_fields.items() if v is not None}

    def decode_result(self, result: Json) -> Json:
        return result


#: Every op's request type, by its name on the wire.
REQUEST_TYPES: dict[str, type[Request[Any]]] = {
    cls.op: cls
    for cls in (
        RegisterRequest,
        StoreRequest,
        RetrieveRequest,
        PutRequest,
        GetRequest,
        LookupRequest,
        RemovalsRequest,
        ReleaseRequest,
        PingRequest,
        UnregisterRequest,
        StatusRequest,
        ShutdownRequest,
    )
}
#: The ops, in the order the wire-format page lists them.
OPS = tuple(REQUEST_TYPES)

"""Engine-side client of the reference server: what an engine's connector calls.

One blocking request at a time per client, over the server's UNIX socket (for an
engine's hot path, :class:`~lmcache_platform.server.AsyncClient` never blocks). Wrappers
travel as :mod:`lmcache_platform.wire` messages; everything else as the typed
requests of ``lmcache_platform.server._protocol``. A server-side failure raises
:class:`ServerError` carrying the server's exception type and message.

Two ways to name chunks: :meth:`ServerClient.store` / :meth:`~ServerClient.retrieve`
take chunk ids private to one context; :meth:`~ServerClient.put`,
:meth:`~ServerClient.get` and :meth:`~ServerClient.lookup` take content keys
(:func:`~lmcache_platform.server.chunk_keys`) in the context's namespace, shared by
every engine that registers with the same namespace.
"""

from __future__ import annotations

import operator
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _checks, wire
from .._errors import ServerError, ServerUnavailable, WireFormatError
from . import _protocol
from ._protocol import Chunk

if TYPE_CHECKING:
    from typing_extensions import Self

    from .._ipc_wrapper import DeviceIPCWrapper

#: A chunk to move: its chunk id (``str``) or content key (``bytes``) and the engine
#: block ids of each KV-cache group.
ChunkSpec = tuple[str, Sequence[Sequence[int]]]
KeyedChunkSpec = tuple[bytes, Sequence[Sequence[int]]]


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
    now: int = 0


@dataclass(frozen=True)
class PutResult:
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
class GetResult:
    """What a keyed retrieve wrote."""

    #: Leading chunks of the request written into the engine's blocks; the rest were not
    #: in the server and their blocks are untouched.
    retrieved: int
    bytes: int


_REGISTRATION_KEYS = frozenset(Registration.__dataclass_fields__) - {"now"}


class ServerClient:
    """A connection to a :class:`lmcache_platform.server.ReferenceServer`.

    ``timeout`` bounds each socket operation. With ``deadline_ms`` every request carries
    a deadline that many milliseconds ahead (the server drops it once late) and the client
    waits for the reply until that deadline at most, however slowly bytes arrive; a late
    reply raises :class:`~lmcache_platform.server.ServerUnavailable` and closes the
    connection (its replies would be out of step).
    """

    def __init__(
        self, socket_path: str, *, timeout: float | None = 120.0, deadline_ms: float | None = None
    ) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout if deadline_ms is None else min(timeout or 1e9, deadline_ms / 1e3))
        try:
            sock.connect(socket_path)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout)
        self._setup(sock, deadline_ms)

    def _setup(self, sock: socket.socket, deadline_ms: float | None) -> None:
        self._sock = sock
        self.deadline_ms = deadline_ms
        self._next_id = 1

    def register(
        self,
        wrappers: Sequence[DeviceIPCWrapper] | Mapping[str, DeviceIPCWrapper],
        *,
        namespace: bytes | None = None,
        **config: Any,
    ) -> Registration:
        """Hand the per-layer wrappers to the server, which builds a cache context.

        ``wrappers`` is what :func:`lmcache_platform.wrap_kv_caches` returned; from a
        dict the engine's layer names travel too, so the server's errors name them.
        ``config`` takes the keyword arguments of
        :func:`lmcache_platform.create_cache_context` after the wrappers. With a
        ``namespace`` (:func:`~lmcache_platform.server.cache_namespace`) the context
        can :meth:`put` and :meth:`get` keyed chunks; the server refuses it if the
        namespace already holds chunks of another KV layout.
        """
        if isinstance(wrappers, Mapping):
            config = {"layer_names": list(wrappers), **config}
            wrappers = list(wrappers.values())
        fields: dict[str, Any] = {"wrappers": wire.encode(wrappers), "config": config}
        if namespace is not None:
            fields["namespace"] = namespace
        r = _checks.expect_map(
            self.call("register", **fields), "register reply", keys=_REGISTRATION_KEYS, optional={"now"}
        )
        backend = r["backend"]
        if not isinstance(backend, dict):
            raise WireFormatError("register reply: backend must be a map")
        counts = {
            k: _checks.expect_int(r[k], f"register reply {k}", lo=0, hi=_protocol.MAX_ID)
            for k in ("context", "num_layers", "num_object_groups", "max_batch_size", "chunk_bytes")
        }
        device_type = _checks.expect_str(r["device_type"], "register reply device_type", max_len=32)
        ns = _checks.expect_bytes(r["namespace"], "register reply namespace", max_len=_protocol.MAX_KEY_LEN)
        now = _checks.expect_int(r.get("now", 0), "register reply now", lo=0, hi=_protocol.MAX_ID)
        return Registration(device_type=device_type, backend=backend, namespace=ns, now=now, **counts)

    def store(self, context: int, chunks: Sequence[ChunkSpec], *, event: bytes | None = None) -> int:
        """Copy chunks from the engine's blocks into server memory; return the bytes stored.

        ``event``: a device event's handle (:func:`lmcache_platform.record_event`) the
        server's reads wait for on the device; likewise for the other transfers.
        """
        return int(self.call("store", context=context, chunks=_chunks(chunks), event=event)["bytes"])

    def retrieve(self, context: int, chunks: Sequence[ChunkSpec], *, event: bytes | None = None) -> int:
        """Copy stored chunks back into the given blocks; return the bytes written."""
        return int(self.call("retrieve", context=context, chunks=_chunks(chunks), event=event)["bytes"])

    def put(self, context: int, chunks: Sequence[KeyedChunkSpec], *, event: bytes | None = None) -> PutResult:
        """Keyed store: copy the chunks the server does not have yet into it.

        Keys already present cost no copy. When the host memory cap is reached the
        least recently used chunks are evicted; if no room can be made (every other
        chunk is being read), the rest of the request is dropped, not refused. With
        ``event``, the server's reads wait on the device for that engine event.
        """
        r = self.call("put", context=context, chunks=_chunks(chunks), event=event)
        return PutResult(**_counts(r, "put", ("stored", "present", "dropped", "evicted", "bytes")))

    def get(
        self,
        context: int,
        chunks: Sequence[KeyedChunkSpec],
        *,
        lease: int | None = None,
        event: bytes | None = None,
    ) -> GetResult:
        """Keyed retrieve: write the leading chunks the server has into the given blocks.

        Stops at the first key the server does not have; ``retrieved`` says how many
        were written. Block ids of every chunk are validated before anything moves; a
        block id of ``-1`` writes nothing at its positions. With ``lease``, the lease's
        pins in this context's namespace are released once the get is done. With
        ``event``, the server's writes wait on the device for that engine event.
        """
        r = self.call("get", context=context, chunks=_chunks(chunks), lease=lease, event=event)
        return GetResult(**_counts(r, "get", ("retrieved", "bytes")))

    def lookup(
        self,
        namespace: bytes | Sequence[bytes],
        keys: Sequence[bytes],
        *,
        lease: int | None = None,
        lease_ms: int | None = None,
    ) -> int:
        """How many leading ``keys`` the server holds in ``namespace`` (no context needed).

        With a list of namespaces: how many it holds in every one of them. With
        ``lease`` (a fresh id, see :func:`~lmcache_platform.server.new_lease_id`) and
        ``lease_ms``, those chunks stay pinned against eviction, in every namespace,
        until the lease expires, :meth:`release` ends it, or a :meth:`get` naming it
        has read them (each namespace's share separately).
        """
        where: dict[str, Any] = (
            {"namespace": namespace} if isinstance(namespace, bytes) else {"namespaces": list(namespace)}
        )
        r = self.call("lookup", keys=list(keys), lease=lease, lease_ms=lease_ms, **where)
        return _counts(r, "lookup", ("hits",), optional=("remote",))["hits"]

    def release(self, lease: int) -> None:
        """End a lease now (a no-op if it already ended)."""
        self.call("release", lease=lease)

    def ping(self) -> dict[str, Any]:
        """``{"now": server monotonic ns, "pid": ...}``, answered without waiting on any transfer."""
        return self.call("ping")

    def unregister(self, context: int) -> None:
        """Close the context; its keyed chunks stay in the server, its chunk ids go."""
        self.call("unregister", context=context)

    def status(self, context: int | None = None) -> dict[str, Any]:
        """The server's counters under ``"server"`` (see the wire-format page); with a
        ``context`` of this connection, its ``report_status()`` under ``"context"``."""
        return self.call("status", context=context)

    def shutdown(self) -> None:
        self.call("shutdown")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the result map.

        Fields given as ``None`` are left out. A refusal raises
        :class:`~lmcache_platform.ServerError`.
        """
        fields = {k: v for k, v in fields.items() if v is not None}
        rid, self._next_id = self._next_id, self._next_id + 1
        deadline = None
        if self.deadline_ms is not None and "deadline" not in fields:
            deadline = fields["deadline"] = time.monotonic_ns() + int(self.deadline_ms * 1e6)
        self.send_raw(_protocol.encode_request(op, rid, **fields))
        try:
            reply = self.recv_reply(deadline_ns=deadline)
        except TimeoutError:
            self.close()  # a reply may still come: this connection is out of step
            raise ServerUnavailable(
                f"{op}: no reply within its deadline of {self.deadline_ms:g} ms"
            ) from None
        if reply.request_id == 0 and not reply.ok:  # refused before any request was read
            raise ServerError(
                f"the server refused the connection: {reply.error_message}", remote_type=reply.error_type
            )
        if reply.request_id != rid:
            raise WireFormatError(f"reply id {reply.request_id} does not match request {rid}")
        if not reply.ok:
            raise ServerError(
                f"{op} refused by the server: {reply.error_type}: {reply.error_message}",
                remote_type=reply.error_type,
            )
        return reply.result

    def send_raw(self, payload: bytes) -> None:
        """Send one frame as is (tests use it to send malformed requests)."""
        _protocol.send_frame(self._sock, payload)

    def recv_reply(self, *, deadline_ns: int | None = None) -> _protocol.Reply:
        payload = _protocol.recv_frame(self._sock, deadline_ns=deadline_ns)
        if payload is None:
            raise ServerError("the server closed the connection")
        return _protocol.decode_reply(payload)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunks(specs: Sequence[ChunkSpec] | Sequence[KeyedChunkSpec]) -> list[Chunk]:
    return [Chunk(cid, tuple(tuple(map(operator.index, g)) for g in groups)) for cid, groups in specs]


def _counts(
    result: dict[str, Any], op: str, keys: Sequence[str], optional: Sequence[str] = ()
) -> dict[str, int]:
    r = _checks.expect_map(result, f"{op} reply", keys=set(keys), optional=set(optional))
    return {
        k: _checks.expect_int(r[k], f"{op} reply {k}", lo=0, hi=_protocol.MAX_ID)
        for k in (*keys, *optional)
        if k in r
    }

"""Engine-side client of the reference server: what an engine's connector calls.

One blocking request at a time per client, over the server's UNIX socket. Wrappers
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _checks, wire
from .._errors import ServerError, WireFormatError
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
    #: The namespace of this context's keyed chunks (``b""``: registered without one).
    namespace: bytes = b""


@dataclass(frozen=True)
class PutResult:
    """What a keyed store did with each of its chunks."""

    #: Chunks copied into the server.
    stored: int
    #: Chunks the server already had (or another engine was storing): not copied.
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


_REGISTRATION_KEYS = frozenset(Registration.__dataclass_fields__)


class ServerClient:
    """A connection to a :class:`lmcache_platform.server.ReferenceServer`."""

    def __init__(self, socket_path: str, *, timeout: float | None = 120.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
        except BaseException:
            self._sock.close()
            raise
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
        r = _checks.expect_map(self.call("register", **fields), "register reply", keys=_REGISTRATION_KEYS)
        backend = r["backend"]
        if not isinstance(backend, dict):
            raise WireFormatError("register reply: backend must be a map")
        counts = {
            k: _checks.expect_int(r[k], f"register reply {k}", lo=0, hi=_protocol.MAX_ID)
            for k in ("context", "num_layers", "num_object_groups", "max_batch_size", "chunk_bytes")
        }
        device_type = _checks.expect_str(r["device_type"], "register reply device_type", max_len=32)
        ns = _checks.expect_bytes(r["namespace"], "register reply namespace", max_len=_protocol.MAX_KEY_LEN)
        return Registration(device_type=device_type, backend=backend, namespace=ns, **counts)

    def store(self, context: int, chunks: Sequence[ChunkSpec]) -> int:
        """Copy chunks from the engine's blocks into server memory; return the bytes stored."""
        return int(self.call("store", context=context, chunks=_chunks(chunks))["bytes"])

    def retrieve(self, context: int, chunks: Sequence[ChunkSpec]) -> int:
        """Copy stored chunks back into the given blocks; return the bytes written."""
        return int(self.call("retrieve", context=context, chunks=_chunks(chunks))["bytes"])

    def put(self, context: int, chunks: Sequence[KeyedChunkSpec]) -> PutResult:
        """Keyed store: copy the chunks the server does not have yet into it.

        Keys already present cost no copy. When the host memory cap is reached the
        least recently used chunks are evicted; if no room can be made (every other
        chunk is being read), the rest of the request is dropped, not refused.
        """
        r = self.call("put", context=context, chunks=_chunks(chunks))
        return PutResult(**_counts(r, "put", ("stored", "present", "dropped", "evicted", "bytes")))

    def get(self, context: int, chunks: Sequence[KeyedChunkSpec]) -> GetResult:
        """Keyed retrieve: write the leading chunks the server has into the given blocks.

        Stops at the first key the server does not have; ``retrieved`` says how many
        were written. Block ids of every chunk are validated before anything moves.
        """
        r = self.call("get", context=context, chunks=_chunks(chunks))
        return GetResult(**_counts(r, "get", ("retrieved", "bytes")))

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the server holds in ``namespace`` (no context needed)."""
        r = self.call("lookup", namespace=namespace, keys=list(keys))
        return _counts(r, "lookup", ("hits",))["hits"]

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
        """Send one request and return the result map; raise :class:`ServerError` on refusal."""
        rid, self._next_id = self._next_id, self._next_id + 1
        self.send_raw(_protocol.encode_request(op, rid, **fields))
        reply = self.recv_reply()
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

    def recv_reply(self) -> _protocol.Reply:
        payload = _protocol.recv_frame(self._sock)
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


def _counts(result: dict[str, Any], op: str, keys: Sequence[str]) -> dict[str, int]:
    r = _checks.expect_map(result, f"{op} reply", keys=set(keys))
    return {k: _checks.expect_int(r[k], f"{op} reply {k}", lo=0, hi=_protocol.MAX_ID) for k in keys}

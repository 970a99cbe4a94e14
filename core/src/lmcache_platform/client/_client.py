"""Engine-side client of the reference server: what an engine's connector calls.

One blocking request at a time per client, over the server's UNIX socket (for an
engine's hot path, :class:`~lmcache_platform.server.AsyncClient` never blocks). Wrappers
travel as :mod:`lmcache_platform.wire` messages; everything else as the typed
requests of ``lmcache_platform.protocol._messages``. A server-side failure raises
:class:`ServerError` carrying the server's exception type and message.

Two ways to name chunks: :meth:`ServerClient.store` / :meth:`~ServerClient.retrieve`
take chunk ids private to one context; :meth:`~ServerClient.put`,
:meth:`~ServerClient.get` and :meth:`~ServerClient.lookup` take content keys
(:func:`~lmcache_platform.server.chunk_keys`) in the context's namespace, shared by
every engine that registers with the same namespace.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from .. import wire
from .._errors import ServerError, ServerUnavailable, WireFormatError
from ..protocol import _frames, _messages, _ops
from ..protocol._ops import Json

if TYPE_CHECKING:
    from typing_extensions import Self

    from .._ipc_wrapper import DeviceIPCWrapper

R = TypeVar("R")

#: A chunk to move: its chunk id (``str``) or content key (``bytes``) and the engine
#: block ids of each KV-cache group.
ChunkSpec = tuple[str, Sequence[Sequence[int]]]
KeyedChunkSpec = tuple[bytes, Sequence[Sequence[int]]]


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
    ) -> _ops.Registration:
        """Hand the per-layer wrappers to the server, which builds a cache context.

        ``wrappers`` is what :func:`lmcache_platform.wrap_kv_caches` returned; from a
        dict the engine's layer names travel too, so the server's errors name them.
        ``config`` takes the keyword arguments of
        :func:`lmcache_platform.create_cache_context` after the wrappers. With a
        ``namespace`` (:func:`~lmcache_platform.server.cache_namespace`) the context
        can :meth:`put` and :meth:`get` keyed chunks; the server refuses it if the
        namespace already holds chunks of another KV layout. File descriptors the
        wrappers name (``WireField(fds=True)``) travel with the request.
        """
        if isinstance(wrappers, Mapping):
            config = {"layer_names": list(wrappers), **config}
            wrappers = list(wrappers.values())
        payload, fds = wire.encode_with_fds(wrappers)
        request = _ops.RegisterRequest(wrappers=payload, config=config, namespace=namespace or b"")
        return self.execute(request, fds=fds)

    def store(self, context: int, chunks: Sequence[ChunkSpec], *, event: bytes | None = None) -> int:
        """Copy chunks from the engine's blocks into server memory; return the bytes stored.

        ``event``: a device event's handle (:func:`lmcache_platform.record_event`) the
        server's reads wait for on the device; likewise for the other transfers.
        """
        return self.execute(_ops.StoreRequest.of(context, chunks, event=event)).bytes

    def retrieve(self, context: int, chunks: Sequence[ChunkSpec], *, event: bytes | None = None) -> int:
        """Copy stored chunks back into the given blocks; return the bytes written."""
        return self.execute(_ops.RetrieveRequest.of(context, chunks, event=event)).bytes

    def put(
        self, context: int, chunks: Sequence[KeyedChunkSpec], *, event: bytes | None = None
    ) -> _ops.PutResult:
        """Keyed store: copy the chunks the server does not have yet into it.

        Keys already present cost no copy. When the host memory cap is reached the
        least recently used chunks are evicted; if no room can be made (every other
        chunk is being read), the rest of the request is dropped, not refused. With
        ``event``, the server's reads wait on the device for that engine event.
        """
        return self.execute(_ops.PutRequest.of(context, chunks, event=event))

    def get(
        self,
        context: int,
        chunks: Sequence[KeyedChunkSpec],
        *,
        lease: int | None = None,
        event: bytes | None = None,
    ) -> _ops.GetResult:
        """Keyed retrieve: write the leading chunks the server has into the given blocks.

        Stops at the first key the server does not have; ``retrieved`` says how many
        were written. Block ids of every chunk are validated before anything moves; a
        block id of ``-1`` writes nothing at its positions. With ``lease``, the lease's
        pins in this context's namespace are released once the get is done. With
        ``event``, the server's writes wait on the device for that engine event.
        """
        return self.execute(_ops.GetRequest.of(context, chunks, lease=lease, event=event))

    def lookup(
        self,
        namespaces: bytes | Sequence[bytes],
        keys: Sequence[bytes],
        *,
        lease: int | None = None,
        lease_ms: int | None = None,
    ) -> int:
        """How many leading ``keys`` the server holds in ``namespaces`` (no context needed).

        One namespace (``bytes``), or a list: how many it holds in every one of them.
        With ``lease`` (a fresh id, see :func:`~lmcache_platform.server.new_lease_id`)
        and ``lease_ms``, those chunks stay pinned against eviction, in every namespace,
        until the lease expires, :meth:`release` ends it, or a :meth:`get` naming it
        has read them (each namespace's share separately). The blocking sugar for
        ``execute(LookupRequest.of(...)).hits``.
        """
        return self.execute(_ops.LookupRequest.of(namespaces, keys, lease=lease, lease_ms=lease_ms)).hits

    def removals(self, namespaces: Sequence[bytes], since: int = 0) -> _ops.RemovalsResult:
        """Shared chunks of ``namespaces`` the server evicted after cursor ``since`` (oldest first)."""
        return self.execute(_ops.RemovalsRequest(namespaces=tuple(namespaces), since=since))

    def release(self, lease: int) -> None:
        """End a lease now (a no-op if it already ended)."""
        self.execute(_ops.ReleaseRequest(lease=lease))

    def ping(self) -> _ops.PingResult:
        """The server's monotonic clock (``now``, ns) and ``pid``; answered without waiting on a transfer."""
        return self.execute(_ops.PingRequest())

    def unregister(self, context: int) -> None:
        """Close the context; its keyed chunks stay in the server, its chunk ids go."""
        self.execute(_ops.UnregisterRequest(context=context))

    def status(self, context: int | None = None) -> Json:
        """The server's counters under ``"server"`` (see the wire-format page); with a
        ``context`` of this connection, its ``report_status()`` under ``"context"``."""
        return self.execute(_ops.StatusRequest(context=context or 0))

    def shutdown(self) -> None:
        self.execute(_ops.ShutdownRequest())

    def execute(self, request: _ops.Request[R], *, fds: Sequence[int] = ()) -> R:
        """Send one request (with ``fds`` beside it) and return its typed result.

        The client sets the request's id and, with ``deadline_ms``, its deadline (one
        the request already has is kept). A refusal raises
        :class:`~lmcache_platform.ServerError`; a late reply
        :class:`~lmcache_platform.server.ServerUnavailable`.
        """
        self._check_usable()
        rid, self._next_id = self._next_id, self._next_id + 1
        wait_until = None  # the client's own deadline bounds the wait; a request's own does not
        if request.deadline is None and self.deadline_ms is not None:
            wait_until = time.monotonic_ns() + int(self.deadline_ms * 1e6)
            request = replace(request, deadline=wait_until)
        request = replace(request, request_id=rid)
        _frames.send_frame(self._sock, _messages.encode(request), fds)
        op = request.wire()[0]
        try:
            reply = self.recv_reply(deadline_ns=wait_until)
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
        return request.decode_result(reply.result)

    def call(self, op: str, **fields: Any) -> Json:
        """Send any op with raw wire fields and return the result map unchecked (tools, tests).

        Fields given as ``None`` are left out; a ``deadline`` field is kept as given.
        """
        deadline = fields.pop("deadline", None)
        return self.execute(_ops.RawRequest(raw_op=op, raw_fields=fields, deadline=deadline))

    def _check_usable(self) -> None:
        """Raise if this client may not send now (a hook for borrowed connections)."""

    def send_raw(self, payload: bytes) -> None:
        """Send one frame as is (tests use it to send malformed requests)."""
        _frames.send_frame(self._sock, payload)

    def recv_reply(self, *, deadline_ns: int | None = None) -> _messages.Reply:
        payload = _frames.recv_frame(self._sock, deadline_ns=deadline_ns)
        if payload is None:
            raise ServerError("the server closed the connection")
        return _messages.decode_reply(payload)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

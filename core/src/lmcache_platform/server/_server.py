"""The reference KV-cache server: the server side of the platform API, end to end.

It is deliberately small but real: it listens on a UNIX socket (mode 0600 inside a
private 0700 directory), decodes wrappers with the allow-listed wire format,
builds cache contexts through :func:`lmcache_platform.create_cache_context`,
and moves chunks between the engine's paged blocks and its own host memory with
the context's ``store_chunk`` / ``retrieve_chunk`` and staging slots. It shows
exactly which calls a production server (LMCache) makes; see
``docs/engine-integration.md``.

Concurrency: one thread per client connection, and one lock around all context
and host-memory work, because a cache context's staging slots are not safe to
share between concurrent transfers. A context belongs to the connection that
registered it: other connections cannot see it, and it is closed when that
connection ends.

Run it in its own process with :class:`ServerProcess` (spawn), or in-process
with :class:`ReferenceServer` for embedding.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import wire
from .._errors import LMCachePlatformError, TransferError, WireFormatError
from . import _protocol
from ._protocol import Chunk, Request

if TYPE_CHECKING:
    import torch

    from .._kv.context import BaseCacheContext

logger = logging.getLogger("lmcache_platform.server")

#: Default cap on the host memory the server uses for stored chunks.
DEFAULT_MAX_HOST_BYTES = 8 << 30
SOCKET_NAME = "kv.sock"
DEFAULT_MAX_CONNECTIONS = 64
_ACCEPT_POLL_S = 1.0  # a fallback: stop() wakes accept() at once


@dataclass
class _Entry:
    """One registered cache context and the chunks stored for it."""

    ctx: BaseCacheContext
    device_type: str
    chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ts in self.chunks.values() for t in ts)


@dataclass(eq=False)  # identity semantics: kept in a set
class _Connection:
    sock: socket.socket
    contexts: set[int] = field(default_factory=set)
    #: Set by a ``shutdown`` request: stop the server once its reply is sent.
    stop_after_reply: bool = False


class ReferenceServer:
    """Serve the protocol of :mod:`lmcache_platform.server._protocol` on one UNIX socket."""

    def __init__(
        self,
        socket_path: str,
        *,
        max_host_bytes: int = DEFAULT_MAX_HOST_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.socket_path = socket_path
        self.max_host_bytes = max_host_bytes
        #: Concurrent clients; each may hold one frame buffer (up to 16 MiB) at a time.
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._entries: dict[int, _Entry] = {}
        self._connections: set[_Connection] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._handlers: dict[str, Callable[[Request, _Connection], dict[str, Any]]] = {
            "register": self._register,
            "store": self._store,
            "retrieve": self._retrieve,
            "unregister": self._unregister,
            "status": self._status,
            "shutdown": self._shutdown,
        }

    # -- lifecycle ---------------------------------------------------------------------

    def bind(self) -> None:
        """Create the listening socket with mode 0600 (no window with looser rights)."""
        parent = os.path.dirname(self.socket_path) or "."
        st = os.stat(parent)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"socket directory {parent} must be owned by this user with mode 0700")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.socket_path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        sock.listen(16)
        sock.settimeout(_ACCEPT_POLL_S)
        self._listener = sock

    def serve_forever(self) -> None:
        """Accept clients until :meth:`stop` or a ``shutdown`` request; then clean up."""
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        try:
            while not self._stop.is_set():
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                if self._stop.is_set():  # the wake-up from stop(), or a late client
                    client.close()
                    break
                with self._lock:
                    busy = len(self._connections) >= self.max_connections
                if busy:  # bound the memory clients can pin with announced frames
                    logger.warning("refusing a client: %d connections open", self.max_connections)
                    with contextlib.suppress(OSError):
                        _protocol.send_frame(client, _protocol.encode_error(
                            0, "ServerError", f"too many connections (limit {self.max_connections})"))
                    client.close()
                    continue
                client.settimeout(None)
                conn = _Connection(client)
                thread = threading.Thread(
                    target=self._serve_client, args=(conn,), name="lmcache-client", daemon=True
                )
                with self._lock:
                    self._connections.add(conn)
                    self._threads = [t for t in self._threads if t.is_alive()]
                    self._threads.append(thread)
                thread.start()
        finally:
            self._teardown()

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (from any thread or a signal handler)."""
        self._stop.set()
        if self._listener is not None:  # wake accept() now rather than at its next poll
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as poke:
                poke.connect(self.socket_path)

    def _teardown(self) -> None:
        assert self._listener is not None
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:  # wake the client threads blocked in recv()
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
        with self._lock:
            for ctx_id in list(self._entries):
                self._close_entry(ctx_id)

    # -- per connection ----------------------------------------------------------------

    def _serve_client(self, conn: _Connection) -> None:
        try:
            while True:
                try:
                    payload = _protocol.recv_frame(conn.sock)
                except WireFormatError as exc:  # stream out of sync: answer, then hang up
                    self._send(conn, _protocol.encode_error(0, type(exc).__name__, str(exc)))
                    return
                except OSError:
                    return
                if payload is None:
                    return
                sent = self._send(conn, self._handle(payload, conn))
                if conn.stop_after_reply:
                    self.stop()
                if not sent:
                    return
        finally:
            with self._lock:
                for ctx_id in sorted(conn.contexts):
                    self._close_entry(ctx_id)
                conn.contexts.clear()
                self._connections.discard(conn)
            conn.sock.close()

    @staticmethod
    def _send(conn: _Connection, payload: bytes) -> bool:
        try:
            _protocol.send_frame(conn.sock, payload)
        except OSError:
            return False
        return True

    def _handle(self, payload: bytes, conn: _Connection) -> bytes:
        """Answer one request. Every failure becomes an error reply; the server goes on."""
        try:
            req = _protocol.decode_request(payload)
        except WireFormatError as exc:
            rid = _protocol.request_id_of(payload)
            return _protocol.encode_error(rid, type(exc).__name__, str(exc))
        except Exception as exc:  # a decoder bug must not cost the client its reply
            logger.exception("decoding a request failed")
            rid = _protocol.request_id_of(payload)
            return _protocol.encode_error(rid, "WireFormatError", f"malformed request: {exc}")
        try:
            result = self._handlers[req.op](req, conn)
        except (LMCachePlatformError, ValueError) as exc:  # the request's fault
            return _protocol.encode_error(req.request_id, type(exc).__name__, str(exc))
        except Exception as exc:  # a bug or a backend failure: report it, keep serving
            logger.exception("%s request %d failed", req.op, req.request_id)
            return _protocol.encode_error(req.request_id, type(exc).__name__, f"{req.op} failed: {exc}")
        return _protocol.encode_reply(req.request_id, result)

    # -- operations --------------------------------------------------------------------

    def _entry(self, req: Request, conn: _Connection) -> _Entry:
        if req.context not in conn.contexts:
            raise TransferError(f"unknown context {req.context}: not registered on this connection")
        return self._entries[req.context]

    def _register(self, req: Request, conn: _Connection) -> dict[str, Any]:
        from .._facade import create_cache_context
        from .._registry import selected_backend

        wrappers = wire.decode(req.wrappers)
        if not wrappers:
            raise WireFormatError("register: the wrapper list is empty")
        device_type = type(wrappers[0]).device_type
        try:
            ctx = create_cache_context(wrappers, **req.config)
        except BaseException:
            for w in wrappers:
                w.close()
            raise
        backend = selected_backend(device_type)
        with self._lock:
            ctx_id = next(self._ids)
            self._entries[ctx_id] = _Entry(ctx, device_type)
            conn.contexts.add(ctx_id)
        slot_bytes = [ctx.get_temp_object_group_buffer(0, og).nbytes for og in range(_num_object_groups(ctx))]
        return {
            "context": ctx_id,
            "device_type": device_type,
            "backend": {
                "name": backend.name,
                "distribution": backend.distribution,
                "version": backend.version,
            },
            "num_layers": len(wrappers),
            "num_object_groups": len(slot_bytes),
            "max_batch_size": ctx.max_batch_size,
            "chunk_bytes": sum(slot_bytes),
        }

    def _store(self, req: Request, conn: _Connection) -> dict[str, Any]:
        with self._lock:
            entry = self._entry(req, conn)
            ctx = entry.ctx
            _check_unique(req.chunks)
            per_chunk = sum(
                ctx.get_temp_object_group_buffer(0, og).nbytes for og in range(_num_object_groups(ctx))
            )
            replaced = sum(sum(t.nbytes for t in entry.chunks.get(c.chunk_id, ())) for c in req.chunks)
            used = sum(e.nbytes for e in self._entries.values()) - replaced
            need = per_chunk * len(req.chunks)
            if used + need > self.max_host_bytes:
                raise TransferError(
                    f"store of {need} bytes exceeds the server's host memory "
                    f"({used} of {self.max_host_bytes} bytes in use); nothing was stored"
                )
            _precheck(ctx, req.chunks, retrieve=False)
            staged: dict[str, list[torch.Tensor]] = {}
            for batch in _batches(req.chunks, ctx.max_batch_size):
                for slot, chunk in enumerate(batch):
                    ctx.store_chunk(chunk.block_ids, slot=slot)
                    with ctx.stream_context():  # ordered after the gather on the same stream
                        staged[chunk.chunk_id] = [
                            _host_copy(ctx.get_temp_object_group_buffer(slot, og))
                            for og in range(_num_object_groups(ctx))
                        ]
                ctx.synchronize()
            entry.chunks.update(staged)  # commit only when every chunk made it
        return {"stored": len(staged), "bytes": need}

    def _retrieve(self, req: Request, conn: _Connection) -> dict[str, Any]:
        with self._lock:
            entry = self._entry(req, conn)
            ctx = entry.ctx
            missing = [c.chunk_id for c in req.chunks if c.chunk_id not in entry.chunks]
            if missing:
                raise TransferError(
                    f"unknown chunk ids {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                    "nothing was retrieved"
                )
            _precheck(ctx, req.chunks, retrieve=True)
            total = 0
            for batch in _batches(req.chunks, ctx.max_batch_size):
                for slot, chunk in enumerate(batch):
                    with ctx.stream_context():
                        for og, host in enumerate(entry.chunks[chunk.chunk_id]):
                            buf = ctx.get_temp_object_group_buffer(slot, og)
                            buf.copy_(host, non_blocking=True)
                            total += host.nbytes
                    ctx.retrieve_chunk(chunk.block_ids, slot=slot)
                ctx.synchronize()
        return {"retrieved": len(req.chunks), "bytes": total}

    def _unregister(self, req: Request, conn: _Connection) -> dict[str, Any]:
        with self._lock:
            self._entry(req, conn)
            self._close_entry(req.context)
            conn.contexts.discard(req.context)
        return {}

    def _status(self, req: Request, conn: _Connection) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "server": {
                    "pid": os.getpid(),
                    "contexts": len(self._entries),
                    "chunks": sum(len(e.chunks) for e in self._entries.values()),
                    "host_bytes": sum(e.nbytes for e in self._entries.values()),
                    "max_host_bytes": self.max_host_bytes,
                }
            }
            if req.context:
                entry = self._entry(req, conn)
                out["context"] = _plain(entry.ctx.report_status())
                out["context"]["stored_chunks"] = len(entry.chunks)
        return out

    def _shutdown(self, req: Request, conn: _Connection) -> dict[str, Any]:
        conn.stop_after_reply = True  # stopping now could close this socket before the reply
        return {}

    def _close_entry(self, ctx_id: int) -> None:
        """Close one context and free its chunks. Caller holds the lock."""
        entry = self._entries.pop(ctx_id, None)
        if entry is None:
            return
        entry.chunks.clear()
        try:
            entry.ctx.close()
        except Exception:  # closing must not take the server down; say what happened
            logger.exception("closing context %d failed", ctx_id)


# -- helpers -----------------------------------------------------------------------------


def _num_object_groups(ctx: BaseCacheContext) -> int:
    return int(ctx.kv_layer_groups_manager.num_object_groups)


def _batches(chunks: tuple[Chunk, ...], size: int) -> Iterator[tuple[Chunk, ...]]:
    for start in range(0, len(chunks), size):
        yield chunks[start : start + size]


def _check_unique(chunks: tuple[Chunk, ...]) -> None:
    seen: set[str] = set()
    for c in chunks:
        if c.chunk_id in seen:
            raise TransferError(f"chunk id {c.chunk_id!r} appears twice in one request")
        seen.add(c.chunk_id)


def _host_copy(buf: torch.Tensor) -> torch.Tensor:
    """Copy a staging buffer into fresh host memory (pinned when it lives on a device)."""
    import torch

    on_device = buf.device.type != "cpu"
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=on_device)
    host.copy_(buf, non_blocking=on_device)
    return host


def _precheck(ctx: BaseCacheContext, chunks: tuple[Chunk, ...], *, retrieve: bool) -> None:
    """Check every chunk before any chunk moves, so a bad request writes nothing."""
    for i, chunk in enumerate(chunks):
        try:
            ctx.validate_transfer(chunk.block_ids, retrieve=retrieve)
        except TransferError as exc:
            raise TransferError(f"chunk {i} ({chunk.chunk_id!r}): {exc}; nothing was transferred") from exc


def _plain(value: Any) -> Any:
    """Reduce a status report to msgpack-able primitives (dtypes and enums become text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return str(getattr(value, "value", value))


# -- running in a child process ----------------------------------------------------------


def _child_main(socket_path: str, max_host_bytes: int, ready: Any) -> None:
    """Entry point of the spawned server process."""
    logging.basicConfig(level=logging.WARNING, format="lmcache server: %(message)s")
    server = ReferenceServer(socket_path, max_host_bytes=max_host_bytes)
    try:
        import torch  # noqa: F401 - pay the import before "ready", not in the first request

        server.bind()
    except BaseException as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    ready.send(("ready", os.getpid()))
    ready.close()
    server.serve_forever()


class ServerProcess:
    """A :class:`ReferenceServer` in a spawned process, with its private socket directory.

    Use as a context manager. :meth:`stop` asks for a clean shutdown, then
    terminates if needed, and always removes the socket directory.
    """

    def __init__(self, *, max_host_bytes: int = DEFAULT_MAX_HOST_BYTES, start_timeout: float = 60.0) -> None:
        self.max_host_bytes = max_host_bytes
        self.start_timeout = start_timeout
        self.directory: str | None = None
        self.socket_path = ""
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> ServerProcess:
        """Spawn the server and wait until it listens; raise :class:`ServerError` if not."""
        from .._errors import ServerError

        self.directory = tempfile.mkdtemp(prefix="lmcache-platform-")  # mode 0700
        self.socket_path = os.path.join(self.directory, SOCKET_NAME)
        mp = multiprocessing.get_context("spawn")
        parent_end, child_end = mp.Pipe(duplex=False)
        self._process = mp.Process(
            target=_child_main,
            args=(self.socket_path, self.max_host_bytes, child_end),
            name="lmcache-platform-server",
            daemon=True,
        )
        try:
            self._process.start()
            child_end.close()
            if not parent_end.poll(self.start_timeout):
                raise ServerError(f"the server did not start within {self.start_timeout:.0f} s")
            try:
                kind, detail = parent_end.recv()
            except EOFError:
                self._process.join(5)
                raise ServerError(
                    f"the server process exited during start-up (exit code {self._process.exitcode})"
                ) from None
            if kind != "ready":
                raise ServerError(f"the server failed to start: {detail}")
        except BaseException:
            self.stop()
            raise
        finally:
            parent_end.close()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down and remove its directory. Idempotent."""
        proc, self._process = self._process, None
        try:
            if proc is not None and proc.is_alive():
                self._request_shutdown(timeout)
                proc.join(timeout)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            if proc is not None:
                proc.close()
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = None

    def _request_shutdown(self, timeout: float) -> None:
        from ._client import ServerClient

        try:
            with ServerClient(self.socket_path, timeout=timeout) as client:
                client.shutdown()
        except (OSError, LMCachePlatformError) as exc:
            logger.debug("clean shutdown request failed (%s); terminating", exc)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""An engine-side client that never blocks its caller: requests in, futures out.

:class:`AsyncClient` is what an engine's hot path (vLLM's scheduler, a worker's forward
step) uses to talk to the reference server. :meth:`AsyncClient.submit` queues a
request and returns a :class:`Pending` at once; one I/O thread per client sends the
queue over the server's socket, reads replies and settles the futures. Nothing the
caller does waits on a socket, and a hung server costs a request its deadline, never
more.

Two connections to the server: **data** (transfers, pipelined: several in flight, the
server answers them in order) and **control** (``ping``, ``lookup``, ``release``,
``status``), so a slow transfer does not delay a health check or a lookup. The
``on_connect`` hook runs on the I/O thread after each (re)connect, before any request
is sent, with a blocking, deadline-bounded :class:`~lmcache_platform.server.ServerClient`
over the data connection (to register KV caches); the :class:`~lmcache_platform.protocol.Registration`
it returns becomes :attr:`AsyncClient.session`, and :data:`AsyncClient.SESSION_CONTEXT` in
a request's fields stands for ``session.context`` when the request is sent.

Deadlines: every request carries ``deadline = monotonic_ns() + deadline_ms`` (the
server drops it once late). When it passes with no reply, the future fails locally
(:class:`~lmcache_platform.server.ServerUnavailable`) and the client pings the server
on the control connection: an answer means the server is merely *slow* (counted); no
answer within the ping's deadline means it is *unavailable*: both connections are
given up, every pending future fails, and the client reconnects with exponential
backoff. Submissions while not healthy fail at once, with one exception: while a server
this client has not tried yet listens on the socket path (a restart), they wait in the
queue for the connect, bounded by their deadlines (:attr:`AsyncClient.accepting`), so the
first requests after a restart are not lost to the moment between its listening and
this client's noticing.

A restarted server is found at once, however long the backoff has grown: while
unavailable the client looks at the socket path every :data:`WATCH_S` (a ``stat``, nothing
the server sees), and while a socket is there that is not the one of its last healthy
session (another inode or creation time: a new server bound it) it tries to connect
without waiting for the backoff, which starts again from ``retry_first_s``; a new server
still starting up (it listens before it answers) is tried again about once per ping
deadline until it answers. A hung server keeps its socket, so it is not asked more often
than the backoff allows. :attr:`AsyncClient.healthy_since` and
:attr:`AsyncClient.sessions` tell a caller that the server came back.

Done versus resolved: a :class:`Pending` is *done* when its future has a result or
failed (perhaps locally, at its deadline). It is *resolved* (:attr:`Pending.resolved`)
once the server can no longer act on it: it answered, the connection it was sent on
ended (EOF), or it was never sent. A load that failed locally may still be written by a
hung server until then, so the engine keeps the target blocks until *resolved*. To
learn it, a data connection given up with requests still unanswered is kept open for reading
(a *zombie*, its sending side shut) until each is answered or the server closes it; at
most ``max_zombies`` are kept, the oldest one beyond that is closed and its requests
marked resolved (logged). Requests on the control connection (``ping``, ``lookup``,
``release``, ``status``) never write into an engine: they are resolved when it is given up.

One log line per change of :attr:`AsyncClient.state`, never one per request (logger
``lmcache_platform.client._async``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Final, TypeVar

from .._env import SOCKET_ENV
from .._errors import ServerError, ServerUnavailable, WireFormatError
from ..protocol import _frames, _messages, _ops
from ..protocol._ops import REQUEST_TYPES, ChunkLike, Json, Registration, Request, SessionField, as_chunks
from ._client import ServerClient
from ._link import Link, SessionClient, socket_identity, why
from ._pending import Pending, settle

logger = logging.getLogger(__name__)
R = TypeVar("R")

#: Ops sent on the control connection unless ``submit(control=...)`` says otherwise.
CONTROL_OPS: Final = frozenset(op for op, cls in REQUEST_TYPES.items() if cls.control)
#: How often an unavailable client looks at the socket path for a restarted server.
WATCH_S: Final = 0.1
#: Largest difference between the server's monotonic clock and ours: beyond it the two do
#: not share a clock (another host or time namespace) and deadlines would mean nothing.
MAX_CLOCK_SKEW_NS: Final = 1_000_000_000
_POLL_S = 0.05  # the watchdog's granularity: a deadline is noticed within this
_READ_BYTES = 1 << 16


class AsyncClient:
    """A non-blocking client of the reference server for an engine's hot path.

    ``socket_path`` defaults to ``$LMCACHE_PLATFORM_SOCKET``. ``name`` goes into log
    lines. Every request gets ``deadline_ms`` unless its submit says otherwise; health
    pings get ``ping_deadline_ms`` (default: ``deadline_ms`` capped at 1 s). After a
    failure the client reconnects after ``retry_first_s``, doubling up to ``retry_max_s``.
    ``on_connect(client) -> Registration | None`` runs on the I/O thread after each connect,
    before any request is sent (see the module docstring); if it raises, the server is
    unavailable and the connect is retried.

    :attr:`state` is ``"connecting"`` (before the first connect completes),
    ``"healthy"``, ``"unavailable"`` or ``"closed"``; read it without locks.
    """

    #: A field value that stands for ``session.context``, filled in when the request is sent.
    SESSION_CONTEXT: Final = SessionField("context")

    def __init__(
        self,
        socket_path: str | None,
        *,
        name: str,
        deadline_ms: float = 2000.0,
        ping_deadline_ms: float | None = None,
        on_connect: Callable[[ServerClient], Registration | None] | None = None,
        retry_first_s: float = 1.0,
        retry_max_s: float = 30.0,
        max_zombies: int = 8,
    ) -> None:
        path = socket_path or os.environ.get(SOCKET_ENV, "")
        if not path:
            raise ValueError(f"AsyncClient {name}: no socket path (pass one or set {SOCKET_ENV})")
        if deadline_ms <= 0 or (ping_deadline_ms is not None and ping_deadline_ms <= 0):
            raise ValueError("deadlines must be positive")
        self.socket_path = path
        self.name = name
        self.deadline_ms = float(deadline_ms)
        self.ping_deadline_ms = float(ping_deadline_ms or min(deadline_ms, 1000.0))
        self.on_connect = on_connect
        self.retry_first_s = retry_first_s
        self.retry_max_s = max(retry_max_s, retry_first_s)
        self.max_zombies = max_zombies
        #: ``"connecting"``, ``"healthy"``, ``"unavailable"`` or ``"closed"``.
        self.state = "connecting"
        #: Why the server is unavailable (empty while healthy).
        self.reason = ""
        #: What ``on_connect`` returned after the latest connect (its :class:`Registration`).
        self.session: Registration | None = None
        self._counts: collections.Counter[str] = collections.Counter()
        self._counts_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._submitted: collections.deque[tuple[Pending[Any], Request[Any]]] = collections.deque()
        self._submit_lock = threading.Lock()  # held for an append: orders submit against close
        self._closed = False
        self._links: dict[str, Link] = {}
        self._zombies: list[Link] = []
        self._health: Pending[Any] | None = None
        self._slow = False  # in a slow episode (logged once)
        self._backoff = retry_first_s
        self._next_attempt = 0.0
        #: ``time.monotonic()`` when the client last became healthy (0.0: never yet).
        self.healthy_since = 0.0
        #: Sessions established so far (each connect that became healthy; ``stats()["connects"]``
        #: counts attempts).
        self.sessions = 0
        self._known: tuple[int, int] | None = None  # the socket of the last healthy session
        self._failed: tuple[int, int] | None = None  # the socket of the last failed attempt
        self._watched_at = 0.0
        self._dialing: list[socket.socket] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"lmcache-client-{name}", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------

    def execute(self, request: Request[R], *, deadline_ms: float | None = None) -> Pending[R]:
        """Queue ``request``; its :class:`SessionField` values are filled in when it is sent.

        Never blocks and never raises for the server's sake: when the client is not
        :attr:`accepting`, the returned :class:`Pending` has already failed (and is resolved). The
        request's class says which connection carries it (``Request.control``); its id
        and deadline (``deadline_ms``, default the client's ``deadline_ms``) are the client's.
        """
        ms = self.deadline_ms if deadline_ms is None else deadline_ms
        op, _ = request.wire()
        on_control = type(request).control
        if isinstance(request, _ops.RawRequest):
            on_control = (
                request.raw_op in CONTROL_OPS if request.control_link is None else request.control_link
            )
        return self._queue_request(request, ms, on_control, op)

    def submit(
        self, op: str, *, control: bool | None = None, deadline_ms: float | None = None, **fields: Any
    ) -> Pending[Json]:
        """``execute(RawRequest(...))``: op ``op`` with raw wire ``fields``, the reply's map unchecked.

        For tools and tests (typed callers use :meth:`execute` and the methods below).
        ``control`` picks the connection (by default the ops in ``CONTROL_OPS`` go on
        the control connection, every other op on the data connection). Chunks may be
        given as ``(name, [[block ids of group 0], ...])`` pairs; a field set to
        :data:`SESSION_CONTEXT` (or another :class:`SessionField`) is replaced when
        sent; ``None`` fields are left out.
        """
        if fields.get("chunks") is not None:
            fields["chunks"] = as_chunks(fields["chunks"])
        raw = _ops.RawRequest(raw_op=op, raw_fields=fields, control_link=control)
        return self.execute(raw, deadline_ms=deadline_ms)

    def _queue_request(self, request: Request[R], ms: float, control: bool, op: str) -> Pending[R]:
        pending: Pending[R] = Pending(
            op, next(self._ids), time.monotonic_ns() + int(ms * 1e6), control=control
        )
        with self._submit_lock:
            accepted = not self._closed and self.accepting
            if accepted:
                self._submitted.append((pending, request))
        if not accepted:
            self._count("refused")
            why = "the client is closed" if self._closed else f"the server is {self.state}"
            settle(pending, ServerUnavailable(f"{op}: not sent: {why} ({self.reason or self.socket_path})"))
            pending.resolved.set()
            return pending
        self._count("submitted")
        self._wake()
        return pending

    # The per-op sugar: the signatures of ServerClient's, each a one-liner over a request's ``of``.

    def lookup(
        self,
        namespaces: bytes | Sequence[bytes],
        keys: Sequence[bytes],
        *,
        lease: int | None = None,
        lease_ms: int | None = None,
        deadline_ms: float | None = None,
    ) -> Pending[_ops.LookupResult]:
        """Leading ``keys`` held in every namespace (``hits``); see ``ServerClient.lookup``."""
        request = _ops.LookupRequest.of(namespaces, keys, lease=lease, lease_ms=lease_ms)
        return self.execute(request, deadline_ms=deadline_ms)

    def put(
        self,
        context: int | SessionField,
        chunks: Sequence[ChunkLike],
        *,
        event: bytes | None = None,
        deadline_ms: float | None = None,
    ) -> Pending[_ops.PutResult]:
        """Keyed store (``stored``, ``present``, ``dropped``, ``evicted``, ``bytes``).

        ``context`` may be :data:`SESSION_CONTEXT`: the context ``on_connect``
        registered, whichever connection the request is sent on. ``event``: a device
        event's handle (:func:`lmcache_platform.record_event`) the server's reads wait
        for on the device.
        """
        return self.execute(_ops.PutRequest.of(context, chunks, event=event), deadline_ms=deadline_ms)

    def get(
        self,
        context: int | SessionField,
        chunks: Sequence[ChunkLike],
        *,
        lease: int | None = None,
        event: bytes | None = None,
        deadline_ms: float | None = None,
    ) -> Pending[_ops.GetResult]:
        """Keyed retrieve (``retrieved``, ``bytes``); block id ``-1`` skips positions.

        ``event``: a device event's handle the server's writes wait for on the device.
        """
        request = _ops.GetRequest.of(context, chunks, lease=lease, event=event)
        return self.execute(request, deadline_ms=deadline_ms)

    def removals(
        self, namespaces: Sequence[bytes], since: int = 0, *, deadline_ms: float | None = None
    ) -> Pending[_ops.RemovalsResult]:
        """Shared chunks of ``namespaces`` the server evicted after cursor ``since``."""
        request = _ops.RemovalsRequest(namespaces=tuple(namespaces), since=since)
        return self.execute(request, deadline_ms=deadline_ms)

    def release(self, lease: int, *, deadline_ms: float | None = None) -> Pending[None]:
        return self.execute(_ops.ReleaseRequest(lease=lease), deadline_ms=deadline_ms)

    def ping(self, *, deadline_ms: float | None = None) -> Pending[_ops.PingResult]:
        return self.execute(_ops.PingRequest(), deadline_ms=deadline_ms)

    def status(self, context: int | None = None, *, deadline_ms: float | None = None) -> Pending[Json]:
        return self.execute(_ops.StatusRequest(context=context or 0), deadline_ms=deadline_ms)

    @property
    def accepting(self) -> bool:
        """Whether a request submitted now is sent rather than failed at once.

        True while healthy, and while unavailable once a server this client has not tried
        binds the socket path (a restart): such requests wait for the connect, bounded
        by their deadlines, and fail if it fails. A server that failed an attempt (hung,
        or refusing the registration) is not waited for again. Costs a ``stat`` while
        unavailable, nothing while healthy.
        """
        state = self.state
        if state == "healthy":
            return True
        if state != "unavailable":
            return False
        seen = socket_identity(self.socket_path)
        return seen is not None and seen != self._known and seen != self._failed

    def stats(self) -> dict[str, int]:
        """Counters: ``submitted``, ``refused`` (not healthy), ``answered``, ``errors``
        (error replies), ``deadline_misses`` (failed locally), ``slow`` (pings answered
        after a miss), ``connects``, ``failures``, ``zombies`` (now), ``zombies_abandoned``."""
        with self._counts_lock:
            out = dict(self._counts)
        out["zombies"] = len(self._zombies)
        return out

    def close(self) -> None:
        """Stop the I/O thread, fail (and resolve) every pending request, close every socket."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        for sock in list(self._dialing):  # a connect or on_connect call blocked on a hung server
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        gone = f"the client {self.name} was closed"
        for link in [*self._links.values(), *self._zombies]:
            for pending in link.pending.values():
                settle(pending, ServerUnavailable(gone))
                pending.resolved.set()
            link.close()
        self._links, self._zombies = {}, []
        while self._submitted:
            pending, _ = self._submitted.popleft()
            settle(pending, ServerUnavailable(gone))
            pending.resolved.set()
        self._wake_r.close()
        self._wake_w.close()
        self.state = "closed"

    def __enter__(self) -> AsyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<AsyncClient {self.name} {self.state} {self.socket_path}>"

    def _count(self, key: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[key] += n

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"\0")

    # -- the I/O thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            try:
                self._step()
            except Exception as exc:  # a bug must not kill the thread: give the links up, retry
                logger.exception("lmcache-platform %s: client I/O thread error", self.name)
                self._give_up(f"client error: {type(exc).__name__}: {exc}")

    def _step(self) -> None:
        if not self._links:
            self._watch_socket(waiting=bool(self._submitted))
        if not self._links and time.monotonic() >= self._next_attempt:
            self._attempt()
        self._send_submitted()
        self._poll()
        self._watch(time.monotonic_ns())

    def _attempt(self) -> None:
        """Connect both links, ping, run ``on_connect``; healthy, or unavailable until the next try."""
        self._count("connects")
        links: dict[str, Link] = {}
        try:
            for kind in ("data", "control"):
                links[kind] = Link(kind, self._dial())
            ping = SessionClient(links["control"].sock, self.ping_deadline_ms, self._ids)
            skew = ping.ping().now - time.monotonic_ns()
            if not isinstance(skew, int) or abs(skew) > MAX_CLOCK_SKEW_NS:
                raise ServerError(
                    f"the server's monotonic clock differs from ours by {skew / 1e9:.1f} s: another host "
                    "or time namespace, where deadlines cannot work"
                )
            session: Registration | None = None
            if self.on_connect is not None:
                hook = SessionClient(links["data"].sock, self.deadline_ms, self._ids)
                try:
                    session = self.on_connect(hook)
                except Exception as exc:
                    raise ServerError(f"on_connect failed: {type(exc).__name__}: {exc}") from exc
                finally:
                    hook.close()
        except Exception as exc:
            for link in links.values():
                link.close()
            self._failed = socket_identity(self.socket_path)
            self._unavailable(why(exc))
            return
        finally:
            self._dialing.clear()
        for link in links.values():
            link.sock.setblocking(False)
        self.session = session
        self._links = links
        self._backoff = self.retry_first_s
        self._slow = False
        self.sessions += 1
        self.healthy_since = time.monotonic()
        self._known = socket_identity(self.socket_path)
        was, self.state, self.reason = self.state, "healthy", ""
        level = logging.INFO if was == "connecting" else logging.WARNING
        logger.log(
            level,
            "lmcache-platform %s: server %s %s",
            self.name,
            self.socket_path,
            "connected" if was == "connecting" else "available again",
        )

    def _dial(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._dialing.append(sock)
        try:
            sock.settimeout(self.ping_deadline_ms / 1e3)  # a full backlog blocks connect()
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        return sock

    def _watch_socket(self, *, waiting: bool = False) -> None:
        """Connect at once when a new server bound the socket path (see the module docstring).

        ``waiting``: requests accepted for a new server are queued, so look now rather
        than at the next ``WATCH_S`` tick.
        """
        now = time.monotonic()
        if (now < self._watched_at + WATCH_S and not waiting) or now >= self._next_attempt:
            return
        self._watched_at = now
        seen = socket_identity(self.socket_path)
        if seen is not None and seen != self._known:
            logger.debug("lmcache-platform %s: a new server socket at %s", self.name, self.socket_path)
            self._backoff = self.retry_first_s
            self._next_attempt = now

    def _unavailable(self, why: str) -> None:
        """Enter (or stay in) the unavailable state; schedule the next connect attempt."""
        self._watched_at = time.monotonic()
        delay = self._backoff
        self._next_attempt = time.monotonic() + delay
        self._backoff = min(self._backoff * 2, self.retry_max_s)
        if self.state != "unavailable" and not self._closed:
            logger.warning(
                "lmcache-platform %s: server %s unavailable (%s); retrying in %g s",
                self.name,
                self.socket_path,
                why,
                delay,
            )
        else:
            logger.debug(
                "lmcache-platform %s: still unavailable (%s); next try in %g s", self.name, why, delay
            )
        self.reason = why
        if not self._closed:
            self.state = "unavailable"

    def _give_up(self, why: str) -> None:
        """The session failed: fail every pending request, keep unresolved ones as zombies."""
        links, self._links, self._health = self._links, {}, None
        self._count("failures")
        gone = f"server {self.socket_path} unavailable: {why}"
        with self._submit_lock:
            queued = list(self._submitted)
            self._submitted.clear()
        for pending, _ in queued:
            settle(pending, ServerUnavailable(gone))
            pending.resolved.set()
        for link in links.values():  # control requests never write into the engine: no zombie
            self._retire(link, gone, dead=link.kind == "control")
        self._unavailable(why)

    def _retire(self, link: Link, error: str, *, dead: bool = False) -> None:
        """Fail ``link``'s requests; close it, or keep it as a zombie if some may still act."""
        keep = False
        for pending in list(link.pending.values()):
            settle(pending, ServerUnavailable(error))
            if dead or pending._frame_end > link.sent:  # gone, or never fully sent: the server
                pending.resolved.set()  # cannot act on it (it drops a frame cut short)
                del link.pending[pending.request_id]
            else:
                keep = True
        link.out.clear()
        if not keep:
            if link in self._zombies:
                self._zombies.remove(link)
            link.close()
            return
        if not link.zombie:
            link.zombie = True
            with contextlib.suppress(OSError):
                link.sock.shutdown(socket.SHUT_WR)  # the server ends after what it already has
            self._zombies.append(link)
        while len(self._zombies) > self.max_zombies:
            old = self._zombies.pop(0)
            logger.warning(
                "lmcache-platform %s: no longer waiting for %d request(s) on an old connection to a "
                "server that does not answer; treating them as resolved",
                self.name,
                len(old.pending),
            )
            self._count("zombies_abandoned")
            for pending in old.pending.values():
                pending.resolved.set()
            old.pending.clear()
            old.close()

    def _send_submitted(self) -> None:
        while self._submitted:
            pending, request = self._submitted.popleft()
            link = self._links.get("control" if pending.control else "data")
            if link is None:
                settle(pending, ServerUnavailable(f"{pending.op}: not sent: the server is {self.state}"))
                pending.resolved.set()
                continue
            if time.monotonic_ns() > pending.deadline_ns:
                self._count("deadline_misses")
                settle(pending, ServerUnavailable(f"{pending.op}: deadline passed before it was sent"))
                pending.resolved.set()
                continue
            try:
                frame = _frames.frame(self._encode(pending, request))
            except Exception as exc:  # the caller's request: its error, on its future
                settle(pending, exc)
                pending.resolved.set()
                continue
            self._queue(link, pending, frame)
        for link in list(self._links.values()):
            if link.out and self._alive(link):
                self._flush(link)

    def _alive(self, link: Link) -> bool:
        """Still one of ours (an earlier event in this round may have given it up)."""
        return link.sock.fileno() >= 0 and (link in self._zombies or self._links.get(link.kind) is link)

    def _queue(self, link: Link, pending: Pending[Any], frame: bytes) -> None:
        link.out += frame
        link.queued += len(frame)
        pending._frame_end = link.queued
        link.pending[pending.request_id] = pending

    def _encode(self, pending: Pending[R], request: Request[R]) -> bytes:
        """The request's frame payload, with the session's values, the pending's id and deadline;
        sets how to read its reply."""
        made = replace(
            _ops.bind(request, self.session), request_id=pending.request_id, deadline=pending.deadline_ns
        )
        pending._decode = made.decode_result
        if not pending.op:
            pending.op = made.wire()[0]
        return _messages.encode(made)

    def _flush(self, link: Link) -> None:
        try:
            n = link.sock.send(link.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._link_failed(link, f"sending failed: {why(exc)}", dead=False)
            return
        del link.out[:n]
        link.sent += n

    def _poll(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd: dict[int, Link] = {}
        for link in [*self._links.values(), *self._zombies]:
            fd = link.sock.fileno()
            by_fd[fd] = link
            poller.register(fd, select.POLLIN | (select.POLLOUT if link.out else 0))
        timeout = self._timeout()
        for fd, events in poller.poll(timeout * 1e3):
            if fd == self._wake_r.fileno():
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
                continue
            link = by_fd[fd]
            if events & select.POLLOUT and link.out and not link.zombie and self._alive(link):
                self._flush(link)
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR) and self._alive(link):
                self._read(link)

    def _timeout(self) -> float:
        """Seconds until the watchdog must look again: the next deadline or attempt, at most _POLL_S."""
        now = time.monotonic_ns()
        soonest = now + int(_POLL_S * 1e9)
        for link in self._links.values():
            for pending in link.pending.values():
                if not pending.done():
                    soonest = min(soonest, pending.deadline_ns)
        if not self._links:
            soonest = min(soonest, now + int(max(self._next_attempt - time.monotonic(), 0) * 1e9))
        return max(soonest - now, 0) / 1e9

    def _read(self, link: Link) -> None:
        while True:
            try:
                data = link.sock.recv(_READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._link_failed(link, f"connection error: {why(exc)}", dead=True)
                return
            if not data:
                self._link_failed(link, "the server closed the connection", dead=True)
                return
            link.inbuf += data
            try:
                for payload in _frames.split_frames(link.inbuf):
                    self._reply(link, _messages.decode_reply(payload))
            except WireFormatError as exc:
                self._link_failed(link, f"malformed reply: {exc}", dead=True)
                return
            if link.zombie and not link.pending:  # every request on it is resolved
                self._zombies.remove(link)
                link.close()
                return
            if len(data) < _READ_BYTES:
                return

    def _reply(self, link: Link, reply: _messages.Reply) -> None:
        pending = link.pending.pop(reply.request_id, None)
        if pending is None:
            if reply.request_id == 0 and not reply.ok:  # e.g. "too many connections"
                raise WireFormatError(f"the server refused the connection: {reply.error_message}")
            return
        pending.resolved.set()
        if pending.done():  # failed locally at its deadline; now resolved
            return
        self._count("answered")
        if reply.ok:
            try:
                assert pending._decode is not None  # set when it was encoded
                settle(pending, pending._decode(reply.result))
            except WireFormatError as exc:  # a reply this request cannot have: its failure alone
                self._count("errors")
                settle(pending, exc)
        else:
            self._count("errors")
            settle(
                pending,
                ServerError(
                    f"{pending.op} refused by the server: {reply.error_type}: {reply.error_message}",
                    remote_type=reply.error_type,
                ),
            )
        if pending is self._health:
            self._health = None
            if self._slow_miss:
                self._count("slow")
                if not self._slow:
                    self._slow = True
                    logger.warning(
                        "lmcache-platform %s: server %s is slow: requests miss their %g ms deadline but it "
                        "answers pings",
                        self.name,
                        self.socket_path,
                        self.deadline_ms,
                    )
        elif not link.zombie:
            self._slow = False  # answered in time: the slow episode (if any) is over

    _slow_miss = False  # the pending health ping was sent because a deadline passed

    def _link_failed(self, link: Link, why: str, *, dead: bool) -> None:
        if link.zombie:
            self._retire(link, why, dead=dead)
            return
        # A live link: the whole session goes; this link's requests are resolved if it is dead.
        if dead:
            gone = f"server {self.socket_path} unavailable: {why}"
            for pending in link.pending.values():
                settle(pending, ServerUnavailable(gone))
                pending.resolved.set()
            link.pending.clear()
        self._give_up(why)

    def _watch(self, now: int) -> None:
        """Fail requests past their deadline; ping on a miss; give up when a ping goes unanswered."""
        missed = False
        for link in [*self._links.values(), *self._zombies]:
            for pending in link.pending.values():
                if pending.done() or now <= pending.deadline_ns:
                    continue
                settle(
                    pending,
                    ServerUnavailable(
                        f"{pending.op}: no reply within its deadline (server {self.socket_path})"
                    ),
                )
                if pending is self._health:
                    self._give_up(f"no answer to a ping within {self.ping_deadline_ms:g} ms")
                    return
                self._count("deadline_misses")
                missed = missed or not link.zombie
        if missed and self._health is None and "control" in self._links:
            self._send_ping(slow_miss=True)

    def _send_ping(self, *, slow_miss: bool) -> None:
        deadline = time.monotonic_ns() + int(self.ping_deadline_ms * 1e6)
        ping: Pending[_ops.PingResult] = Pending("ping", next(self._ids), deadline, control=True)
        self._health = ping
        self._slow_miss = slow_miss
        link = self._links["control"]
        self._queue(link, ping, _frames.frame(self._encode(ping, _ops.PingRequest())))
        self._flush(link)

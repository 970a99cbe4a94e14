"""One protocol for the suite's child processes: a command by name with JSON arguments, one answer each.

The parent sends ``{"op": NAME, "args": ARGS}`` (``ARGS`` an object of keyword arguments,
or a list of positional ones); the child calls ``handlers[NAME]`` with them and answers
``{"ok": true, "result": RESULT}``, or ``{"ok": false, "type": "LayoutError", "error":
MESSAGE, "traceback": TEXT}`` when the handler raised or no handler has that name (the
child goes on serving). ``exit`` is answered, then :func:`serve_commands` returns; a
handler named ``exit`` runs first (a child's own teardown). Everything is JSON: nothing
that crosses between the processes is unpickled.

Child side: :func:`serve_commands` over a :class:`Channel`, or :func:`answer` for a child
that gets its requests another way (the vLLM test double's control files). Parent side:
:func:`request` (the result, or :class:`CommandFailed` with the child's error) or
:func:`exchange` (the raw answer, for a test that expects a refusal). Channels: a
``multiprocessing`` connection (:class:`PipeChannel`), JSON lines over a child's stdin
and stdout (:class:`LineChannel`) and a UNIX socket with file descriptors beside a
message (:class:`SocketChannel`).
"""

from __future__ import annotations

import json
import socket
import struct
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, Protocol, TextIO

Handlers = Mapping[str, Callable[..., Any]]


class CommandFailed(AssertionError):
    """A child's handler raised (or the child knew no such command); its type, message and traceback."""

    def __init__(self, op: str, answer: Mapping[str, Any]) -> None:
        self.op = op
        self.type = str(answer.get("type", "?"))
        self.error = str(answer.get("error", answer))
        self.traceback = str(answer.get("traceback", ""))
        super().__init__(f"{op} failed in the child: {self.type}: {self.error}\n{self.traceback}")


class Channel(Protocol):
    """Where messages go both ways; each message is one JSON value."""

    def send(self, message: Any) -> None: ...

    def recv(self, timeout: float | None = None) -> Any: ...


class PipeChannel:
    """A ``multiprocessing`` connection: one JSON document per ``send_bytes``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self.conn.send_bytes(json.dumps(message).encode())

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; :class:`TimeoutError` after ``timeout`` seconds (a hang guard)."""
        if timeout is not None and not self.conn.poll(timeout):
            raise TimeoutError(f"no message within {timeout:g} s")
        return json.loads(self.conn.recv_bytes())


class LineChannel:
    """JSON lines: read from ``reader`` (a child's stdin), written to ``writer`` (its stdout)."""

    def __init__(self, reader: TextIO, writer: TextIO) -> None:
        self.reader, self.writer = reader, writer

    def send(self, message: Any) -> None:
        self.writer.write(json.dumps(message, default=repr) + "\n")
        self.writer.flush()

    def recv(self, timeout: float | None = None) -> Any:
        """The next non-blank line's message (blocking: ``timeout`` is not supported here)."""
        if timeout is not None:
            raise ValueError("LineChannel.recv blocks: read with a thread of your own to bound it")
        for line in self.reader:
            if line.strip():
                return json.loads(line)
        raise EOFError("the channel was closed")


class SocketChannel:
    """A UNIX stream socket: length-prefixed JSON, file descriptors beside a message (``SCM_RIGHTS``).

    ``max_fds``: how many descriptors one received message may carry; those of the last
    message received are in :attr:`fds` (a handler that needs them reads them there).
    """

    def __init__(self, sock: socket.socket, *, max_fds: int = 0) -> None:
        self.sock, self.max_fds = sock, max_fds
        self.fds: list[int] = []

    def send(self, message: Any, fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        frame = struct.pack("!I", len(data)) + data
        if fds:
            socket.send_fds(self.sock, [frame], fds)
        else:
            self.sock.sendall(frame)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message (its descriptors in :attr:`fds`); ``timeout`` as the socket's own."""
        if timeout is not None:
            self.sock.settimeout(timeout)
        if self.max_fds:
            head, fds, _, _ = socket.recv_fds(self.sock, 4, self.max_fds)
        else:
            head, fds = self.sock.recv(4), []
        self.fds = list(fds)
        (size,) = struct.unpack("!I", self._exactly(head, 4))
        return json.loads(self._exactly(b"", size))

    def _exactly(self, got: bytes, n: int) -> bytes:
        while len(got) < n:
            more = self.sock.recv(n - len(got))
            if not more:
                raise EOFError("the peer closed the socket")
            got += more
        return got


def message(op: str, args: Mapping[str, Any] | list[Any] | None = None) -> dict[str, Any]:
    """The request for ``op`` with ``args`` (keywords, or a list of positional arguments)."""
    return {"op": op, "args": {} if args is None else args}


def answer(request: Mapping[str, Any], handlers: Handlers) -> dict[str, Any]:
    """The answer to one request: its handler's result, or why there is none."""
    op = request.get("op")
    try:
        handler = handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            raise LookupError(f"unknown command {op!r}; known: {sorted(handlers)}")
        args = request.get("args", {})
        result = handler(*args) if isinstance(args, list) else handler(**args)
    except Exception as exc:  # answered to the parent, which decides
        return {
            "ok": False,
            "type": type(exc).__name__,
            "error": str(exc),
            "traceback": traceback.format_exc(),
        }
    return {"ok": True, "result": result}


def serve_commands(channel: Channel, handlers: Handlers) -> None:
    """Answer requests until ``exit`` (answered, after ``handlers["exit"]`` if there is one)."""
    while True:
        request = channel.recv()
        if request.get("op") == "exit":
            channel.send(answer(request, handlers) if "exit" in handlers else {"ok": True, "result": None})
            return
        channel.send(answer(request, handlers))


def result_of(op: str, reply: Mapping[str, Any]) -> Any:
    """The result in an answer to ``op``; :class:`CommandFailed` if the child reported an error."""
    if not reply.get("ok"):
        raise CommandFailed(op, reply)
    return reply.get("result")


def exchange(channel: Channel, op: str, args: Any = None, *, timeout: float | None = None) -> dict[str, Any]:
    """Send ``op`` and return the child's raw answer (``ok``, then ``result`` or the error)."""
    channel.send(message(op, args))
    reply: dict[str, Any] = channel.recv(timeout)
    return reply


def request(channel: Channel, op: str, args: Any = None, *, timeout: float | None = None) -> Any:
    """Send ``op`` and return its result; :class:`CommandFailed` if the child's handler raised."""
    return result_of(op, exchange(channel, op, args, timeout=timeout))

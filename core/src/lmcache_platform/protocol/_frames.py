"""Length-prefixed frames over the server's UNIX socket, with file descriptors alongside.

A frame is a 4-byte big-endian length followed by that many bytes, at most
:data:`MAX_FRAME_BYTES`; a larger announced length is refused before anything is read.

Some descriptors name memory by a file descriptor (a CUDA VMM allocation exported as a
POSIX fd): those fds travel with the frame that carries the descriptors, as
``SCM_RIGHTS`` ancillary data, in pieces of at most :data:`FDS_PER_MESSAGE` (the
kernel's limit per message is 253). A receiver that asks for fds collects every fd
that arrives while it reads one frame, up to :data:`MAX_FRAME_FDS`; a receiver that
does not ask lets the kernel close them. Received fds are the caller's: it closes what
it does not keep.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import socket
import struct
import time
from collections.abc import Iterator, Sequence

from .._errors import WireFormatError

#: Largest frame either side accepts, length prefix excluded.
MAX_FRAME_BYTES = 16 << 20
#: Most fds one frame may carry (a VMM KV cache exports one per physical allocation).
MAX_FRAME_FDS = 4096
#: Fds sent with one ``sendmsg``: under the kernel's per-message limit of 253.
FDS_PER_MESSAGE = 240

_PREFIX = struct.Struct(">I")
#: Bytes of a frame's length prefix.
PREFIX_BYTES = _PREFIX.size
_FD_SIZE = array.array("i").itemsize


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


def send_frame(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    """Write one frame (blocking), with ``fds`` (this process keeps its own copies).

    The fds ride on the frame's first bytes, :data:`FDS_PER_MESSAGE` per byte sent, so
    they arrive before the frame is complete (a frame of fewer bytes than messages
    needed is refused: no frame is that short in practice).
    """
    data = frame(payload)
    if len(fds) > MAX_FRAME_FDS:
        raise WireFormatError(f"{len(fds)} file descriptors exceed the limit of {MAX_FRAME_FDS} per frame")
    pieces = [list(fds[i : i + FDS_PER_MESSAGE]) for i in range(0, len(fds), FDS_PER_MESSAGE)]
    if len(pieces) > len(data):
        raise WireFormatError(f"a frame of {len(data)} bytes cannot carry {len(fds)} file descriptors")
    sent = 0
    for piece in pieces:  # one byte per message: each message's fds attach to its byte
        sent += socket.send_fds(sock, [data[sent : sent + 1]], piece)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(
    sock: socket.socket, *, deadline_ns: int | None = None, fds: list[int] | None = None
) -> bytes | None:
    """Read one frame; ``None`` on a clean end of stream between frames.

    Raises :class:`WireFormatError` for an oversized length or a stream cut short
    inside a frame; the connection is then out of sync and must be closed. With
    ``deadline_ns`` (``time.monotonic_ns()``), :class:`TimeoutError` once it passes,
    however the bytes trickle in. With ``fds``, the fds that arrive while the frame is
    read are appended to it (the caller owns them, also when this raises); more than
    :data:`MAX_FRAME_FDS`, or fds the kernel had to drop, raise :class:`WireFormatError`.
    """
    head = _recv_exact(sock, PREFIX_BYTES, at_boundary=True, deadline_ns=deadline_ns, fds=fds)
    if head is None:
        return None
    length = frame_length(head)
    body = _recv_exact(sock, length, at_boundary=False, deadline_ns=deadline_ns, fds=fds)
    assert body is not None
    return body


def split_frames(buf: bytearray) -> Iterator[bytes]:
    """Complete frames at the head of ``buf`` (bytes read so far), removed as they are yielded."""
    while len(buf) >= PREFIX_BYTES:
        length = frame_length(bytes(buf[:PREFIX_BYTES]))
        end = PREFIX_BYTES + length
        if len(buf) < end:
            return
        payload = bytes(buf[PREFIX_BYTES:end])
        del buf[:end]
        yield payload


def close_fds(fds: Sequence[int]) -> None:
    """Close every fd of ``fds`` (received ones nobody took); errors of one do not stop the rest."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _recv_exact(
    sock: socket.socket, n: int, *, at_boundary: bool, deadline_ns: int | None, fds: list[int] | None
) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline_ns is not None:
            left = deadline_ns - time.monotonic_ns()
            if left <= 0:
                raise TimeoutError("deadline passed while reading a reply")
            sock.settimeout(left / 1e9)
        k = sock.recv_into(view[got:]) if fds is None else _recv_with_fds(sock, view[got:], fds)
        if k == 0:
            if got == 0 and at_boundary:
                return None
            raise WireFormatError(f"connection closed inside a frame ({got} of {n} bytes)")
        got += k
    return bytes(buf)


#: What an operator does about a server out of fds.
RAISE_FD_LIMIT = "raise the server's limit (ulimit -n before serve, or LimitNOFILE= in its systemd unit)"


def fd_usage() -> tuple[int, int]:
    """This process's open fds and its soft ``RLIMIT_NOFILE`` (-1 for what cannot be read)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = -1 if soft == resource.RLIM_INFINITY else int(soft)
    try:
        open_now = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError as exc:  # listing takes an fd too: none left is the answer
        open_now = limit if exc.errno in (errno.EMFILE, errno.ENFILE) else -1
    return open_now, limit


def _dropped_fds_reason(received: int) -> str:
    """Why the kernel dropped fds that came with a message: this process's fd limit, most often.

    The kernel truncates what it cannot install (``MSG_CTRUNC``) when the receiver has no
    fd numbers left under its soft ``RLIMIT_NOFILE``, as when a sender attaches more
    than a message's room.
    """
    open_now, soft = fd_usage()
    if soft >= 0 and open_now >= 0 and open_now + FDS_PER_MESSAGE > soft:
        return (
            f"file descriptors were dropped: the server has {open_now} open of its limit of {soft} "
            f"(RLIMIT_NOFILE), so the kernel could not give it those that came with the message; "
            f"{RAISE_FD_LIMIT} and register again"
        )
    return (
        f"file descriptors were dropped: more arrived with one message than allowed "
        f"({received} received; at most {FDS_PER_MESSAGE} per message)"
    )


def _recv_with_fds(sock: socket.socket, into: memoryview, fds: list[int]) -> int:
    """One ``recvmsg`` into ``into``; the fds it brings go to ``fds`` before anything is checked."""
    room = socket.CMSG_SPACE(FDS_PER_MESSAGE * _FD_SIZE)
    k, ancillary, flags, _ = sock.recvmsg_into([into], room, socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[: len(data) - len(data) % _FD_SIZE])
            fds.extend(got)
    if flags & socket.MSG_CTRUNC:
        raise WireFormatError(_dropped_fds_reason(len(fds)))
    if len(fds) > MAX_FRAME_FDS:
        raise WireFormatError(f"more than {MAX_FRAME_FDS} file descriptors arrived with one frame")
    return int(k)

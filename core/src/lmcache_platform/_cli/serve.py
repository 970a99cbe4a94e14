"""``lmcache-platform serve``: the reference KV-cache server as a foreground process.

It runs :class:`lmcache_platform.server.ReferenceServer` on one UNIX socket until
SIGINT or SIGTERM, then closes every context and removes its socket. Logs go to
stderr, one line per event (``--json-log``: one JSON object per line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import signal
import sys
from types import FrameType
from typing import Any

from ..server import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HOST_BYTES
from . import positive_int as _positive

SOCKET_ENV = "LMCACHE_PLATFORM_SOCKET"
MAX_HOST_BYTES_ENV = "LMCACHE_PLATFORM_MAX_HOST_BYTES"

_EPILOG = f"""\
environment variables:
  {SOCKET_ENV}            socket path when --socket is not given
  {MAX_HOST_BYTES_ENV}    host memory cap when --max-host-bytes is not given
  LMCACHE_PLATFORM_BACKEND           backends to use, e.g. cpu.file,cuda (see `lmcache-platform list`)
  LMCACHE_PLATFORM_DISABLE           backends never to load
  LMCACHE_PLATFORM_CPU_FILE_DIR      directory backing CPU KV tensors for the cpu.file backend
  (each backend's own variables: see the operator guide)

The socket's directory must belong to you with mode 0700; a missing one is created
so. A socket left by a server that died is replaced; a live server's is refused.
Stop with SIGINT (Ctrl-C) or SIGTERM: every context is closed and the socket removed.
Exit status: 0 after a clean stop, 2 when the server could not start.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Run the reference KV-cache server in the foreground: engines register their KV\n"
        "caches over a UNIX socket and share stored chunks by content key."
    )
    parser.epilog = _EPILOG
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=os.environ.get(SOCKET_ENV),
        help=f"UNIX socket to listen on (default: ${SOCKET_ENV})",
    )
    parser.add_argument(
        "--max-host-bytes",
        metavar="N",
        type=parse_size,
        default=os.environ.get(MAX_HOST_BYTES_ENV, str(DEFAULT_MAX_HOST_BYTES)),
        help="host memory for stored chunks, e.g. 16G or 512MiB; the least recently used chunks "
        f"are evicted beyond it (default: ${MAX_HOST_BYTES_ENV} or {DEFAULT_MAX_HOST_BYTES >> 30}G)",
    )
    parser.add_argument(
        "--max-connections",
        metavar="N",
        type=_positive,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"concurrent client connections; more are refused (default: {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument("--json-log", action="store_true", help="log one JSON object per line")


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"16G"`` -> bytes: an integer with an optional binary unit K, M, G or T (``iB``/``B`` allowed)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r} (use e.g. 16G, 512MiB or 1048576)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, event, message and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", "log"),
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                out.setdefault(str(key), value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _configure_logging(json_log: bool, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_log:
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)


def run(args: argparse.Namespace) -> int:
    from ..server import ReferenceServer, ServerError
    from ..server._server import log_event

    _configure_logging(args.json_log, getattr(args, "verbose", False))
    if not args.socket:
        log_event(logging.ERROR, "error", f"no socket path: pass --socket PATH or set {SOCKET_ENV}")
        return 2
    path = os.path.abspath(args.socket)
    server = ReferenceServer(path, max_host_bytes=args.max_host_bytes, max_connections=args.max_connections)
    try:
        _make_private_dir(os.path.dirname(path))
        server.bind()
    except (OSError, ServerError) as exc:
        log_event(logging.ERROR, "error", f"cannot start: {type(exc).__name__}: {exc}", socket=path)
        return 2
    try:  # after bind, so a taken socket fails fast; clients wait in the backlog meanwhile
        import torch  # noqa: F401 - pay the import now, not in the first registration
    except ImportError as exc:
        log_event(logging.ERROR, "error", f"cannot start: torch is not importable: {exc}", socket=path)
        server.stop()
        server.serve_forever()  # returns at once: removes the socket
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        log_event(logging.INFO, "signal", f"{name}: stopping (send it again to exit at once)", signal=name)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        server.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server.serve_forever()
    return 0


def _make_private_dir(directory: str) -> None:
    """Create the socket's directory (one level) with mode 0700 if it is missing."""
    from ..server._server import log_event

    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        return
    log_event(
        logging.INFO, "mkdir", f"created the socket directory {directory} (mode 0700)", directory=directory
    )

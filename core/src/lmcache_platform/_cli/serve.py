"""``lmcache-platform serve``: the reference KV-cache server as a foreground process.

It runs :class:`lmcache_platform.server.ReferenceServer` on one UNIX socket until
SIGINT or SIGTERM, then closes every context and removes its socket. Logs go to
stderr, one line per event (``--json-log``: one JSON object per line). With
``--remote URL`` the server puts a store every node shares behind its own chunks (the
flags are in ``_cli._remote``; see docs/multi-node.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

from .._env import BACKEND_ENV, DISABLE_ENV, HOST_MEMORY_ENV, MAX_HOST_BYTES_ENV, SOCKET_ENV, env_choice
from .._units import parse_bytes
from ..server import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HOST_BYTES, DEFAULT_TORCH_THREADS
from ..server._server import HOST_MEMORY_MODES
from . import _remote
from ._args import add_socket_argument
from ._args import positive_int as _positive

_EPILOG = f"""\
environment variables:
  {SOCKET_ENV}            socket path when --socket is not given
  {MAX_HOST_BYTES_ENV}    host memory cap when --max-host-bytes is not given
  {HOST_MEMORY_ENV}       --host-memory when it is not given (eager or ahead)
  {BACKEND_ENV}           backends to use, e.g. cpu.file,cuda (see `lmcache-platform list`)
  {DISABLE_ENV}           backends never to load
  LMCACHE_PLATFORM_CPU_FILE_DIR      directory backing CPU KV tensors for the cpu.file backend
  (each backend's own variables: see the operator guide)

The socket's directory must belong to you with mode 0700; a missing one is created
so (one level: a missing parent is refused with the `mkdir -m 700 -p` line to run).
A socket left by a server that died is replaced; a live server's is refused.
Stop with SIGINT (Ctrl-C) or SIGTERM: every context is closed and the socket removed.
With --metrics-port, GET http://HOST:PORT/metrics serves the server's counters in the
Prometheus text format; `lmcache-platform status` prints them for a person.
With --remote, chunks stored here are also written to a store every node shares, and
chunks found there are loaded from it; a password is never given on the command line
(--remote-password-env or --remote-password-file).
Exit status: 0 after a clean stop, 2 when the server could not start, 3 when a device
failed for good (a sticky CUDA error: nothing could move any more; a supervisor starts a
fresh server).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Run the reference KV-cache server in the foreground: engines register their KV\n"
        "caches over a UNIX socket and share stored chunks by content key."
    )
    parser.epilog = _EPILOG
    add_socket_argument(parser, "UNIX socket to listen on")
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
    parser.add_argument(
        "--torch-threads",
        metavar="N",
        type=_positive,
        default=DEFAULT_TORCH_THREADS,
        help="torch's intra-op threads for the server's copies (default: "
        f"{DEFAULT_TORCH_THREADS}: the server shares cores with the engines; transfers of several "
        "engines run in parallel anyway)",
    )
    parser.add_argument(
        "--host-memory",
        choices=HOST_MEMORY_MODES,
        default=None,
        help="how chunk memory is prepared, in the background from the start, off the request path: "
        "'eager' maps and faults in all of --max-host-bytes (short of the host's last GiB), so the "
        "first stores find it ready (default: $" + HOST_MEMORY_ENV + " or eager); 'ahead' keeps "
        "only 256 MiB of it ready ahead of use (a host whose memory is tight)",
    )
    parser.add_argument("--json-log", action="store_true", help="log one JSON object per line")
    parser.add_argument(
        "--metrics-port",
        metavar="N",
        type=_port,
        default=None,
        help="serve Prometheus metrics on GET /metrics at this TCP port (0: any free port, logged); "
        "off by default",
    )
    parser.add_argument(
        "--metrics-host",
        metavar="HOST",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default: 127.0.0.1, this host only)",
    )
    _remote.add_arguments(parser, parse_size)


def _port(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {text!r}")
    return value


def parse_size(text: str) -> int:
    """``"16G"`` -> bytes, in :func:`~lmcache_platform.parse_bytes`'s grammar; at least one byte."""
    refusal = f"not a positive size: {text!r} (use e.g. 16G, 512MiB or 1048576)"
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(refusal) from None
    if value < 1:
        raise argparse.ArgumentTypeError(refusal)
    return value


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
    from .._errors import ServerError
    from ..remote import RemoteConfigError, RemoteStoreLoadError
    from ..server import ReferenceServer
    from ..server._log import log_event
    from ..server._process import freeze_startup_objects, raise_fd_limit

    _configure_logging(args.json_log, getattr(args, "verbose", False))
    if not args.socket:
        log_event(logging.ERROR, "error", f"no socket path: pass --socket PATH or set {SOCKET_ENV}")
        return 2
    path = os.path.abspath(args.socket)
    try:
        host_memory = args.host_memory or env_choice(HOST_MEMORY_ENV, HOST_MEMORY_MODES, "eager")
    except ValueError as exc:
        log_event(logging.ERROR, "error", f"cannot start: {exc}", socket=path)
        return 2
    try:
        tier = _remote.open_tier(args)
    except (RemoteConfigError, RemoteStoreLoadError) as exc:
        log_event(logging.ERROR, "error", f"cannot start: remote tier: {exc}", socket=path)
        return 2
    server = ReferenceServer(
        path,
        max_host_bytes=args.max_host_bytes,
        max_connections=args.max_connections,
        tier=tier,
        remote_flush_timeout_s=args.remote_flush_timeout or 5.0,
        host_memory=host_memory,
    )
    # The socket's directory first: a mistake there is the one line logged, before any other.
    try:
        _make_private_dir(os.path.dirname(path))
    except OSError as exc:  # ours carries the fix and no errno; the system's is named
        why = str(exc) if exc.errno is None else f"{type(exc).__name__}: {exc}"
        log_event(logging.ERROR, "error", f"cannot start: {why}", socket=path)
        if tier is not None:
            tier.close()
        return 2
    # Before bind: a socket that exists is one that answers. Engines that watch the path for
    # a restarted server connect the moment it appears, and their pings carry deadlines that
    # seconds of imports in a backlog would miss (they would then wait out a back-off).
    try:
        import torch  # paid now, not in the first registration
    except ImportError as exc:
        log_event(logging.ERROR, "error", f"cannot start: torch is not importable: {exc}", socket=path)
        if tier is not None:
            tier.close()
        return 2
    torch.set_num_threads(args.torch_threads)
    before, after = raise_fd_limit()
    if after != before:
        log_event(
            logging.INFO,
            "rlimit",
            f"open files: the soft limit (RLIMIT_NOFILE) raised from {before} to {after}, the hard limit",
            before=before,
            after=after,
        )
    frozen = freeze_startup_objects()
    try:
        server.bind()
    except (OSError, ServerError) as exc:
        log_event(logging.ERROR, "error", f"cannot start: {type(exc).__name__}: {exc}", socket=path)
        if tier is not None:
            tier.close()
        return 2
    # Logged once started: a server that cannot start says only why.
    log_event(
        logging.INFO,
        "torch",
        f"torch {torch.__version__}: {args.torch_threads} intra-op thread"
        f"{'' if args.torch_threads == 1 else 's'} for copies; {frozen} objects of the imports "
        "left out of garbage collection",
        version=str(torch.__version__),
        threads=torch.get_num_threads(),
        frozen=frozen,
    )
    if tier is not None:
        log_event(
            logging.INFO,
            "remote",
            f"remote tier: {tier.name}, prefix {tier.prefix.decode()}, write-behind queue "
            f"{tier.queue_bytes} bytes{', keyed checksums' if tier.keyed else ''}",
            store=tier.name,
            prefix=tier.prefix.decode(),
            queue_bytes=tier.queue_bytes,
            keyed=tier.keyed,
        )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        log_event(logging.INFO, "signal", f"{name}: stopping (send it again to exit at once)", signal=name)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        server.stop()

    metrics = None
    if args.metrics_port is not None:
        from ..server._metrics import MetricsServer

        try:
            metrics = MetricsServer(server.counters, args.metrics_host, args.metrics_port)
        except OSError as exc:
            log_event(
                logging.ERROR,
                "error",
                f"cannot start: metrics endpoint {args.metrics_host}:{args.metrics_port}: {exc}",
                socket=path,
            )
            server.stop()
            server.serve_forever()  # returns at once: removes the socket
            return 2
        log_event(
            logging.INFO,
            "metrics",
            f"serving metrics on {metrics.url}",
            host=metrics.host,
            port=metrics.port,
            url=metrics.url,
        )
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        server.serve_forever()
    finally:
        if metrics is not None:
            metrics.close()
    return 3 if server.device_failed else 0


def _make_private_dir(directory: str) -> None:
    """Create the socket's directory (one level) with mode 0700 if it is missing.

    Raises :class:`OSError` with a message that gives the fix when its parent is missing.
    """
    from ..server._log import log_event

    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        return
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the socket's directory {directory} is missing, and so is its parent (serve creates "
            f"one level only); create it: mkdir -m 700 -p {directory}"
        ) from None
    log_event(
        logging.INFO, "mkdir", f"created the socket directory {directory} (mode 0700)", directory=directory
    )

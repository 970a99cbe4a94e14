"""``lmcache-platform status``: a running server's counters, for a person (or ``--json``).

It sends one ``status`` request with a deadline over the server's socket and prints the
``server`` map as a short aligned table (the remote tier's counters, when the server has
one, as ``remote.<name>`` rows). A server that does not answer within
``--timeout`` (a dead one, a hung one, a wrong path) is exit status 2 with one line
saying why, never a hang.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._env import SOCKET_ENV
from .._units import format_bytes
from ._args import add_socket_argument

_BYTES = ("host_bytes", "max_host_bytes")
#: Lookup counters of the server's own memory; ``remote_hits`` counts the remote tier's apart.
_HOST_ONLY = {
    "hits": "found in host memory; remote_hits counts the remote tier's",
    "misses": "not in host memory; the remote tier may hold them: remote_hits",
}
_EPILOG = f"""\
environment variables:
  {SOCKET_ENV}   socket path when --socket is not given

Exit status: 0 when the server answered, 2 when none answered in time.
The same counters are served to Prometheus by `serve --metrics-port N`.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    add_socket_argument(parser, "the server's UNIX socket")
    parser.add_argument("--json", action="store_true", help="print the counters as one JSON object")
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        default=5.0,
        help="seconds to wait for the server's answer (default: 5)",
    )


def run(args: argparse.Namespace) -> int:
    from ..client import ServerClient

    if not args.socket:
        print(
            f"lmcache-platform status: no socket path: pass --socket PATH or set {SOCKET_ENV}",
            file=sys.stderr,
        )
        return 2
    timeout = max(args.timeout, 0.001)
    try:
        with ServerClient(args.socket, timeout=timeout, deadline_ms=timeout * 1e3) as client:
            counters = client.status()["server"]
    except Exception as exc:  # OSError, ServerError, WireFormatError: no usable answer
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):  # nothing to wait for
            what = "no socket there" if isinstance(exc, FileNotFoundError) else "nothing listens on it"
            print(
                f"lmcache-platform status: no server at {args.socket}: {what} ({why}); "
                "start one with `lmcache-platform serve --socket PATH`",
                file=sys.stderr,
            )
        else:
            print(
                f"lmcache-platform status: no server answered at {args.socket} within {timeout:g} s ({why})",
                file=sys.stderr,
            )
        return 2
    if args.json:
        print(json.dumps(counters, sort_keys=True, default=_plain))
    else:
        print(render(args.socket, counters))
    return 0


def render(socket_path: str, counters: dict[str, Any]) -> str:
    """The counters as ``name  value`` lines under a one-line heading."""
    head = f"server {socket_path}: pid {counters.get('pid', '?')}"
    if isinstance(counters.get("uptime_s"), (int, float)):
        head += f", up {_duration(counters['uptime_s'])}"
    rows: list[tuple[str, str]] = []
    for key, value in counters.items():
        if key in ("pid", "uptime_s"):
            continue
        if key == "remote" and isinstance(value, dict):  # the remote tier: one row per counter
            rows += [(f"remote.{k}", str(_plain(v))) for k, v in value.items()]
            continue
        if key in _HOST_ONLY and "remote" in counters:
            text = f"{_plain(value)} ({_HOST_ONLY[key]})"
        elif isinstance(value, dict):
            text = ", ".join(f"{k} {v}" for k, v in sorted(value.items())) or "none"
        elif key in _BYTES and isinstance(value, int):
            text = f"{value} ({format_bytes(value)})"
        else:
            text = str(_plain(value))
        rows.append((key, text))
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join([head, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f} s"
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _plain(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value

"""argparse types the subcommands share."""

from __future__ import annotations

import argparse
import os

from .._env import SOCKET_ENV


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts and sizes: a positive integer, or a usage error."""
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_socket_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """``--socket PATH``, by default ``$LMCACHE_PLATFORM_SOCKET``: the server's UNIX socket."""
    parser.add_argument(
        "--socket",
        metavar="PATH",
        default=os.environ.get(SOCKET_ENV),
        help=f"{help} (default: ${SOCKET_ENV})",
    )

"""``lmcache-platform`` command line: a thin dispatcher over one module per subcommand.

Subcommand modules are imported only when their command runs, so ``--help`` and
``list`` stay fast and never import torch. Each exposes ``add_arguments(parser)``
and ``run(args) -> int``. ``python -m lmcache_platform`` runs it too (the package's
``__main__``; ``python -m lmcache_platform._cli`` still works).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from .._version import API_VERSION, __version__

#: command -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "list": ("lmcache_platform._cli.list", "list installed backends and the one selected per device"),
    "demo": ("lmcache_platform._cli.demo", "run an engine/server KV-cache round trip and time it"),
    "doctor": ("lmcache_platform._cli.doctor", "diagnose this host: Python, torch, backends, /dev/shm"),
    "gc": ("lmcache_platform._cli.gc", "reclaim resources left behind by dead producers"),
    "check": ("lmcache_platform._cli.check", "run the conformance suite against a backend"),
    "bench": ("lmcache_platform._cli.bench", "benchmark hand-off, transfers and dispatch"),
    "serve": ("lmcache_platform._cli.serve", "run the reference KV-cache server in the foreground"),
    "status": ("lmcache_platform._cli.status", "print a running reference server's counters"),
    "tiny-model": (
        "lmcache_platform._cli.tiny_model",
        "write a tiny random-weight model and tokenizer, to try vLLM without a model hub",
    ),
}
#: ``--help``'s opening: what the tool is for and where to start.
DESCRIPTION = """\
Device-platform layer for LLM KV caches. Run the KV-cache server with
`lmcache-platform serve --socket PATH`, read its counters with `status`, and connect
vLLM to it (docs/vllm.md); `demo` runs a round trip on its own, `list` and `doctor`
show what is installed. Docs: docs/index.md in the repository."""


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-platform",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__} (backend API {API_VERSION})"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:  # import only the module of the command being run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Not list(...): importing the ``list`` subcommand binds that name in this package.
    argv = [*(sys.argv[1:] if argv is None else argv)]
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args))

"""``serve``'s remote-tier flags: from ``--remote URL`` and its options to a :class:`RemoteTier`.

Secrets never travel on the command line: the password comes from a variable or a file
(``--remote-password-env``, ``--remote-password-file``; a URL with one is refused), and
the checksum key from a file. Every mistake is a :class:`RemoteConfigError` whose message
names the flag, so ``serve`` stops with one line and exit status 2. Opening the tier does
not wait on the network: a store that is down at start is probed in the background.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _units
from ._args import positive_int as _positive

if TYPE_CHECKING:
    from ..remote._chain import RemoteChain
    from ..remote._tier import RemoteTier

#: The flags that mean nothing without ``--remote``, as argparse names them.
_DEPENDENT = (
    "remote_prefix",
    "remote_password_env",
    "remote_password_file",
    "remote_tls_ca",
    "remote_tls_cert",
    "remote_tls_key",
    "remote_key_file",
    "remote_ttl",
    "remote_queue_bytes",
    "remote_timeout_ms",
    "remote_option",
    "remote_flush_timeout",
)


def parse_duration(text: str) -> float:
    """:func:`lmcache_platform._units.parse_duration` for argparse (its message as the error)."""
    try:
        return _units.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_access_arguments(group: argparse._ArgumentGroup) -> None:
    """How to reach a remote store: its password and TLS files (``serve --remote``, ``check --remote``)."""
    group.add_argument("--remote-password-env", metavar="NAME", help="the variable holding the password")
    group.add_argument("--remote-password-file", metavar="PATH", help="the file holding the password")
    group.add_argument(
        "--remote-tls-ca", metavar="PATH", help="CA certificates to trust (default: the system's)"
    )
    group.add_argument("--remote-tls-cert", metavar="PATH", help="client certificate, for mutual TLS")
    group.add_argument("--remote-tls-key", metavar="PATH", help="the client certificate's key")


def add_arguments(parser: argparse.ArgumentParser, parse_size: Callable[[str], int]) -> None:
    """The ``--remote*`` flags, in a group of their own (see docs/multi-node.md)."""
    group = parser.add_argument_group(
        "remote tier (a store shared by every node's server; see docs/multi-node.md)"
    )
    group.add_argument(
        "--remote",
        metavar="URL",
        action="append",
        default=None,
        help="a store behind the server's memory: file:///dir[?max_bytes=SIZE] "
        "(lmcache-platform-file-store), valkey://[user@]host[:port][/db], valkeys://... (TLS), "
        "valkey+cluster://h1:p1,h2:p2,..., or a "
        "scheme an installed store serves; repeat it for a chain of tiers, nearest first (docs/tiers.md)",
    )
    group.add_argument(
        "--remote-flush-timeout",
        metavar="DURATION",
        type=parse_duration,
        help="on a clean stop, how long the write-behind queues may take to drain before what is "
        "left is dropped and logged (default: 5s)",
    )
    group.add_argument(
        "--remote-prefix",
        metavar="NAME",
        help="the deployment's key prefix, 1 to 64 of [A-Za-z0-9._-] (default: lmcache)",
    )
    add_access_arguments(group)
    group.add_argument(
        "--remote-key-file",
        metavar="PATH",
        help="a secret of at least 16 bytes the deployment's servers share: entries' checksums "
        "are keyed with it, so a writer without it cannot forge entries",
    )
    group.add_argument(
        "--remote-ttl",
        metavar="DURATION",
        type=parse_duration,
        help="ask the store to forget entries this long after their last write, e.g. 24h "
        "(default: never; its eviction policy decides)",
    )
    group.add_argument(
        "--remote-queue-bytes",
        metavar="SIZE",
        type=parse_size,
        help="bound of the write-behind queue, held in memory beside --max-host-bytes (default: 1G); "
        "chunks beyond it are dropped and counted, never waited for",
    )
    group.add_argument(
        "--remote-timeout-ms",
        metavar="N",
        type=_positive,
        help="deadline of a store call whose request carries none (default: 1000)",
    )
    group.add_argument(
        "--remote-option",
        metavar="KEY=VALUE",
        action="append",
        default=None,
        help="a setting of the store (Valkey: socket_timeout, max_calls); repeatable",
    )


def open_tier(args: argparse.Namespace) -> RemoteTier | RemoteChain | None:
    """The tier ``args`` ask for (a chain for a repeated ``--remote``), or ``None`` without one.

    The other ``--remote-*`` flags apply to every tier of a chain (each tier checks its
    entries with the same key and prefix, so a chunk moves between them unchanged).

    Raises :class:`~lmcache_platform.remote.RemoteConfigError` (a flag's mistake, an
    unknown scheme, an unreadable secret) or
    :class:`~lmcache_platform.remote.RemoteStoreLoadError` (the store's plugin is broken).
    """
    from ..remote import RemoteConfigError, RemoteOptions
    from ..remote._chain import open_chain

    if not args.remote:
        given = [name for name in _DEPENDENT if getattr(args, name, None) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise RemoteConfigError(f"{flag} needs --remote URL")
        return None
    settings: dict[str, str] = {}
    for item in args.remote_option or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RemoteConfigError(f"--remote-option {item!r}: expected KEY=VALUE")
        if key.strip() in settings:
            raise RemoteConfigError(f"--remote-option {key.strip()} is given twice")
        settings[key.strip()] = value
    options = RemoteOptions(
        password_env=args.remote_password_env,
        password_file=args.remote_password_file,
        tls_ca_file=args.remote_tls_ca,
        tls_cert_file=args.remote_tls_cert,
        tls_key_file=args.remote_tls_key,
        settings=settings,
    )
    timeout_ms = args.remote_timeout_ms
    return open_chain(
        list(args.remote),
        options,
        key_file=args.remote_key_file,
        prefix=args.remote_prefix,
        ttl_s=args.remote_ttl,
        queue_bytes=args.remote_queue_bytes,
        call_timeout_s=timeout_ms / 1e3 if timeout_ms else None,
    )

"""The remote conformance suite's pytest plugin: ``--lmcache-remote`` and its fixtures.

Loaded in every pytest run through the ``pytest11`` entry point
``lmcache_platform.remote.conformance`` (cheap: it imports no store and no client).
Fixtures: ``remote_url`` and ``remote_options`` (session), ``remote_store`` (session, the
store under test), ``remote_key`` (a fresh key maker per test), ``remote_variant_url``
(a URL of the same store at a stalled or a refusing loopback server).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .. import RemoteOptions, RemoteStore

#: How long entries the suite writes may live in the store under test (seconds).
SUITE_TTL_S = 600.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lmcache-remote", "lmcache-platform remote-store conformance")
    group.addoption(
        "--lmcache-remote",
        metavar="URL",
        default=None,
        help="remote store the suite checks: "
        "pytest --pyargs lmcache_platform.remote.conformance --lmcache-remote URL",
    )
    group.addoption(
        "--lmcache-remote-option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a store setting (RemoteOptions.settings); repeatable",
    )
    group.addoption("--lmcache-remote-password-env", metavar="NAME", default=None, help="password variable")
    group.addoption("--lmcache-remote-password-file", metavar="PATH", default=None, help="password file")
    group.addoption("--lmcache-remote-tls-ca", metavar="PATH", default=None, help="CA certificates to trust")
    group.addoption("--lmcache-remote-tls-cert", metavar="PATH", default=None, help="client certificate")
    group.addoption("--lmcache-remote-tls-key", metavar="PATH", default=None, help="client certificate's key")
    group.addoption(
        "--lmcache-remote-stalled", metavar="URL", default=None, help="a URL whose server never answers"
    )
    group.addoption("--lmcache-remote-refused", metavar="URL", default=None, help="a URL nothing listens on")


@pytest.fixture(scope="session")
def remote_url(pytestconfig: pytest.Config) -> str:
    url = pytestconfig.getoption("lmcache_remote")
    if not url:
        pytest.exit(
            "the remote conformance suite checks one store: pass --lmcache-remote URL",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    return str(url)


@pytest.fixture(scope="session")
def remote_options(pytestconfig: pytest.Config) -> RemoteOptions:
    from .. import RemoteOptions

    settings = {}
    for item in pytestconfig.getoption("lmcache_remote_option"):
        key, sep, value = item.partition("=")
        if not sep:
            pytest.exit(
                f"--lmcache-remote-option {item!r}: expected KEY=VALUE",
                returncode=pytest.ExitCode.USAGE_ERROR,
            )
        settings[key] = value
    return RemoteOptions(
        password_env=pytestconfig.getoption("lmcache_remote_password_env"),
        password_file=pytestconfig.getoption("lmcache_remote_password_file"),
        tls_ca_file=pytestconfig.getoption("lmcache_remote_tls_ca"),
        tls_cert_file=pytestconfig.getoption("lmcache_remote_tls_cert"),
        tls_key_file=pytestconfig.getoption("lmcache_remote_tls_key"),
        settings=settings,
    )


@pytest.fixture(scope="session")
def remote_store(remote_url: str, remote_options: RemoteOptions) -> Iterator[RemoteStore]:
    """The store under test, opened through installed metadata like ``serve --remote`` does."""
    from .. import RemoteError, open_remote

    try:
        store = open_remote(remote_url, remote_options)
        store.ping(timeout=10.0)
    except Exception as exc:  # report why in one line instead of a failure per test
        kind = "unusable" if isinstance(exc, RemoteError) else "cannot be opened"
        pytest.exit(
            f"{remote_url} {kind}: {type(exc).__name__}: {exc}", returncode=pytest.ExitCode.USAGE_ERROR
        )
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def remote_key() -> Callable[[str], bytes]:
    """``remote_key("a")`` -> a key no other test or run uses."""
    run = os.urandom(8).hex()
    return lambda name: f"lmcache-conformance:{run}:{name}".encode()


@pytest.fixture
def remote_variant_url(remote_url: str, pytestconfig: pytest.Config) -> Iterator[Callable[[str], str]]:
    """``remote_variant_url("stalled")`` or ``("refused")``: the store's URL at a broken loopback server."""
    from .. import RemoteURL

    stalled: list[Blackhole] = []

    def make(kind: str) -> str:
        given = pytestconfig.getoption(f"lmcache_remote_{kind}")
        if given:
            return str(given)
        url = RemoteURL.parse(remote_url)
        if not url.hosts:
            pytest.skip(
                f"{remote_url} has no host to replace: pass --lmcache-remote-{kind} URL "
                f"(lmcache-platform check: --remote-{kind} URL)"
            )
        if kind == "stalled":
            stalled.append(Blackhole())
            port = stalled[-1].port
        else:
            with socket.socket() as s:  # bound, never listening: connections are refused
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        user = f"{url.username}@" if url.username else ""
        tail = f"/{url.path}" if url.path else ""
        return f"{url.scheme}://{user}127.0.0.1:{port}{tail}"

    try:
        yield make
    finally:
        for b in stalled:
            b.close()


class Blackhole:
    """A loopback listener that accepts connections and never answers: a hung server.

    Behind ``remote_variant_url("stalled")``; a store's own tests may point a client at
    ``port`` to check its timeouts. ``close()`` closes the listener and what it accepted.
    """

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = int(self.listener.getsockname()[1])
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, name="lmcache-remote-blackhole", daemon=True)
        self.thread.start()

    def serve(self) -> None:
        self.listener.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self.held.append(conn)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.listener.close()
        for c in self.held:
            c.close()

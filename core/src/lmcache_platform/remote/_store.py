"""What a remote store is: a small bytes key-value protocol, its URL and its options.

The protocol is the whole contract between core and a store (Valkey, Mooncake, S3...):
batched calls, because one pipelined round trip per batch is what keeps a remote tier
usable; a ``timeout`` on every call, because a server never waits on a store for longer
than its engine waits on it; bytes in and bytes out, because what the bytes mean (and
whether to trust them) is core's business, not the store's.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qsl

from ._errors import RemoteConfigError

logger = logging.getLogger(__name__)

#: Bytes a store takes or returns: ``bytes``, or a ``bytearray``/``memoryview`` over them.
Buffer = bytes | bytearray | memoryview

#: A URL scheme, and so an entry-point name of the ``lmcache.remote`` group.
SCHEME_RE = re.compile(r"^[a-z][a-z0-9]{0,31}(\+[a-z0-9]{1,32})?$")


@runtime_checkable
class RemoteStore(Protocol):
    """A remote key-value store of opaque bytes, shared by every node of a deployment.

    Every call takes ``timeout`` (seconds, > 0) and returns or raises within about that
    time, whatever the network does. Calls raise only
    :class:`~lmcache_platform.remote.RemoteError` subclasses:
    :class:`~lmcache_platform.remote.RemoteTimeout` when the timeout passed,
    :class:`~lmcache_platform.remote.RemoteUnavailable` when the store cannot be reached,
    :class:`~lmcache_platform.remote.RemotePartialError` when some items of a batch failed
    and the others did not (a cluster with a node down). A key the store does not hold is
    not an error. Keys are ASCII (letters, digits, ``.``, ``_``, ``-``, ``:``), at most
    400 bytes; values are any bytes, up to the chunk size (hundreds of MiB). A store is
    used from several threads at once.
    """

    def get_many(self, keys: Sequence[bytes], *, timeout: float) -> list[Buffer | None]:
        """The value of each key, ``None`` where absent; one pipelined round trip."""
        ...

    def exists_many(self, keys: Sequence[bytes], *, timeout: float) -> list[bool]:
        """Whether each key is held; one pipelined round trip, no value is moved."""
        ...

    def put_many(
        self, items: Sequence[tuple[bytes, Buffer]], *, ttl: float | None, timeout: float
    ) -> list[bool]:
        """Store each ``(key, value)``, replacing what was there; ``True`` where stored.

        ``ttl``: seconds after which the store may forget the entry (``None``: only its
        own eviction policy forgets it). One pipelined round trip.
        """
        ...

    def ping(self, *, timeout: float) -> None:
        """Return when the store answers; raise when it does not (the health check)."""
        ...

    def close(self) -> None:
        """Release connections and threads; idempotent. Calls after it raise RemoteUnavailable."""
        ...


@dataclass(frozen=True)
class RemoteURL:
    """A parsed remote-store URL: ``scheme://[user@]host[:port][,host[:port]...][/path][?query]``.

    A password in the URL is refused (command lines and process listings show URLs): pass
    it through :class:`RemoteOptions` instead.
    """

    scheme: str
    #: ``(host, port)`` pairs in the order given; ``port`` is ``None`` where omitted.
    hosts: tuple[tuple[str, int | None], ...]
    username: str | None = None
    #: What follows the hosts, without the leading ``/`` (a Valkey db number, a bucket path).
    path: str = ""
    query: Mapping[str, str] = field(default_factory=dict)
    #: The URL as given, safe to log (it holds no password).
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> RemoteURL:
        """Parse ``text``; :class:`~lmcache_platform.remote.RemoteConfigError` names what is wrong."""
        scheme, sep, rest = text.partition("://")
        scheme = scheme.lower()
        if not sep or not SCHEME_RE.match(scheme):
            raise RemoteConfigError(f"remote URL {text!r}: {_expected(text)}")
        netloc, slash, tail = rest.partition("/")
        path, _, query_text = tail.partition("?")
        if not slash and "?" in netloc:
            netloc, _, query_text = netloc.partition("?")
        username = None
        if "@" in netloc:
            userinfo, _, netloc = netloc.rpartition("@")
            if ":" in userinfo:
                raise RemoteConfigError(
                    f"remote URL for {scheme}://{netloc}: a password in the URL would show on command "
                    "lines and in process listings; pass it in an environment variable or a file "
                    "(--remote-password-env, --remote-password-file)"
                )
            username = userinfo or None
        hosts = tuple(_host(h, text) for h in netloc.split(",")) if netloc else ()
        try:
            pairs = parse_qsl(query_text, keep_blank_values=True, strict_parsing=bool(query_text))
        except ValueError as exc:
            raise RemoteConfigError(f"remote URL {text!r}: bad query: {exc}") from None
        query = dict(pairs)
        if len(query) != len(pairs):
            raise RemoteConfigError(f"remote URL {text!r}: a query parameter appears twice")
        return cls(scheme, hosts, username, path, query, text)


def _expected(text: str) -> str:
    """What a URL without ``scheme://`` should have been: a directory's URL for a path."""
    path = text[len("file:") :] if text.lower().startswith("file:") else text
    if path.startswith("/"):
        return f"a directory is file:///{path.lstrip('/')} (three slashes, then the absolute path)"
    return "expected scheme://host:port[/path] (valkey://host:6379) or file:///absolute/dir"


def _host(item: str, text: str) -> tuple[str, int | None]:
    if item.startswith("["):  # [ipv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else rest
    else:
        host, _, port_text = item.partition(":")
    if not host or (port_text and not port_text.isdigit()):
        raise RemoteConfigError(f"remote URL {text!r}: bad host {item!r} (expected host or host:port)")
    port = int(port_text) if port_text else None
    if port is not None and not 0 < port < 65536:
        raise RemoteConfigError(f"remote URL {text!r}: port {port} out of range")
    return host, port


@dataclass(frozen=True)
class RemoteOptions:
    """Settings a store needs beyond its URL; the secrets never travel on a command line.

    ``password_env`` names an environment variable holding the password, ``password_file``
    a file holding it (one trailing newline is dropped); read them with :meth:`password`.
    TLS: ``tls_ca_file`` (certificates to trust; default: the system's), ``tls_cert_file``
    and ``tls_key_file`` (a client certificate, for mutual TLS). ``settings`` holds
    store-specific ``key=value`` knobs, documented by each store; a store refuses a key
    it does not know.
    """

    connect_timeout_s: float = 2.0
    password_env: str | None = None
    password_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    settings: Mapping[str, str] = field(default_factory=dict)

    def password(self) -> str | None:
        """The password from ``password_env`` or ``password_file``; ``None`` when neither is set."""
        if self.password_env and self.password_file:
            raise RemoteConfigError("give the remote password in an environment variable or a file, not both")
        if self.password_env:
            value = os.environ.get(self.password_env)
            if not value:
                raise RemoteConfigError(
                    f"the remote password variable {self.password_env} is not set or is empty"
                )
            return value
        if self.password_file:
            return read_secret_file(self.password_file, "remote password").decode()
        return None


def read_secret_file(path: str, what: str) -> bytes:
    """The bytes of a secret file without one trailing newline; refuses anything but a regular file.

    A file other users can read is used, with one WARNING: secrets mounted by an
    orchestrator are often mode 0644 inside a private directory.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise RemoteConfigError(f"the {what} file {path} is not a regular file")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise RemoteConfigError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    if stat.S_IMODE(st.st_mode) & 0o004:
        mode = stat.S_IMODE(st.st_mode)
        logger.warning(
            "lmcache-platform: the %s file %s is readable by every user (mode %o)", what, path, mode
        )
    data = data.removesuffix(b"\n").removesuffix(b"\r")
    if not data:
        raise RemoteConfigError(f"the {what} file {path} is empty")
    return data

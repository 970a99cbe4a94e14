"""From a remote URL and options to the valkey client's settings, checked before any connection.

URLs::

    valkey://[user@]host[:port][/db]                 one server (db 0..15, default 0)
    valkeys://[user@]host[:port][/db]                the same over TLS
    valkey+cluster://[user@]h1[:p1],h2[:p2],...      Valkey Cluster: any reachable nodes
    valkeys+cluster://[user@]h1[:p1],...             the same over TLS

The password comes from ``RemoteOptions.password()`` (an environment variable or a file),
never from the URL. Store settings (``RemoteOptions.settings``, ``--remote-option KEY=VALUE``):

* ``socket_timeout`` (seconds, default 5): the longest one socket operation may block
  in the client. Every call has its own, shorter deadline; this only bounds how long a
  call abandoned at its deadline keeps a connection.
* ``max_calls`` (default 32): calls in flight at once (per node in a cluster batch);
  beyond it a call fails at once with ``RemoteTimeout`` rather than queueing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmcache_platform.remote import RemoteConfigError, RemoteOptions, RemoteURL

DEFAULT_PORT = 6379
_SETTINGS = ("socket_timeout", "max_calls")


@dataclass(frozen=True)
class ValkeyConfig:
    """Everything a :class:`~lmcache_platform_valkey.ValkeyStore` needs; ``name`` is safe to log."""

    name: str
    hosts: tuple[tuple[str, int], ...]
    cluster: bool = False
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    connect_timeout_s: float = 2.0
    socket_timeout_s: float = 5.0
    max_calls: int = 32

    @classmethod
    def from_url(cls, url: RemoteURL, options: RemoteOptions) -> ValkeyConfig:
        base, _, mode = url.scheme.partition("+")
        if base not in ("valkey", "valkeys") or mode not in ("", "cluster"):
            raise RemoteConfigError(
                f"{url.text}: the Valkey store serves valkey://, valkeys:// and their +cluster forms"
            )
        if not url.hosts:
            raise RemoteConfigError(f"{url.text}: no host")
        cluster, tls = mode == "cluster", base == "valkeys"
        if not cluster and len(url.hosts) > 1:
            raise RemoteConfigError(
                f"{url.text}: several hosts need valkey+cluster:// (or valkeys+cluster://)"
            )
        if url.query:
            raise RemoteConfigError(
                f"{url.text}: no query parameters; give store settings as options ({', '.join(_SETTINGS)})"
            )
        db = _db(url, cluster)
        if not tls and (options.tls_ca_file or options.tls_cert_file or options.tls_key_file):
            raise RemoteConfigError(
                f"{url.text}: TLS files were given for a plain connection; use valkeys://"
            )
        if bool(options.tls_cert_file) != bool(options.tls_key_file):
            raise RemoteConfigError(
                f"{url.text}: a client certificate needs both its certificate and its key file"
            )
        unknown = sorted(set(options.settings) - set(_SETTINGS))
        if unknown:
            raise RemoteConfigError(
                f"{url.text}: unknown Valkey store settings {unknown} (known: {', '.join(_SETTINGS)})"
            )
        return cls(
            name=url.text,
            hosts=tuple((h, p or DEFAULT_PORT) for h, p in url.hosts),
            cluster=cluster,
            tls=tls,
            db=db,
            username=url.username,
            password=options.password(),
            tls_ca_file=options.tls_ca_file,
            tls_cert_file=options.tls_cert_file,
            tls_key_file=options.tls_key_file,
            connect_timeout_s=options.connect_timeout_s,
            socket_timeout_s=_number(options, "socket_timeout", 5.0, float),
            max_calls=_number(options, "max_calls", 32, int),
        )

    def client_kwargs(self) -> dict[str, Any]:
        """Keywords common to ``valkey.Valkey`` and ``valkey.cluster.ValkeyCluster``."""
        kwargs: dict[str, Any] = {
            "username": self.username,
            "password": self.password,
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_keepalive": True,
            "health_check_interval": 0,
        }
        if self.tls:
            kwargs.update(
                ssl=True,
                ssl_cert_reqs="required",
                ssl_check_hostname=True,
                ssl_ca_certs=self.tls_ca_file,
                ssl_certfile=self.tls_cert_file,
                ssl_keyfile=self.tls_key_file,
            )
        return kwargs


def _db(url: RemoteURL, cluster: bool) -> int:
    path = url.path.strip("/")
    if not path:
        return 0
    if not path.isdigit() or not 0 <= int(path) <= 15:
        raise RemoteConfigError(f"{url.text}: the path is a database number 0..15, got {path!r}")
    if cluster and int(path) != 0:
        raise RemoteConfigError(f"{url.text}: Valkey Cluster has database 0 only")
    return int(path)


def _number(options: RemoteOptions, key: str, default: Any, kind: type) -> Any:
    text = options.settings.get(key)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise RemoteConfigError(f"Valkey store setting {key}={text!r} is not a {kind.__name__}") from None
    if value <= 0:
        raise RemoteConfigError(f"Valkey store setting {key}={text!r} must be positive")
    return value

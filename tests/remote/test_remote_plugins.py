"""The remote-store plugin point: entry points by scheme, lazy loading, isolation, typed errors."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

from lmcache_platform.remote import (
    RemoteConfigError,
    RemoteOptions,
    RemoteStoreLoadError,
    RemoteStoreNotFoundError,
    RemoteURL,
    list_remote_stores,
    open_remote,
)
from lmcache_platform.remote._registry import ENTRY_POINT_GROUP, RemoteRegistry
from lmcache_platform.testing import make_distribution
from support.imports import fresh_run

STORE = """
from lmcache_platform.remote import hookimpl

class MemoryStore:
    def __init__(self, url):
        self.url, self.data = url, {}
    def get_many(self, keys, *, timeout):
        return [self.data.get(k) for k in keys]
    def exists_many(self, keys, *, timeout):
        return [k in self.data for k in keys]
    def put_many(self, items, *, ttl, timeout):
        self.data.update((k, bytes(v)) for k, v in items)
        return [True] * len(items)
    def ping(self, *, timeout):
        pass
    def close(self):
        pass

@hookimpl
def lmcache_remote_api_version():
    return API

@hookimpl
def lmcache_remote_open(url, options):
    return OPEN(url)
"""


def store_module(api: int = 1, open_expr: str = "MemoryStore(url)", extra: str = "") -> str:
    return STORE.replace("API", str(api)).replace("OPEN(url)", open_expr) + textwrap.dedent(extra)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def install(site: Path, dist: str, schemes: dict[str, str], files: dict[str, str]) -> None:
    make_distribution(site, dist, "1.0", entry_points=schemes, files=files, group=ENTRY_POINT_GROUP)


def registry(site: Path) -> RemoteRegistry:
    return RemoteRegistry(search_path=[str(site)])


def test_a_store_opens_by_scheme_and_only_its_module_is_imported(site: Path) -> None:
    install(site, "alpha-store", {"alpha": "alpha_store"}, {"alpha_store.py": store_module()})
    install(
        site, "beta-store", {"beta": "beta_store"}, {"beta_store.py": "raise ImportError('no beta here')"}
    )
    reg = registry(site)
    assert reg.schemes() == ["alpha", "beta"]
    assert "alpha_store" not in sys.modules  # reading metadata imports nothing
    store = reg.open("alpha://h:1/x", RemoteOptions())
    assert store.put_many([(b"k", b"v")], ttl=None, timeout=1) == [True]
    assert store.get_many([b"k", b"z"], timeout=1) == [b"v", None]
    assert "alpha_store" in sys.modules and "beta_store" not in sys.modules


def test_a_failing_store_is_isolated_named_and_logged_once(
    site: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install(site, "alpha-store", {"alpha": "alpha_store2"}, {"alpha_store2.py": store_module()})
    install(
        site, "beta-store", {"beta": "beta_store2"}, {"beta_store2.py": "raise ImportError('no beta here')"}
    )
    reg = registry(site)
    with caplog.at_level(logging.WARNING, logger="lmcache_platform.remote"):
        for _ in range(2):
            with pytest.raises(RemoteStoreLoadError) as info:
                reg.open("beta://h")
    err = info.value
    assert err.backend == "beta" and err.distribution == "beta-store" and err.version == "1.0"
    assert err.entry_point == "beta = beta_store2"
    assert "beta-store 1.0" in str(err) and "no beta here" in str(err) and "ImportError" in str(err)
    assert isinstance(err.__cause__, ImportError) and "Traceback" in (err.traceback or "")
    assert sum("beta" in r.getMessage() for r in caplog.records) == 1
    reg.open("alpha://h").ping(timeout=1)  # the other store is untouched
    infos = {i.scheme: i for i in reg.stores()}
    assert infos["beta"].status == "failed" and "no beta here" in infos["beta"].reason
    assert infos["alpha"].status == "ok"


def test_one_module_serves_several_schemes(site: Path) -> None:
    install(
        site,
        "gamma-store",
        {"gamma": "gamma_store", "gamma+cluster": "gamma_store", "gammas": "gamma_store"},
        {"gamma_store.py": store_module()},
    )
    reg = registry(site)
    for url in ("gamma://a", "gamma+cluster://a:1,b:2", "gammas://a"):
        assert reg.open(url).exists_many([b"x"], timeout=1) == [False]
    assert [i.status for i in reg.stores()] == ["ok", "ok", "ok"]


@pytest.mark.parametrize(
    ("module", "words"),
    [
        (store_module(api=2), "targets remote-store API 2"),
        (
            store_module(extra="def lmcache_remote_bogus():\n    pass\n"),
            "unknown hooks: lmcache_remote_bogus",
        ),
        (store_module(extra="@hookimpl\ndef lmcache_remote_open(url, nonsense):\n    pass\n"), "nonsense"),
        (
            "from lmcache_platform.remote import hookimpl\n@hookimpl\ndef lmcache_remote_api_version():\n"
            "    return 1\n",
            "does not implement lmcache_remote_open",
        ),
        ("import sys\nsys.exit(3)\n", "SystemExit"),
    ],
)
def test_invalid_stores_fail_with_their_reason(site: Path, module: str, words: str) -> None:
    name = f"bad_{abs(hash(module)) % 10**8}"
    install(site, "bad-store", {"bad": name}, {f"{name}.py": module})
    with pytest.raises(RemoteStoreLoadError, match=words) as info:
        registry(site).open("bad://h")
    assert info.value.distribution == "bad-store"


def test_what_open_returns_or_raises_is_checked(site: Path) -> None:
    install(site, "d1", {"notastore": "nas"}, {"nas.py": store_module(open_expr="object()")})
    install(site, "d2", {"config": "cfg"}, {"cfg.py": store_module(open_expr="_bad(url)", extra='''
        from lmcache_platform.remote import RemoteConfigError
        def _bad(url):
            raise RemoteConfigError(f"{url.text}: no such option")
        ''')})  # fmt: skip
    install(site, "d3", {"crash": "crash"}, {"crash.py": store_module(open_expr="1 / 0")})
    reg = registry(site)
    with pytest.raises(RemoteStoreLoadError, match="not an object with the RemoteStore methods"):
        reg.open("notastore://h")
    with pytest.raises(RemoteConfigError, match="no such option"):
        reg.open("config://h")
    with pytest.raises(RemoteStoreLoadError, match=r"d3 1\.0.*ZeroDivisionError") as info:
        reg.open("crash://h")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_unknown_scheme_lists_what_is_installed(site: Path) -> None:
    install(site, "alpha-store", {"alpha": "alpha_store3"}, {"alpha_store3.py": store_module()})
    with pytest.raises(RemoteStoreNotFoundError, match=r"'s3'.*installed: alpha") as info:
        registry(site).open("s3://bucket/path")
    assert info.value.scheme == "s3" and info.value.installed == ("alpha",)


def test_an_unknown_schemes_hint_names_its_first_party_store_or_how_stores_are_found(site: Path) -> None:
    """The hint fits the scheme: no Valkey advert for ``file``, none for a scheme nobody ships."""
    reg = registry(site)  # nothing installed
    with pytest.raises(RemoteStoreNotFoundError) as info:
        reg.open("file:///tmp/kv")
    assert str(info.value) == (
        "no installed remote store serves the URL scheme 'file' (installed: none); install "
        "lmcache-platform-file-store (from a checkout of lmcache-platform: pip install ./backends/file-store)"
    )
    with pytest.raises(RemoteStoreNotFoundError) as info:
        reg.open("valkeys+cluster://h:1")
    assert str(info.value).endswith(
        "install lmcache-platform-valkey (from a checkout of lmcache-platform: pip install ./backends/valkey)"
    )
    with pytest.raises(RemoteStoreNotFoundError) as info:
        reg.open("sqlite:///tmp/x.db")
    assert str(info.value) == (
        "no installed remote store serves the URL scheme 'sqlite' (installed: none); a store is a "
        "distribution advertising its scheme in the lmcache.remote entry-point group (see "
        "docs/remote-stores.md); `lmcache-platform list` shows the installed ones"
    )


def test_bad_and_clashing_entry_point_names_are_reported(site: Path) -> None:
    install(
        site, "one", {"Bad_Scheme": "m1", "dup": "m2"}, {"m1.py": store_module(), "m2.py": store_module()}
    )
    install(site, "two", {"dup": "m3"}, {"m3.py": store_module()})
    reg = registry(site)
    with pytest.raises(RemoteStoreLoadError, match=r"invalid backend name 'Bad_Scheme'.*URL scheme"):
        reg.store("Bad_Scheme")
    with pytest.raises(RemoteStoreLoadError, match="several distributions"):
        reg.open("dup://h")


def test_the_installed_valkey_store_is_found_through_metadata() -> None:
    schemes = {i.scheme: i for i in list_remote_stores()}
    for scheme in ("valkey", "valkeys", "valkey+cluster", "valkeys+cluster"):
        assert schemes[scheme].distribution == "lmcache-platform-valkey"
        assert schemes[scheme].entry_point == f"{scheme} = lmcache_platform_valkey._plugin"


def test_importing_the_plugin_point_imports_no_store_and_no_client() -> None:
    modules = fresh_run("import lmcache_platform.remote as r; r.list_remote_stores()").modules
    assert sorted(m for m in modules if m.startswith(("valkey", "lmcache_platform_valkey", "torch"))) == []


# -- URLs and options ---------------------------------------------------------------------


def test_urls_parse_and_refuse_passwords() -> None:
    url = RemoteURL.parse("valkey+cluster://ops@h1:7000,[::1]:7001,h3/0")
    assert url.scheme == "valkey+cluster" and url.username == "ops" and url.path == "0"
    assert url.hosts == (("h1", 7000), ("::1", 7001), ("h3", None))
    assert RemoteURL.parse("s3://bucket/a/b?region=x").query == {"region": "x"}
    # Path-style: no host, the path after the third slash (without its leading slash).
    path_style = RemoteURL.parse("sqlite:///tmp/x.db?mode=wal")
    assert (path_style.hosts, path_style.path, path_style.query) == ((), "tmp/x.db", {"mode": "wal"})
    with pytest.raises(RemoteConfigError, match="password in the URL") as info:
        open_remote("valkey://user:hunter2@h:6379/0")
    assert "hunter2" not in str(info.value)
    for bad in ("valkey:/h", "Valkey_X://h", "valkey://h:port", "valkey://h:70000", "x://h/?a=1&a=2"):
        with pytest.raises(RemoteConfigError):
            RemoteURL.parse(bad)


def test_passwords_come_from_a_variable_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCP_TEST_PW", "s3cret")
    assert RemoteOptions(password_env="LMCP_TEST_PW").password() == "s3cret"
    path = tmp_path / "pw"
    path.write_text("from-file\n")
    path.chmod(0o600)
    assert RemoteOptions(password_file=str(path)).password() == "from-file"
    assert RemoteOptions().password() is None
    with pytest.raises(RemoteConfigError, match="LMCP_TEST_UNSET is not set"):
        RemoteOptions(password_env="LMCP_TEST_UNSET").password()
    with pytest.raises(RemoteConfigError, match="not both"):
        RemoteOptions(password_env="LMCP_TEST_PW", password_file=str(path)).password()
    with pytest.raises(RemoteConfigError, match="cannot read"):
        RemoteOptions(password_file=str(tmp_path / "missing")).password()
    with pytest.raises(RemoteConfigError, match="not a regular file"):
        RemoteOptions(password_file=str(tmp_path)).password()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RemoteConfigError, match="is empty"):
        RemoteOptions(password_file=str(tmp_path / "empty")).password()

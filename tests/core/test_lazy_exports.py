"""``lazy_exports``: a backend package's public names, imported from their modules on first access."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import lmcache_platform
import lmcache_platform_cpu
import lmcache_platform_cpu_file
import lmcache_platform_cuda
from lmcache_platform import lazy_exports

PACKAGE = "lazy_exports_pkg"


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package whose ``__init__`` exports ``Thing`` and ``other`` from two modules, lazily."""
    root = tmp_path / PACKAGE
    root.mkdir()
    (root / "__init__.py").write_text(
        "from lmcache_platform import lazy_exports\n"
        "__getattr__ = lazy_exports(__name__, {'._things': ['Thing'], '._other': ['other']})\n"
    )
    (root / "_things.py").write_text("class Thing:\n    pass\n")
    (root / "_other.py").write_text("other = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PACKAGE
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


def test_a_name_is_imported_from_its_module_on_first_access(package: str) -> None:
    pkg = __import__(package)
    assert f"{package}._things" not in sys.modules
    assert pkg.Thing is sys.modules[f"{package}._things"].Thing
    assert f"{package}._other" not in sys.modules  # only the module asked for
    assert pkg.other == 42


def test_any_other_name_is_a_missing_attribute(package: str) -> None:
    pkg = __import__(package)
    with pytest.raises(AttributeError, match=rf"^module '{package}' has no attribute 'nothing'$"):
        pkg.nothing  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'nothing'"):
        exec(f"from {package} import nothing", {})


def test_the_getter_reads_each_home_module_by_name() -> None:
    getter = lazy_exports("lmcache_platform", {"._units": ["format_bytes"], "._env": ["env_choice"]})
    assert getter("format_bytes") is lmcache_platform.format_bytes
    assert getter("env_choice") is lmcache_platform.env_choice
    with pytest.raises(AttributeError, match="module 'lmcache_platform' has no attribute 'parse_bytes'"):
        getter("parse_bytes")  # defined in ._units, but not listed


@pytest.mark.parametrize("backend", [lmcache_platform_cpu, lmcache_platform_cpu_file, lmcache_platform_cuda])
def test_the_bundled_backends_export_every_public_name_lazily(backend: object) -> None:
    for name in backend.__all__:  # type: ignore[attr-defined]
        assert getattr(backend, name) is not None, name

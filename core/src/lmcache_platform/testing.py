"""Test kit for backend authors and for this project: a pytest plugin (``pytest11``).

Fixtures isolate the process-wide registry per test and install fake backends
through the same code path real entry points take, so tests need no global-state
hacks. Importing this module is cheap (no torch); it is loaded by every pytest run
in an environment where lmcache-platform is installed.

The conformance suite's option and fixtures are a separate plugin,
``lmcache_platform.conformance.plugin`` (see :mod:`lmcache_platform.conformance`).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from . import _env
from ._plugins.registry import REGISTRY, Registry
from ._types import Availability
from ._version import API_VERSION
from .hookspecs import hookimpl

__all__ = ["RegistryFixture", "fake_backend", "lmcache_registry", "make_distribution"]


def fake_backend(
    device_type: str,
    *,
    context_class: type | None = None,
    wrapper_class: type | None = None,
    wire_classes: list[type] | None = None,
    probe: Availability | Callable[[], Availability] | None = None,
    api_version: int = API_VERSION,
    event_class: type | None = None,
) -> types.SimpleNamespace:
    """Build a plugin object implementing the hooks for ``device_type`` with fixed answers.

    ``event_class`` adds the optional ``lmcache_platform_device_event_class`` hook.
    """

    @hookimpl
    def lmcache_platform_api_version() -> int:
        return api_version

    @hookimpl
    def lmcache_platform_cache_context_class(device_type: str) -> type | None:
        return context_class if device_type == served else None

    @hookimpl
    def lmcache_platform_ipc_wrapper_class(device_type: str) -> type | None:
        return wrapper_class if device_type == served else None

    @hookimpl
    def lmcache_platform_wire_classes(device_type: str) -> list[type] | None:
        return wire_classes if device_type == served else None

    @hookimpl
    def lmcache_platform_probe(device_type: str) -> Availability | None:
        return probe() if callable(probe) else probe

    @hookimpl
    def lmcache_platform_device_event_class(device_type: str) -> type | None:
        return event_class if device_type == served else None

    served = device_type
    hooks = [
        lmcache_platform_api_version,
        lmcache_platform_cache_context_class,
        lmcache_platform_ipc_wrapper_class,
        lmcache_platform_wire_classes,
        lmcache_platform_probe,
    ]
    if event_class is not None:
        hooks.append(lmcache_platform_device_event_class)
    return types.SimpleNamespace(**{f.__name__: f for f in hooks})


def make_distribution(
    site_dir: Path,
    name: str,
    version: str,
    *,
    entry_points: Mapping[str, str],
    files: Mapping[str, str] = {},
    group: str = "lmcache.platform",
) -> Path:
    """Write an installed distribution (``*.dist-info`` plus modules) into ``site_dir``.

    Put ``site_dir`` on ``sys.path`` and it is found by ``importlib_metadata``
    exactly like a pip-installed wheel.
    """
    site_dir.mkdir(parents=True, exist_ok=True)
    info = site_dir / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"[{group}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for rel, text in files.items():
        path = site_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return info


class RegistryFixture:
    """Handle returned by the ``lmcache_registry`` fixture."""

    def __init__(self, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
        self.registry = registry
        self._monkeypatch = monkeypatch
        self.site_dirs: list[Path] = []

    def install(
        self, name: str, plugin: object, *, distribution: str = "fake-backend", version: str = "0.0"
    ) -> None:
        """Add ``plugin`` as if an installed distribution advertised it as ``name``."""
        self.registry.install(name, plugin, distribution=distribution, version=version)

    def add_site_dir(self, site_dir: Path) -> None:
        """Read backends from ``site_dir`` (only the site dirs added so far) and import from it.

        Earlier dirs win over later ones, like earlier ``sys.path`` entries.
        """
        self._monkeypatch.syspath_prepend(str(site_dir))  # also invalidates import caches
        self.site_dirs.append(site_dir)
        self.registry.clear(scanned=False)
        self.registry.search_path = [str(d) for d in self.site_dirs]

    def rescan(self) -> None:
        """Forget everything and read the real installed metadata (``sys.path``) on next use."""
        self.registry.clear(scanned=False)
        self.registry.search_path = None

    def setenv(self, name: str, value: str) -> None:
        """Set an environment variable for this test, then re-resolve with it."""
        self._monkeypatch.setenv(name, value)


@pytest.fixture
def lmcache_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[RegistryFixture]:
    """An empty, hermetic registry for one test; the previous state comes back afterwards.

    Installed entry points are not read unless the test calls ``rescan()`` or
    ``add_site_dir()``; backend-selection environment variables are cleared.
    """
    for var in (_env.BACKEND_ENV, _env.DISABLE_ENV, _env.AUTOLOAD_ENV):
        monkeypatch.delenv(var, raising=False)
    state = REGISTRY.snapshot_all()
    REGISTRY.clear(scanned=True)
    handle = RegistryFixture(REGISTRY, monkeypatch)
    try:
        yield handle
    finally:
        REGISTRY.restore_all(state)
        # Unload modules imported from the test's site dirs, so the next test imports afresh.
        roots = tuple(str(d) for d in handle.site_dirs)
        for name, module in list(sys.modules.items()):
            if roots and str(getattr(module, "__file__", None) or "").startswith(roots):
                del sys.modules[name]


def pytest_report_header(config: Any) -> str:
    return f"lmcache-platform: backend API {API_VERSION}"

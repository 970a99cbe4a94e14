"""Real wheels in real virtual environments, for packaging tests.

A fresh venv is made with ``--system-site-packages`` plus a ``.pth`` file naming this
interpreter's site-packages, so it reuses the torch (and the editable projects) of the
test environment instead of downloading anything. Wheels are built without isolation
and installed with ``--no-deps``: everything stays offline.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path


def build_wheel(project: Path, out: Path) -> Path:
    """Build ``project`` (a directory with a pyproject.toml) into a wheel in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(out), str(project)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


def make_venv(path: Path, *, inherit: bool = True) -> Path:
    """Create a venv at ``path``; return its python. ``inherit`` layers it over this env."""
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(path)
    python = path / "bin" / "python"
    if inherit:
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # An "import" line runs site.addsitedir, which also honours the parent's .pth files
        # (editable installs); a bare path line would not.
        parent = sysconfig.get_path("purelib")
        (Path(site) / "_inherit_test_env.pth").write_text(
            f"import site; site.addsitedir({parent!r})\n"
        )
    return python


def pip_install(python: Path, *wheels: Path) -> None:
    """Install wheels into the venv of ``python`` (pip from this env, targeting that one)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--disable-pip-version-check", "-q", *map(str, wheels)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def write_backend_project(root: Path, *, dist: str, package: str, backend: str,
                          device: str) -> Path:  # fmt: skip
    """A minimal third-party backend project, as a vendor would write one."""
    (root / "src" / package).mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "2.5.0"
        dependencies = ["lmcache-platform"]

        [project.entry-points."lmcache.platform"]
        "{backend}" = "{package}.plugin"
    """))
    (root / "src" / package / "__init__.py").write_text("")
    (root / "src" / package / "plugin.py").write_text(textwrap.dedent(f"""
        from lmcache_platform import API_VERSION, Availability, BaseCacheContext, hookimpl
        from lmcache_platform import DeviceIPCWrapper

        class Wrapper(DeviceIPCWrapper):
            device_type = "{device}"
            wire_tag = "{backend}/1"

            @classmethod
            def wrap(cls, tensor):
                raise NotImplementedError

            def to_tensor(self):
                raise NotImplementedError

        class Context(BaseCacheContext):
            device_type = "{device}"

        @hookimpl
        def lmcache_platform_api_version():
            return API_VERSION

        @hookimpl
        def lmcache_platform_cache_context_class(device_type):
            return Context

        @hookimpl
        def lmcache_platform_ipc_wrapper_class(device_type):
            return Wrapper

        @hookimpl
        def lmcache_platform_probe(device_type):
            return Availability.yes()
    """))
    return root

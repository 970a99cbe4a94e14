"""Real wheels in real virtual environments, for packaging tests.

A fresh venv is made with ``--system-site-packages`` plus a ``.pth`` file naming this
interpreter's site-packages, so it reuses the torch (and the editable projects) of the
test environment instead of downloading anything (``hide_project=True`` leaves this
repository's editable installs out, for venvs that get wheels of them instead). Wheels
are built without isolation and installed with ``--no-deps``: everything stays offline.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
import textwrap
import venv
from collections.abc import Sequence
from pathlib import Path

from support.plugins import REQUIRED_HOOKS


def build_wheel(project: Path, out: Path) -> Path:
    """Build ``project`` (a directory with a pyproject.toml) into a wheel in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(project),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


#: Distributions of this repository: hidden from a venv made with ``hide_project=True``.
PROJECT_DIST_PREFIX = "lmcache-platform"


def make_venv(
    path: Path, *, inherit: bool = True, hide_project: bool = False, hide: Sequence[str] = ()
) -> Path:
    """Create a venv at ``path``; return its python. ``inherit`` layers it over this env.

    With ``hide_project`` the venv sees this env's site-packages through a directory of
    symlinks that leaves out this repository's distributions (their dist-info, their
    ``__editable__`` path files and anything else their RECORD installed at top level),
    so wheels of them installed into the venv are the only copies it can import, while
    torch, numpy, pluggy, msgpack, pytest... stay visible. ``hide`` leaves out those
    distributions too (``numpy``: a venv without it), and then the interpreter's own
    site-packages, which may hold them, are not seen either.
    """
    venv.EnvBuilder(system_site_packages=not hide, with_pip=False).create(path)
    python = path / "bin" / "python"
    if inherit:
        parent = Path(sysconfig.get_path("purelib"))
        if hide_project or hide:
            parent = _site_without(parent, path / "parent-site", project=hide_project, dists=hide)
        add_site(python, parent, "_inherit_test_env")
    return python


def add_site(python: Path, site_dir: Path, name: str) -> None:
    """Make the venv of ``python`` import from ``site_dir`` too, through ``<name>.pth``.

    An "import" line runs ``site.addsitedir``, which also honours ``site_dir``'s own
    ``.pth`` files (editable installs); a bare path line would not.
    """
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / f"{name}.pth").write_text(f"import site; site.addsitedir({str(site_dir)!r})\n")


def _site_without(site: Path, mirror: Path, *, project: bool, dists: Sequence[str]) -> Path:
    """``mirror``: symlinks to every top-level entry of ``site`` but this project's (``project``)
    and those of the distributions ``dists``."""
    hidden: set[str] = set()
    others = {re.sub(r"[-_.]+", "-", d).lower() for d in dists}
    for dist in importlib.metadata.distributions(path=[str(site)]):
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if (project and name.startswith(PROJECT_DIST_PREFIX)) or name in others:
            hidden.update(Path(str(f)).parts[0] for f in dist.files or ())
    # packages and dist-info dirs without a RECORD
    ours = ("__editable__", PROJECT_DIST_PREFIX.replace("-", "_")) if project else ()
    mirror.mkdir(parents=True)
    for entry in site.iterdir():
        name = entry.name
        if name in hidden or name.startswith(ours) or name == "__pycache__":
            continue
        (mirror / entry.name).symlink_to(entry)
    return mirror


def pip_install(python: Path, *wheels: Path) -> None:
    """Install wheels into the venv of ``python`` (pip from this env, targeting that one)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            *map(str, wheels),
        ],
        check=True,
        capture_output=True,
        text=True,
    )


def write_backend_project(root: Path, *, dist: str, package: str, backend: str, device: str) -> Path:
    """A minimal third-party backend project, as a vendor would write one."""
    (root / "src" / package).mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "2.5.0"
        dependencies = ["lmcache-platform"]

        [project.entry-points."lmcache.platform"]
        "{backend}" = "{package}.plugin"
    """)
    )
    (root / "src" / package / "__init__.py").write_text("")
    (root / "src" / package / "plugin.py").write_text(
        textwrap.dedent(f"""
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
    """)
        + REQUIRED_HOOKS
        + "\n@hookimpl\ndef lmcache_platform_probe(device_type):\n    return Availability.yes()\n"
    )
    return root

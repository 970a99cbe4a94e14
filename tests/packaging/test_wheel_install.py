"""A throwaway backend, built as a real wheel and pip-installed into a fresh venv."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from support.venvs import build_wheel, make_venv, pip_install, write_backend_project

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    project = write_backend_project(
        root / "src", dist="acme-lmcache-xpu", package="acme_lmcache_xpu", backend="xpu", device="xpu"
    )
    wheel = build_wheel(project, root / "dist")
    python = make_venv(root / "venv")
    pip_install(python, wheel)
    return python


def run(python: Path, code: str, **env: str) -> str:
    import os

    return subprocess.run(
        [str(python), "-c", code], check=True, capture_output=True, text=True, env={**os.environ, **env}
    ).stdout


def test_installed_wheel_is_discovered_in_a_subprocess(env: Path) -> None:
    out = run(
        env,
        "import sys, lmcache_platform as lp\n"
        "f = lp.get_kv_wrapper_factory('xpu')\n"
        "print(f.__self__.__module__, 'torch' in sys.modules)\n"
        "print(lp.selected_backend('xpu'))",
    )
    first, second = out.splitlines()
    assert first == "acme_lmcache_xpu.plugin False"
    assert "distribution='acme-lmcache-xpu'" in second and "version='2.5.0'" in second


def test_list_shows_the_installed_wheel(env: Path) -> None:
    report = json.loads(run(env, "from lmcache_platform._cli import main; main(['list', '--json'])"))
    (xpu,) = [b for b in report["backends"] if b["name"] == "xpu"]
    assert xpu["distribution"] == "acme-lmcache-xpu" and xpu["status"] == "ok" and xpu["selected"]
    assert xpu["entry_point"] == "xpu = acme_lmcache_xpu.plugin"


def test_the_wheel_is_invisible_outside_its_venv() -> None:
    import lmcache_platform as lp

    names = [b.name for b in lp.list_backends(load=False)]
    assert "xpu" not in names


def test_disable_in_the_installed_env(env: Path) -> None:
    out = run(
        env,
        "import lmcache_platform as lp\n"
        "try:\n    lp.get_kv_wrapper_factory('xpu')\n"
        "except lp.BackendUnavailableError as e:\n    print(e.reasons)",
        LMCACHE_PLATFORM_DISABLE="xpu",
    )
    assert "disabled by LMCACHE_PLATFORM_DISABLE" in out

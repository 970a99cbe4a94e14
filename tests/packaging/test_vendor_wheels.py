"""A user's view: wheels of core, ``cpu`` and ``cpu.file`` in a fresh venv, nothing editable.

The venv sees this env's third-party packages (torch, pluggy, msgpack, pytest) but
none of this repository's editable installs, so everything lmcache comes from the
three wheels: ``cpu`` staying the default next to its variant ``cpu.file``, the choice of
``cpu.file``, and the demo on it all run against what a user would ``pip install``.
(``test_author_guide.py`` runs the conformance suite on ``cpu.file`` the way the guide
says, from a clone.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support.venvs import build_wheel, make_venv, pip_install

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vendor")
    wheels = [
        build_wheel(ROOT / project, root / "dist") for project in ("core", "plugins-cpu", "backends/cpu-file")
    ]
    python = make_venv(root / "venv", hide_project=True)
    pip_install(python, *wheels)
    return python.parent


def run(
    venv_bin: Path, *args: str, cwd: Path, check: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_PLATFORM_", "PYTHONPATH"))}
    return subprocess.run(
        [str(venv_bin / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd=cwd,
        check=check,
    )


def test_only_the_wheels_are_importable(venv_bin: Path, tmp_path: Path) -> None:
    code = (
        "import importlib.util as u, lmcache_platform, lmcache_platform_cpu, lmcache_platform_cpu_file\n"
        "for m in (lmcache_platform, lmcache_platform_cpu, lmcache_platform_cpu_file):\n"
        "    print(m.__file__)\n"
        "print(u.find_spec('lmcache_platform_cuda'))\n"
    )
    lines = run(venv_bin, "python", "-c", code, cwd=tmp_path).stdout.splitlines()
    venv = str(venv_bin.parent)
    assert all(line.startswith(venv) for line in lines[:3]), lines
    assert lines[3] == "None", "the editable cuda plugin of the repo leaked into the venv"


def test_installing_a_variant_keeps_the_primary_until_the_variant_is_chosen(
    venv_bin: Path, tmp_path: Path
) -> None:
    kv = str(tmp_path / "kv")
    proc = run(
        venv_bin, "lmcache-platform", "-v", "list", "--json", cwd=tmp_path, LMCACHE_PLATFORM_CPU_FILE_DIR=kv
    )
    cpu = json.loads(proc.stdout)["device_types"]["cpu"]
    assert (cpu["selected"], cpu["selected_by"], cpu["ambiguous"]) == ("cpu", "primary", False)
    assert "to use cpu.file instead, set LMCACHE_PLATFORM_BACKEND=cpu.file" in cpu["why"]
    assert (
        "INFO lmcache_platform.plugins: lmcache-platform: device type 'cpu' uses backend 'cpu'" in proc.stderr
    )
    by_name = {b["name"]: b for b in json.loads(proc.stdout)["backends"]}
    assert by_name["cpu.file"]["status"] == "ok" and not by_name["cpu.file"]["selected"]
    assert by_name["cpu.file"]["distribution"] == "lmcache-platform-cpu-file"
    assert by_name["cpu.file"]["entry_point"] == "cpu.file = lmcache_platform_cpu_file._plugin"

    chosen = json.loads(
        run(
            venv_bin,
            "lmcache-platform",
            "list",
            "--json",
            cwd=tmp_path,
            LMCACHE_PLATFORM_CPU_FILE_DIR=kv,
            LMCACHE_PLATFORM_BACKEND="cpu.file",
        ).stdout
    )
    assert chosen["device_types"]["cpu"]["selected"] == "cpu.file"
    assert chosen["device_types"]["cpu"]["selected_by"] == "explicit"


def test_the_demo_runs_on_cpu_file(venv_bin: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    proc = run(
        venv_bin,
        "lmcache-platform",
        "demo",
        "--layers",
        "2",
        "--kv-heads",
        "2",
        "--head-size",
        "64",
        "--chunk-tokens",
        "64",
        "--chunks",
        "2",
        "--json",
        cwd=tmp_path,
        check=False,
        LMCACHE_PLATFORM_CPU_FILE_DIR=str(kv),
        LMCACHE_PLATFORM_BACKEND="cpu.file",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["verify"]["mismatched_bytes"] == 0
    for side in ("backend", "server_backend"):
        assert report[side]["name"] == "cpu.file"
        assert report[side]["distribution"] == "lmcache-platform-cpu-file"
    assert os.listdir(kv) == []

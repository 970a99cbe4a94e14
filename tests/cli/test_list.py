"""`lmcache-platform list` and the CLI dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmcache_platform import Availability
from lmcache_platform._cli import main
from lmcache_platform.testing import fake_backend
from support.fakes import backend
from support.imports import fresh_run


@pytest.fixture
def installed(lmcache_registry):
    lmcache_registry.install("cpu", backend("cpu"), distribution="lmcache-platform-cpu", version="0.1.0")
    lmcache_registry.install(
        "cuda",
        backend("cuda", probe=Availability.no("no CUDA device visible")),
        distribution="lmcache-platform-cuda",
        version="0.1.0",
    )
    lmcache_registry.install("xpu", fake_backend("xpu", api_version=0), distribution="acme-xpu")
    lmcache_registry.setenv("LMCACHE_PLATFORM_DISABLE", "npu")
    lmcache_registry.install("npu", backend("npu"), distribution="acme-npu")
    return lmcache_registry


def run_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["list", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_json_report_shape_and_statuses(installed, capsys):
    code, report = run_json(capsys)
    assert code == 0
    assert report["schema"] == 1 and report["api_version"] == 1
    by = {b["name"]: b for b in report["backends"]}
    assert [b["name"] for b in report["backends"]] == ["cpu", "cuda", "npu", "xpu"]
    assert set(by["cpu"]) == {
        "name",
        "device_type",
        "distribution",
        "version",
        "entry_point",
        "status",
        "reason",
        "selected",
    }
    assert (by["cpu"]["status"], by["cpu"]["selected"]) == ("ok", True)
    assert (by["cuda"]["status"], by["cuda"]["reason"]) == ("unavailable", "no CUDA device visible")
    assert by["npu"]["status"] == "disabled"
    assert by["xpu"]["status"] == "failed" and "targets backend API 0" in by["xpu"]["reason"]
    assert report["device_types"]["cpu"] == {
        "selected": "cpu",
        "error": None,
        "ambiguous": False,
        "selected_by": "primary",
        "why": "the primary backend",
        "explicit": [],
    }
    assert "no CUDA device visible" in report["device_types"]["cuda"]["error"]


def test_check_fails_on_a_failed_backend(installed, capsys):
    code, _ = run_json(capsys, "--check")
    assert code == 1


def test_check_passes_when_only_unavailable(lmcache_registry, capsys):
    lmcache_registry.install("cpu", backend("cpu"))
    lmcache_registry.install("cuda", backend("cuda", probe=Availability.no("no GPU")))
    assert main(["list", "--check"]) == 0
    out = capsys.readouterr().out
    assert "cpu *" in out and "no GPU" in out


def test_check_fails_when_ambiguous(lmcache_registry, capsys):
    lmcache_registry.install("cpu.fast", backend("cpu"))  # two variants, no primary: equals
    lmcache_registry.install("cpu.file", backend("cpu"))
    code, report = run_json(capsys, "--check")
    assert code == 1 and report["device_types"]["cpu"]["ambiguous"]


def test_no_load_imports_nothing(installed, capsys):
    code, report = run_json(capsys, "--no-load")
    assert code == 0
    assert {b["status"] for b in report["backends"]} == {"not loaded", "disabled"}
    assert dict(installed.registry.plugins()) == {}


def test_help_lists_commands_without_importing_torch():
    run = fresh_run(
        "from lmcache_platform._cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    )
    assert "torch" not in run.modules
    for command in ("list", "demo", "doctor", "gc", "check", "bench", "serve", "status", "tiny-model"):
        assert command in run.stdout
    # The opening says where to start: the server, its counters, the vLLM page.
    assert "lmcache-platform serve --socket PATH" in run.stdout and "docs/vllm.md" in run.stdout


def test_an_unusable_explicit_choice_is_reported_as_that_choice(lmcache_registry, capsys):
    lmcache_registry.install("cpu", backend("cpu"), distribution="lmcache-platform-cpu")
    hugetlb = backend("cpu", probe=Availability.no("vm.nr_hugepages is 0"))
    lmcache_registry.install("cpu.hugetlb", hugetlb, distribution="acme-hugetlb")
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "cpu: cpu (the primary backend; cpu.hugetlb is unavailable)" in lines  # not offered

    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.hugetlb")
    code, report = run_json(capsys)
    entry = report["device_types"]["cpu"]
    assert code == 0 and (entry["selected"], entry["explicit"]) == (None, ["cpu.hugetlb"])
    assert entry["error"].startswith(
        "LMCACHE_PLATFORM_BACKEND chooses 'cpu.hugetlb' for device type 'cpu', but it cannot serve: "
        "'cpu.hugetlb' is registered but unavailable here: vm.nr_hugepages is 0."
    )


def test_python_dash_m_runs_the_command_line():
    """``python -m lmcache_platform``, as ``python -m pip``: same parser, same commands."""
    version = subprocess.run(
        [sys.executable, "-m", "lmcache_platform", "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.startswith("lmcache-platform ") and "backend API" in version.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "lmcache_platform", "list", "--json", "--no-load"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(listing.stdout)
    assert report["schema"] == 1 and "cpu" in {b["name"] for b in report["backends"]}
    wrong = subprocess.run(
        [sys.executable, "-m", "lmcache_platform", "no-such-command"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert wrong.returncode == 2 and "invalid choice: 'no-such-command'" in wrong.stderr


def test_the_table_lists_the_installed_remote_stores() -> None:
    """In a real process, from installed metadata: the first-party stores of this checkout."""
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_platform", "list"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("REMOTE STORE")))
    rows = {line.split()[0]: line.split()[1:] for line in lines[head + 1 :]}
    assert rows["file://"][0] == "lmcache-platform-file-store" and rows["file://"][2] == "ok"
    assert rows["valkey+cluster://"][0] == "lmcache-platform-valkey"


def test_tiny_model_without_tokenizers_says_where_to_run_it(tmp_path) -> None:
    """This venv has no ``tokenizers`` (vLLM's venv has): one line, exit status 2."""
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_platform", "tiny-model", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "lmcache-platform tiny-model: needs the tokenizers package, which comes with vLLM: "
        "run this command from the venv that has vLLM\n"
    )

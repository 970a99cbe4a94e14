"""``scripts/gpu-check`` without a GPU: it says so and stops; its summary reads each step right.

The summary (``lmcache_platform_cuda._gpucheck``) is fed what the steps leave behind:
real junit reports written by pytest in a subprocess, logs, formatted reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_platform_cuda._gpucheck import Junit, main, parse_steps, read_junit, summary

ROOT = Path(__file__).resolve().parents[2]
CASES = """
import pytest

def test_a(): pass
def test_b(): assert 1 == 2
@pytest.mark.skip(reason="no")
def test_c(): pass
"""


@pytest.fixture(scope="module")
def junit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real pytest run's report: one pass, one failure, one skip."""
    d = tmp_path_factory.mktemp("junit")
    (d / "test_cases.py").write_text(CASES)
    xml = d / "gpu-tests.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(d)],
        capture_output=True,
        timeout=120,
        cwd=d,
    )
    return xml


def test_a_junit_report_is_counted_and_its_failures_named(junit: Path, tmp_path: Path) -> None:
    counts = read_junit(junit)
    assert isinstance(counts, Junit)
    assert (counts.passed, counts.failed, counts.error, counts.skipped) == (1, 1, 0, 1)
    assert counts.bad == ["test_cases::test_b"]
    (tmp_path / "gpu-tests.xml").write_bytes(junit.read_bytes())
    text, rc = summary(tmp_path, 42, 300, "final", [("gpu-tests", "1")])
    assert rc == 1 and "gpu-tests: 1 passed, 1 failed, 0 error, 1 skipped" in text
    assert "  FAILED test_cases::test_b" in text and "result: FAIL" in text


def test_a_pytest_step_without_its_report_is_not_a_pass(tmp_path: Path) -> None:
    (tmp_path / "serve-vmm.xml").write_text("")  # created by the script, never rewritten
    text, rc = summary(tmp_path, 10, 300, "final", [("serve-vmm", "0")])
    assert rc == 1 and "serve-vmm: no report (rc=0)" in text
    (tmp_path / "serve-vmm.xml").write_text("<testsuites><testsuite")
    text, rc = summary(tmp_path, 10, 300, "final", [("serve-vmm", "0")])
    assert rc == 1 and "unreadable report" in text


def test_reports_and_figures_go_into_the_summary(tmp_path: Path) -> None:
    (tmp_path / "host.txt").write_text("python 3.12, torch 2.11 (CUDA 13.0)\ncuda:0 NVIDIA H200\n")
    (tmp_path / "server-path.report.txt").write_text("Server path on H200\n  fresh put 40.1 GB/s\n")
    (tmp_path / "no-c-compiler.log").write_text(
        "collected 1 item\n\nno C compiler: transfers take the torch path (the triton kernel failed)\n"
        "1 passed in 3.1s\n"
    )
    (tmp_path / "no-c-compiler.xml").write_text(
        '<testsuites><testsuite><testcase classname="k" name="t"/></testsuite></testsuites>'
    )
    steps = [("no-c-compiler", "0"), ("server-path", "0"), ("benchmark", "skip"), ("conformance", "off")]
    text, rc = summary(tmp_path, 200, 300, "final", steps)
    assert "cuda:0 NVIDIA H200" in text
    assert "  Server path on H200" in text and "fresh put 40.1 GB/s" in text
    assert "  no C compiler: transfers take the torch path (the triton kernel failed)" in text
    assert "benchmark: skipped: budget" in text and "conformance: not asked (GPU_CHECK_STEPS)" in text
    assert rc == 1  # a step skipped for want of time is not a pass
    text, rc = summary(tmp_path, 200, 300, "final", steps[:2] + steps[3:])
    assert rc == 0 and "result: PASS" in text


def test_a_step_whose_subject_is_not_installed_is_skipped_not_failed(tmp_path: Path) -> None:
    (tmp_path / "vllm-tier.log").write_text("no vLLM with CUDA and native tiering here\n")
    text, rc = summary(tmp_path, 20, 300, "final", [("vllm-tier", "absent")])
    assert rc == 0 and "vllm-tier: skipped: not installed on this host (see its log)" in text
    text, rc = summary(tmp_path, 20, 300, "final", [("vllm-tier", "1")])
    assert rc == 1 and "vllm-tier: FAILED, rc=1" in text


def test_a_summary_between_steps_says_the_run_is_incomplete(tmp_path: Path) -> None:
    text, rc = summary(tmp_path, 50, 300, "serve-vmm", [("serve-vmm", "0"), ("gpu-tests", "pending")])
    assert rc == 1 and "gpu-tests: not run yet" in text
    assert "result: INCOMPLETE after the serve-vmm step, 50 s of 300 s" in text
    text, _ = summary(tmp_path, 50, 300, "final", [("gpu-tests", "124")])
    assert "timed out (rc=124)" in text


def test_bad_arguments_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="expected STEP=RC, got 'gpu-tests'"):
        parse_steps(["serve-vmm=0", "gpu-tests"])
    assert main(["/tmp"]) == 2 and "STEP=RC" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run on a host without a GPU")
def test_the_script_on_a_host_without_a_gpu_says_so_and_exits_3(tmp_path: Path) -> None:
    venv = Path(sys.executable).parent.parent
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "LMCACHE_VENV": str(venv)}
    out = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 3, out.stderr
    assert "no GPU" in out.stderr and "sees no CUDA device" in out.stderr
    assert (tmp_path / "summary.txt").read_text().startswith("gpu-check summary\nresult: NO GPU")

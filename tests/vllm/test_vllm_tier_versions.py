"""``LMCachePlatformTier`` at class level against vLLM 0.32 (installed), 0.33 and 0.34 (modules only).

The same mechanism as ``test_vllm_versions.py`` (the connector's): ``scripts/bootstrap-vllm``
unpacks the Python modules of 0.33.0 and 0.34.0 (``pip download --no-deps`` of the wheel)
into ``$LMCACHE_VLLM_VENV/vllm-modules/<version>``, and
``tests/vllm/in_vllm_venv/test_tier_fit.py`` runs in the vLLM venv with each first on
``PYTHONPATH``. A release whose modules could not be fetched is skipped with the reason
(a failure under CI).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from support.vllm_engines import ROOT, VENV, under_ci, vllm_python

pytestmark = pytest.mark.vllm

MODULE_RELEASES = ("0.33.0", "0.34.0")
CHECKS = ROOT / "tests" / "vllm" / "in_vllm_venv" / "test_tier_fit.py"


@pytest.mark.parametrize("release", ["installed", *MODULE_RELEASES])
def test_the_tier_fits_the_release(release: str) -> None:
    python = vllm_python()
    env = {**os.environ, "LMCACHE_VLLM_RELEASE": release}
    env.pop("PYTHONPATH", None)
    if release != "installed":
        modules = VENV / "vllm-modules" / release
        if not (modules / ".complete").exists():
            why = modules.with_name(f"{release}.unavailable")
            reason = why.read_text().strip() if why.exists() else "not unpacked: run scripts/bootstrap-vllm"
            if under_ci():
                pytest.fail(f"vLLM {release}'s modules: {reason}")
            pytest.skip(f"vLLM {release}'s modules: {reason}")
        env["PYTHONPATH"] = str(modules)
    args = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(CHECKS)]
    args += ["-W", "ignore::DeprecationWarning:torch.jit._script"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]

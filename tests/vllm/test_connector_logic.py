"""Runs ``in_vllm_venv/test_scheduler_logic.py`` (the connector's identity and scheduler logic)
and ``test_tier_rows.py`` (the native-offloading tier's rows kept in a store) in the vLLM venv.

Those tests import vLLM, which lives in its own virtualenv (``.venv-vllm``), so this
test starts that venv's pytest on them and reports its outcome. They are quick (no
engine starts); the real-engine tests next to this file cover the same paths end to end.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.vllm_engines import ROOT, vllm_python

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.vllm

#: Third-party noise at ``import vllm`` (torch 2.13 deprecates TorchScript, which torch itself uses).
_VLLM_VENV_WARNINGS = ["ignore::DeprecationWarning:torch.jit._script"]


def test_connector_logic_in_the_vllm_venv() -> None:
    python = vllm_python()
    args = [
        str(python),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(HERE / "in_vllm_venv" / "test_scheduler_logic.py"),
        str(HERE / "in_vllm_venv" / "test_tier_rows.py"),
    ]
    for spec in _VLLM_VENV_WARNINGS:
        args += ["-W", spec]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]

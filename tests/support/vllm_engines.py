"""Where the real-vLLM tests find their engine: the vLLM virtualenv, or why there is none.

vLLM pins its own packages, so it lives in a venv apart from ``.venv``:
``$LMCACHE_VLLM_VENV`` (default ``.venv-vllm``, relative to the repository root), made
by ``scripts/bootstrap-vllm``, which ``make test`` runs. The tests start engines with
that venv's Python. When vLLM could not be installed, they skip with the reason the
bootstrap recorded; under CI (``CI=true``) they fail instead, unless
``LMCACHE_VLLM_SPEC=none`` asked for no vLLM.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / os.environ.get("LMCACHE_VLLM_VENV", ".venv-vllm")


def under_ci() -> bool:
    """Whether a CI system runs us (``CI=true``, as CI systems set it)."""
    return os.environ.get("CI", "").lower() in ("true", "1")


def vllm_python() -> Path:
    """The vLLM venv's interpreter; skips the calling test when there is none (fails it under CI)."""
    python = VENV / "bin" / "python"
    unavailable = VENV / ".unavailable"
    if unavailable.exists():
        reason = f"vLLM is not installed in {VENV}: {unavailable.read_text().strip()}"
    elif not python.exists():
        reason = f"no vLLM virtualenv at {VENV}: run scripts/bootstrap-vllm (make test does)"
    else:
        return python
    if under_ci() and os.environ.get("LMCACHE_VLLM_SPEC") != "none":
        pytest.fail(f"{reason} (CI=true: only LMCACHE_VLLM_SPEC=none skips the vLLM tests)")
    pytest.skip(reason)

"""Where the real-vLLM tests find their engine: the vLLM virtualenv, or why there is none.

vLLM pins its own packages, so it lives in ``.venv-vllm`` (made by
``scripts/bootstrap-vllm``, which ``make test`` runs); the tests start engines with
that venv's Python. When it could not be installed, the tests skip with the reason
the bootstrap recorded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("LMCACHE_VLLM_VENV", ROOT / ".venv-vllm"))


def vllm_python() -> Path:
    """The vLLM venv's interpreter; skips the calling test when there is none."""
    python = VENV / "bin" / "python"
    unavailable = VENV / ".unavailable"
    if unavailable.exists():
        pytest.skip(f"vLLM is not installed in {VENV}: {unavailable.read_text().strip()}")
    if not python.exists():
        pytest.skip(f"no vLLM virtualenv at {VENV}: run scripts/bootstrap-vllm (make test does)")
    return python

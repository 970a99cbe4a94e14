"""Tests that import vLLM, so they run in the vLLM venv (``.venv-vllm``).

``tests/vllm/test_connector_logic.py`` and ``tests/vllm/test_vllm_versions.py`` start that
venv's pytest on them and report its outcome; the main venv, which has no vLLM, does not
collect them.
"""

from __future__ import annotations

import importlib.util

_vllm = importlib.util.find_spec("vllm")
# tests/vllm itself is importable as a namespace package ``vllm`` (no origin) where tests/ is on the path.
collect_ignore_glob = [] if _vllm is not None and _vllm.origin is not None else ["test_*.py"]

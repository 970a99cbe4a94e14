"""The marks of a test module that needs a real NVIDIA GPU.

``pytestmark = NEEDS_GPU``: its tests carry the ``cuda`` marker (``-m cuda`` selects
them) and skip cleanly, with the reason, where ``torch`` sees no GPU.
"""

from __future__ import annotations

import pytest
import torch

NEEDS_GPU = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

__all__ = ["NEEDS_GPU"]

"""Availability probe: say *why* CUDA cannot be served, before anything fails later."""

from __future__ import annotations

import os

from lmcache_platform import Availability


def probe() -> Availability:
    """Check torch, its build flavour and the visible devices. Never raises."""
    try:
        import torch
    except ImportError:
        return Availability.no("torch is not installed")
    except Exception as exc:  # a broken install (missing shared library, ABI clash)
        return Availability.no(f"torch failed to import: {type(exc).__name__}: {exc}")
    version = getattr(torch, "version", None)
    hip = getattr(version, "hip", None)
    if hip:
        return Availability.no(
            f"HIP build: install a ROCm backend (torch {torch.__version__} is built for ROCm "
            f"{hip}; CUDA IPC handles do not apply)"
        )
    if getattr(version, "cuda", None) is None:
        return Availability.no(
            f"torch built without CUDA (torch {torch.__version__}); install a CUDA build of torch"
        )
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        detail = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        return Availability.no(f"no CUDA device visible{detail}")
    return Availability.yes()

"""Polling for a condition another thread or process brings about, with a bound.

The bounds are generous ceilings for slow, shared CI machines, never measured times:
speed is for the benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: The default bound of a wait, in seconds.
WAIT_S = 60.0


def until(predicate: Callable[[], object], timeout: float = WAIT_S, *, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds; whether it did within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(interval)
    return True


def wait_until(
    predicate: Callable[[], object], what: str, timeout: float = WAIT_S, *, interval: float = 0.01
) -> float:
    """Poll ``predicate`` until it holds, or fail naming ``what``; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)
    return time.monotonic() - start

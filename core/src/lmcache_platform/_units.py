"""Byte sizes for people: one way to print them, one grammar to read them.

Error messages, ``doctor``, the demo and the benchmarks print sizes; ``serve
--max-host-bytes`` and ``bench --sizes`` read them. Backends are separate
distributions that may use only the public API, so both functions are public.
"""

from __future__ import annotations

import re

#: Binary multiples, largest first; a unit letter means its power of 1024.
_UNITS = (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10))
_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}
_SIZE = re.compile(r"([0-9]+)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE | re.ASCII)


def format_bytes(n: int) -> str:
    """``n`` bytes as a person reads them: ``"512 B"``, ``"4.0 KiB"``, ``"1.5 GiB"``.

    Below 1 KiB the exact count; above, one decimal of the largest binary unit (up to
    TiB) that keeps the figure at least 1. Raises ``TypeError`` for anything but an
    ``int`` and ``ValueError`` for a negative one.
    """
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"format_bytes takes an int number of bytes, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"format_bytes takes a byte count of 0 or more, got {n}")
    for i, (unit, shift) in enumerate(_UNITS):
        if n >= 1 << shift:
            figure = f"{n / (1 << shift):.1f}"
            if figure == "1024.0" and i:  # rounded up into the next unit: say so there
                unit, figure = _UNITS[i - 1][0], "1.0"
            return f"{figure} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """Read a byte size: a whole number, then optionally a binary unit.

    The grammar, case-insensitive, with spaces allowed around the parts: digits, then
    ``K``, ``M``, ``G`` or ``T`` (powers of 1024), each optionally followed by ``B`` or
    ``iB``; or a bare ``B``. So ``"123"``, ``"3B"``, ``"64K"``, ``"64KiB"``, ``"512MB"``,
    ``"8G"`` and ``"2T"``. No fractions and no signs: ``"1.5G"`` is ``"1536M"``. Raises
    ``ValueError`` naming the text for anything else (``TypeError`` for a non-string).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_bytes takes a str, got {type(text).__name__} {text!r}")
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(
            f"not a byte size: {text!r} (expected a whole number with an optional binary unit: "
            "123, 64K, 512MiB, 8G, 2T)"
        )
    return int(m.group(1)) << _SHIFT[(m.group(2) or "").lower()]


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(ms|s|m|h|d)?\s*$")
_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"24h"`` -> seconds: a positive number with ``ms``, ``s`` (default), ``m``, ``h`` or ``d``.

    Raises ``ValueError`` naming the text for anything else.
    """
    match = _DURATION.match(text)
    seconds = float(match.group(1)) * _SECONDS[match.group(2) or "s"] if match else 0.0
    if seconds <= 0:
        raise ValueError(f"not a positive duration: {text!r} (use e.g. 90s, 30m, 24h or 7d)")
    return seconds

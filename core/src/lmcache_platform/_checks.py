"""Checks of untrusted primitives: one vocabulary for wire messages and descriptors.

Every value that comes from another process (a decoded wire message, a wrapper's
descriptor fields) is checked with these before it is used. Each takes ``where``
(what the value is, for the message) and ``error``, the type to raise: the wire
schemas raise :class:`WireFormatError` (the default), descriptor fields
:class:`DescriptorError`. No msgpack and no torch here, so descriptors can use them
without making ``import lmcache_platform`` heavier.
"""

from __future__ import annotations

import re
from collections.abc import Set

from ._errors import LMCachePlatformError, WireFormatError

Error = type[LMCachePlatformError]

_SAFE_REPR = 60


def show(value: object) -> str:
    """A short repr of an untrusted value for error messages."""
    text = repr(value)
    return text if len(text) <= _SAFE_REPR else text[: _SAFE_REPR - 3] + "..."


def expect_map(
    value: object,
    where: str,
    *,
    keys: Set[str],
    optional: Set[str] = frozenset(),
    error: Error = WireFormatError,
) -> dict[str, object]:
    """``value`` must be a map with exactly ``keys`` plus any of ``optional``."""
    if not isinstance(value, dict):
        raise error(f"{where}: expected a map, got {type(value).__name__}")
    got = set(value)
    missing = keys - got
    extra = got - keys - optional
    if missing or extra:
        raise error(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(map(show, extra))}")
    return value


def expect_int(
    value: object,
    where: str,
    *,
    lo: int | None = None,
    hi: int | None = None,
    error: Error = WireFormatError,
) -> int:
    """``value`` must be an ``int`` (``bool`` is not one) within ``[lo, hi]``."""
    if type(value) is not int:
        raise error(f"{where}: expected int, got {type(value).__name__}")
    low, high = lo is not None and value < lo, hi is not None and value > hi
    if low or high:
        span = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        side = f"below the minimum {lo}" if low else f"above the maximum {hi}"
        raise error(f"{where}: {value} is outside {span}: {side}")
    return value


def expect_bool(value: object, where: str, *, error: Error = WireFormatError) -> bool:
    if type(value) is not bool:
        raise error(f"{where}: expected bool, got {type(value).__name__}")
    return value


def _expect_sized(value: object, kind: type, where: str, max_len: int | None, error: Error) -> None:
    if type(value) is not kind:
        raise error(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    assert isinstance(value, (str, bytes))
    if max_len is not None and len(value) > max_len:
        raise error(f"{where}: length {len(value)} exceeds the limit of {max_len}")


def expect_str(
    value: object,
    where: str,
    *,
    max_len: int | None,
    pattern: re.Pattern[str] | None = None,
    error: Error = WireFormatError,
) -> str:
    _expect_sized(value, str, where, max_len, error)
    assert isinstance(value, str)
    if pattern is not None and not pattern.fullmatch(value):
        raise error(f"{where}: {show(value)} does not match {pattern.pattern}")
    return value


def expect_bytes(value: object, where: str, *, max_len: int | None, error: Error = WireFormatError) -> bytes:
    _expect_sized(value, bytes, where, max_len, error)
    assert isinstance(value, bytes)
    return value


def expect_list(
    value: object, where: str, *, max_len: int | None, error: Error = WireFormatError
) -> list[object]:
    if not isinstance(value, list):
        raise error(f"{where}: expected a list, got {type(value).__name__}")
    if max_len is not None and len(value) > max_len:
        raise error(f"{where}: {len(value)} items exceed the limit of {max_len}")
    return value


def expect_int_list(
    value: object,
    where: str,
    *,
    lo: int | None = None,
    hi: int | None = None,
    max_len: int | None,
    error: Error = WireFormatError,
) -> list[int]:
    items = expect_list(value, where, max_len=max_len, error=error)
    return [expect_int(v, f"{where}[{i}]", lo=lo, hi=hi, error=error) for i, v in enumerate(items)]

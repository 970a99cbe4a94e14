"""Bounded, typed msgpack envelopes: the one place untrusted bytes are parsed.

Every message this package puts on a wire is ``MAGIC (4 bytes) + VERSION (1 byte)
+ one msgpack object``. The magic rejects foreign bytes (a pickle, an HTTP request)
before the parser sees them; the version lets the format change without guessing.
The parser is msgpack's C unpacker with every size limit set, no ext types, no
object hooks and UTF-8 strings, so decoding can allocate at most ``Limits.max_bytes``
and can only ever produce ``dict``/``list``/``str``/``bytes``/``int``/``float``/
``bool``/``None``. Callers then check the structure against their schema.

Every failure, whatever msgpack raises, becomes :class:`WireFormatError`.
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass
from typing import NoReturn

import msgpack

from ._errors import WireFormatError

HEADER_LEN = 5
_PICKLE_PROTO = 0x80  # first byte of every pickle of protocol >= 2


@dataclass(frozen=True)
class Limits:
    """Upper bounds for one kind of message; enforced by the unpacker itself."""

    max_bytes: int
    max_array_len: int
    max_map_len: int
    max_str_len: int
    max_bin_len: int


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise WireFormatError(f"msgpack ext type {code} is not allowed")


def pack(magic: bytes, version: int, obj: object, *, max_bytes: int, what: str) -> bytes:
    """Serialize ``obj`` (plain types only) behind the header; refuse oversized results."""
    try:
        body: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireFormatError(f"{what}: cannot encode: {exc}") from exc
    data = magic + bytes([version]) + body
    if len(data) > max_bytes:
        raise WireFormatError(f"{what}: {len(data)} bytes exceed the limit of {max_bytes}")
    return data


def unpack(magic: bytes, version: int, data: object, limits: Limits, *, what: str) -> object:
    """Parse one enveloped message within ``limits``; raise ``WireFormatError`` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"{what}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > limits.max_bytes:
        raise WireFormatError(f"{what}: {len(data)} bytes exceed the limit of {limits.max_bytes}")
    if len(data) < HEADER_LEN or data[:4] != magic:
        looks_pickled = data[:1] == bytes([_PICKLE_PROTO])
        hint = " (it looks like a pickle; pickles are never accepted)" if looks_pickled else ""
        raise WireFormatError(f"{what}: missing the {magic!r} header{hint}")
    if data[4] != version:
        raise WireFormatError(f"{what}: version {data[4]} is not supported (this side speaks {version})")
    body = data[HEADER_LEN:]
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        use_list=True,
        ext_hook=_refuse_ext,
        max_buffer_size=max(limits.max_bytes, 1),
        max_str_len=limits.max_str_len,
        max_bin_len=limits.max_bin_len,
        max_array_len=limits.max_array_len,
        max_map_len=limits.max_map_len,
        max_ext_len=0,
    )
    try:
        unpacker.feed(body)
        obj = unpacker.unpack()
        consumed = unpacker.tell()
    except WireFormatError:
        raise
    except msgpack.OutOfData as exc:
        raise WireFormatError(f"{what}: truncated") from exc
    except Exception as exc:  # msgpack's C parser raises several undocumented types
        raise WireFormatError(f"{what}: malformed msgpack: {exc}") from exc
    if consumed != len(body):
        raise WireFormatError(f"{what}: {len(body) - consumed} trailing bytes after the message")
    return obj


# -- structure checks shared by the schemas ---------------------------------------------

_SAFE_REPR = 60


def show(value: object) -> str:
    """A short repr of an untrusted value for error messages."""
    text = repr(value)
    return text if len(text) <= _SAFE_REPR else text[: _SAFE_REPR - 3] + "..."


def expect_map(
    value: object, where: str, *, keys: Set[str], optional: Set[str] = frozenset()
) -> dict[str, object]:
    """``value`` must be a map with exactly ``keys`` plus any of ``optional``."""
    if not isinstance(value, dict):
        raise WireFormatError(f"{where}: expected a map, got {type(value).__name__}")
    got = set(value)
    missing = keys - got
    extra = got - keys - optional
    if missing or extra:
        raise WireFormatError(
            f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(map(show, extra))}"
        )
    return value


def expect_int(value: object, where: str, *, lo: int, hi: int) -> int:
    if type(value) is not int:
        raise WireFormatError(f"{where}: expected int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireFormatError(f"{where}: {value} is outside [{lo}, {hi}]")
    return value


def expect_bool(value: object, where: str) -> bool:
    if type(value) is not bool:
        raise WireFormatError(f"{where}: expected bool, got {type(value).__name__}")
    return value


def expect_str(value: object, where: str, *, max_len: int, pattern: re.Pattern[str] | None = None) -> str:
    if type(value) is not str:
        raise WireFormatError(f"{where}: expected str, got {type(value).__name__}")
    if len(value) > max_len:
        raise WireFormatError(f"{where}: length {len(value)} exceeds the limit of {max_len}")
    if pattern is not None and not pattern.fullmatch(value):
        raise WireFormatError(f"{where}: {show(value)} does not match {pattern.pattern}")
    return value


def expect_bytes(value: object, where: str, *, max_len: int) -> bytes:
    if type(value) is not bytes:
        raise WireFormatError(f"{where}: expected bytes, got {type(value).__name__}")
    if len(value) > max_len:
        raise WireFormatError(f"{where}: length {len(value)} exceeds the limit of {max_len}")
    return value


def expect_list(value: object, where: str, *, max_len: int) -> list[object]:
    if not isinstance(value, list):
        raise WireFormatError(f"{where}: expected a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise WireFormatError(f"{where}: {len(value)} items exceed the limit of {max_len}")
    return value


def expect_int_list(value: object, where: str, *, lo: int, hi: int, max_len: int) -> list[int]:
    items = expect_list(value, where, max_len=max_len)
    return [expect_int(v, f"{where}[{i}]", lo=lo, hi=hi) for i, v in enumerate(items)]

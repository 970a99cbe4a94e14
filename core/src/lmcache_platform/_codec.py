"""Bounded, typed msgpack envelopes: the one place untrusted bytes are parsed.

Every message this package puts on a wire is ``MAGIC (4 bytes) + VERSION (1 byte)
+ one msgpack object``. The magic rejects foreign bytes (a pickle, an HTTP request)
before the parser sees them; the version lets the format change without guessing.
The parser is msgpack's C unpacker with every size limit set, no ext types, no
object hooks and UTF-8 strings, so decoding can allocate at most ``Limits.max_bytes``
and can only ever produce ``dict``/``list``/``str``/``bytes``/``int``/``float``/
``bool``/``None``. Callers then check the structure against their schema.

Every failure, whatever msgpack raises, becomes :class:`WireFormatError`. Callers then
check the result's structure with :mod:`._checks`.
"""

from __future__ import annotations

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


def unpack(
    magic: bytes, version: int, data: object, limits: Limits, *, what: str, older: tuple[int, ...] = ()
) -> object:
    """Parse one enveloped message within ``limits``; raise ``WireFormatError`` otherwise.

    ``older`` lists earlier versions still accepted; the caller reads which one came
    from byte 4 of ``data``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"{what}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > limits.max_bytes:
        raise WireFormatError(f"{what}: {len(data)} bytes exceed the limit of {limits.max_bytes}")
    if len(data) < HEADER_LEN or data[:4] != magic:
        looks_pickled = data[:1] == bytes([_PICKLE_PROTO])
        hint = " (it looks like a pickle; pickles are never accepted)" if looks_pickled else ""
        raise WireFormatError(f"{what}: missing the {magic!r} header{hint}")
    if data[4] != version and data[4] not in older:
        speaks = ", ".join(map(str, (*older, version)))
        raise WireFormatError(f"{what}: version {data[4]} is not supported (this side speaks {speaks})")
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

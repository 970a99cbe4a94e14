"""Content keys for the server's shared cache: namespaces and chained chunk keys.

The server treats keys as opaque bytes; these helpers are how engines that should
share KV agree on them. Two engines find each other's chunks exactly when they
compute the same namespace and the same token ids.

* :func:`cache_namespace` hashes everything that makes KV bytes interchangeable:
  the model's identity, a description of the KV layout, the dtype, the block size,
  the engine's KV-cache group structure and the chunk size. Anything else that
  changes the bytes of a chunk (a tensor-parallel rank, KV quantization, a LoRA
  adapter) goes in ``extra``.
* :func:`chunk_keys` turns token ids into one key per whole chunk. Keys chain: the
  key of chunk *i* hashes the key of chunk *i - 1* with chunk *i*'s tokens, so it
  identifies the whole prefix, and the namespace is the hash's key, so no two
  namespaces ever share a key.

Both are BLAKE2b, keyed and personalized, 32 bytes: collisions are out of reach,
and the encoding is fixed (little-endian int64 token ids, canonical msgpack for the
namespace fields), so every process on every host computes the same bytes.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from .._types import EngineGroupInfo
from ._messages import MAX_KEY_LEN

#: Length of every namespace and key these helpers make.
KEY_BYTES = 32

_NAMESPACE_PERSON = b"lmcp-namespace1"
_CHUNK_PERSON = b"lmcp-chunk1"
_ROOT_PERSON = b"lmcp-root1"
_INT64 = (-(1 << 63), (1 << 63) - 1)


def cache_namespace(
    *,
    model: str,
    kv_layout: str,
    dtype: str,
    block_size: int,
    chunk_size: int,
    groups: Sequence[EngineGroupInfo] = (),
    extra: Mapping[str, str | int] | None = None,
) -> bytes:
    """The namespace of chunks whose bytes are interchangeable between engines.

    ``model`` identifies the weights (a name plus a revision or checksum: two
    fine-tunes of one base model must differ). ``kv_layout`` describes the KV tensors
    as the engine sees them without the block count (for example
    ``"flash_attn [2, *, 16, 8, 128] x 32 layers"``). ``groups`` is the engine's
    KV-cache group structure (empty for a single full-attention group). ``extra``
    holds any other field that changes a chunk's bytes. Raises :class:`TypeError` or
    :class:`ValueError` naming a bad argument.
    """
    fields: dict[str, Any] = {
        "model": _text(model, "model"),
        "kv_layout": _text(kv_layout, "kv_layout"),
        "dtype": _text(dtype, "dtype"),
        "block_size": _positive(block_size, "block_size"),
        "chunk_size": _positive(chunk_size, "chunk_size"),
        "groups": [_group(g, i) for i, g in enumerate(groups)],
        "extra": [[k, v] for k, v in sorted(_extra(extra or {}).items())],
    }
    blob = msgpack.packb(fields, use_bin_type=True, strict_types=True)
    return hashlib.blake2b(blob, digest_size=KEY_BYTES, person=_NAMESPACE_PERSON).digest()


def chunk_keys(
    token_ids: Sequence[int], chunk_size: int, namespace: bytes, *, parent: bytes | None = None
) -> list[bytes]:
    """One key per whole chunk of ``token_ids``; a trailing partial chunk gets none.

    Key *i* identifies tokens ``[0, (i + 1) * chunk_size)`` of the sequence within
    ``namespace``. To extend a sequence, pass the last key computed so far as
    ``parent`` and only the tokens after it (they must start at a chunk boundary):
    the result equals the tail of the keys of the whole sequence. ``token_ids`` may
    be any sequence of ints, or an array with ``tolist()`` (numpy, torch).
    """
    size = _positive(chunk_size, "chunk_size")
    if type(namespace) is not bytes or not 1 <= len(namespace) <= MAX_KEY_LEN:
        raise TypeError(f"namespace must be 1 to {MAX_KEY_LEN} bytes, got {_describe(namespace)}")
    tolist = getattr(token_ids, "tolist", None)
    ids = list(tolist() if callable(tolist) else token_ids)
    if parent is None:
        prev = hashlib.blake2b(
            struct.pack("<Q", size), digest_size=KEY_BYTES, key=namespace, person=_ROOT_PERSON
        ).digest()
    elif type(parent) is bytes and 1 <= len(parent) <= MAX_KEY_LEN:
        prev = parent
    else:
        raise TypeError(f"parent must be 1 to {MAX_KEY_LEN} bytes or None, got {_describe(parent)}")
    keys = []
    for start in range(0, len(ids) - size + 1, size):
        chunk = ids[start : start + size]
        try:
            packed = struct.pack(f"<{size}q", *map(operator.index, chunk))
        except TypeError:
            bad = next(i for i, t in enumerate(chunk) if not _is_int(t))
            raise TypeError(f"token id at position {start + bad} is not an int: {chunk[bad]!r}") from None
        except struct.error:
            bad = next(i for i, t in enumerate(chunk) if not _INT64[0] <= t <= _INT64[1])
            raise ValueError(f"token id at position {start + bad} is outside int64: {chunk[bad]}") from None
        prev = hashlib.blake2b(
            prev + packed, digest_size=KEY_BYTES, key=namespace, person=_CHUNK_PERSON
        ).digest()
        keys.append(prev)
    return keys


# -- argument checks ------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return hasattr(value, "__index__") and not isinstance(value, bool)


def _describe(value: object) -> str:
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    return type(value).__name__


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty str, got {value!r}")
    return value


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _group(g: object, i: int) -> list[Any]:
    if not isinstance(g, EngineGroupInfo):
        raise TypeError(f"groups[{i}] must be an EngineGroupInfo, got {type(g).__name__}")
    return [list(g.layer_indices), g.block_size, g.sliding_window]


def _extra(extra: Mapping[str, str | int]) -> dict[str, str | int]:
    out: dict[str, str | int] = {}
    for k, v in extra.items():
        if not isinstance(k, str):
            raise TypeError(f"extra keys must be str, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise TypeError(f"extra[{k!r}] must be a str or an int, got {type(v).__name__}")
        out[k] = v
    return out

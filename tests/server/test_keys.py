"""Content keys: namespaces from what makes KV bytes interchangeable, chained chunk keys."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from typing import Any

import pytest
import torch

from lmcache_platform import EngineGroupInfo
from lmcache_platform.server import KEY_BYTES, cache_namespace, chunk_keys

BASE: dict[str, Any] = dict(
    model="Qwen/Qwen3-0.6B@c1899de",
    kv_layout="flash_attn [2, *, 16, 8, 128] x 28",
    dtype="bfloat16",
    block_size=16,
    chunk_size=256,
)
NS = cache_namespace(**BASE)
TOKENS = list(range(1000, 1000 + 4 * 16 + 5))  # four whole chunks of 16 and a partial one


def test_a_namespace_is_fixed_bytes_for_fixed_inputs() -> None:
    assert len(NS) == KEY_BYTES and cache_namespace(**BASE) == NS
    # the same in another process: nothing depends on the process (hash seeds, dict order)
    code = f"from lmcache_platform.server import cache_namespace;print(cache_namespace(**{BASE!r}).hex())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.strip() == NS.hex()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "Qwen/Qwen3-0.6B@other"},
        {"kv_layout": "flash_attn_hnd [2, *, 8, 16, 128] x 28"},
        {"dtype": "float16"},
        {"block_size": 32},
        {"chunk_size": 128},
        {"groups": (EngineGroupInfo(layer_indices=range(28), block_size=16),)},
        {"extra": {"tp_rank": 1}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_every_field_changes_the_namespace(change: dict[str, Any]) -> None:
    assert cache_namespace(**{**BASE, **change}) != NS


def test_group_structure_and_extra_fields_are_compared_by_value() -> None:
    full = EngineGroupInfo(layer_indices=(0, 2), block_size=16)
    window = EngineGroupInfo(layer_indices=(1, 3), block_size=16, sliding_window=512)
    a = cache_namespace(**BASE, groups=(full, window), extra={"tp_rank": 0, "tp_size": 2})
    b = cache_namespace(
        **BASE,
        groups=[EngineGroupInfo(layer_indices=[0, 2], block_size=16), window],
        extra={"tp_size": 2, "tp_rank": 0},
    )
    assert a == b
    assert a != cache_namespace(**BASE, groups=(window, full), extra={"tp_rank": 0, "tp_size": 2})
    assert a != cache_namespace(
        **BASE,
        groups=(full, EngineGroupInfo(layer_indices=(1, 3), block_size=16, sliding_window=256)),
        extra={"tp_rank": 0, "tp_size": 2},
    )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"model": ""}, TypeError, "model must be a non-empty str"),
        ({"dtype": None}, TypeError, "dtype must be a non-empty str"),
        ({"block_size": 0}, ValueError, "block_size must be positive"),
        ({"chunk_size": 1.0}, TypeError, "chunk_size must be an int"),
        ({"block_size": True}, TypeError, "block_size must be an int"),
        ({"groups": [(0, 1)]}, TypeError, "groups\\[0\\] must be an EngineGroupInfo"),
        ({"extra": {"tp": 1.5}}, TypeError, "extra\\['tp'\\] must be a str or an int"),
        ({"extra": {1: "x"}}, TypeError, "extra keys must be str"),
    ],
)
def test_bad_namespace_arguments_are_named(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        cache_namespace(**{**BASE, **change})


def test_one_key_per_whole_chunk_chained_over_the_prefix() -> None:
    keys = chunk_keys(TOKENS, 16, NS)
    assert len(keys) == 4 and len(set(keys)) == 4 and all(len(k) == KEY_BYTES for k in keys)
    # the documented construction, recomputed independently
    prev = hashlib.blake2b(struct.pack("<Q", 16), digest_size=32, key=NS, person=b"lmcp-root1").digest()
    for i, key in enumerate(keys):
        chunk = struct.pack("<16q", *TOKENS[16 * i : 16 * (i + 1)])
        prev = hashlib.blake2b(prev + chunk, digest_size=32, key=NS, person=b"lmcp-chunk1").digest()
        assert key == prev


def test_a_key_identifies_the_whole_prefix() -> None:
    keys = chunk_keys(TOKENS, 16, NS)
    early = TOKENS.copy()
    early[3] += 1  # chunk 0 differs: every key differs
    assert not set(chunk_keys(early, 16, NS)) & set(keys)
    late = TOKENS.copy()
    late[2 * 16] += 1  # chunk 2 differs: keys 0 and 1 are shared, 2 and 3 are not
    other = chunk_keys(late, 16, NS)
    assert other[:2] == keys[:2] and not set(other[2:]) & set(keys)
    # the same chunk of tokens after a different prefix is a different key
    assert chunk_keys(TOKENS[16:32], 16, NS)[0] != keys[1]


def test_the_partial_tail_has_no_key_and_more_tokens_extend_the_list() -> None:
    assert chunk_keys(TOKENS[:15], 16, NS) == []
    assert chunk_keys(TOKENS[:16], 16, NS) == chunk_keys(TOKENS, 16, NS)[:1]
    assert chunk_keys([], 16, NS) == []


def test_parent_continues_a_chain() -> None:
    keys = chunk_keys(TOKENS, 16, NS)
    assert chunk_keys(TOKENS[32:], 16, NS, parent=keys[1]) == keys[2:]


def test_namespaces_and_chunk_sizes_never_share_keys() -> None:
    other = cache_namespace(**{**BASE, "model": "another"})
    assert not set(chunk_keys(TOKENS, 16, other)) & set(chunk_keys(TOKENS, 16, NS))
    assert chunk_keys(TOKENS, 16, NS)[1] != chunk_keys(TOKENS, 32, NS)[0]  # same 32 tokens


def test_token_arrays_work_like_lists() -> None:
    keys = chunk_keys(TOKENS, 16, NS)
    assert chunk_keys(torch.tensor(TOKENS), 16, NS) == keys  # type: ignore[arg-type]
    assert chunk_keys(tuple(TOKENS), 16, NS) == keys


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((TOKENS, 0, NS), {}, ValueError, "chunk_size must be positive"),
        ((TOKENS, 16, "ns"), {}, TypeError, "namespace must be 1 to 64 bytes, got str"),
        ((TOKENS, 16, b""), {}, TypeError, "namespace must be 1 to 64 bytes, got 0 bytes"),
        ((TOKENS, 16, b"x" * 65), {}, TypeError, "got 65 bytes"),
        ((TOKENS, 16, NS), {"parent": b""}, TypeError, "parent must be 1 to 64 bytes"),
        (([1] * 20 + [1.5] + [1] * 11, 16, NS), {}, TypeError, "position 20 is not an int: 1.5"),
        (([1] * 17 + [1 << 63] + [1] * 14, 16, NS), {}, ValueError, "position 17 is outside int64"),
    ],
)
def test_bad_key_arguments_are_named(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        chunk_keys(*args, **kwargs)

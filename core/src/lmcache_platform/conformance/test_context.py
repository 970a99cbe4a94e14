"""Conformance: the cache context, built in the spawned peer, moves chunks bit-exactly.

For every KV format the backend's context class claims (current vLLM's in two physical
orders, views of one allocation), the engine (this process) allocates three layers of
random bit patterns the way that engine does, wraps them and registers them with
the peer, which builds the context through ``create_cache_context``. Stores are
checked against a reference gather of the engine's own tensors; retrieves by
reading the engine's tensors back: exactly the addressed tokens change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import CacheContextConfig, KVFormat, wire
from lmcache_platform._kv.layout import FORMATS
from lmcache_platform.conformance import _kv
from lmcache_platform.conformance._peer import Peer
from lmcache_platform.conformance._target import Target


@dataclass
class Registered:
    """The engine's side of one registration with the peer."""

    fmt: KVFormat
    layers: list[torch.Tensor]
    wrappers: list[lp.DeviceIPCWrapper]
    info: dict[str, Any]

    @property
    def handle(self) -> int:
        return int(self.info["handle"])

    def snapshot(self) -> list[torch.Tensor]:
        return [t.to("cpu", copy=True) for t in self.layers]

    def assert_layers_equal(self, expected: list[torch.Tensor], what: str) -> None:
        for i, (t, e) in enumerate(zip(self.layers, expected, strict=True)):
            assert _kv.to_bytes(t) == _kv.to_bytes(e), f"layer {i}: {what}"


def register(
    peer: Peer,
    target: Target,
    device: torch.device,
    fmt: KVFormat,
    engine_layout: str | None = None,
    chunk_format: str = "tokens",
) -> Registered:
    if fmt not in target.supported_formats:
        pytest.skip(f"{target.name} does not claim {fmt.value}")
    layers = _kv.make_layers(fmt, engine_layout, device)
    wrappers = lp.wrap_kv_caches(layers)
    info = peer.call(
        "context",
        wire=wire.encode(wrappers),
        kv_format=fmt.value,
        tokens_per_chunk=_kv.CHUNK,
        block_size=_kv.BLOCK_SIZE,
        num_kv_heads=_kv.HEADS,
        chunk_format=chunk_format,
    )
    return Registered(fmt, layers, wrappers, info)


def unregister(peer: Peer, reg: Registered) -> dict[str, Any]:
    closed: dict[str, Any] = peer.call("close_context", handle=reg.handle)
    for w in reg.wrappers:
        w.close()
    return closed


def check_staged(reg: Registered, groups: list[dict[str, Any]], blocks: list[int], num_tokens: int) -> None:
    """The staged tokens equal a reference gather of the engine's tensors."""
    covered = sorted(layer for g in groups for layer in g["layers"])
    assert covered == list(range(_kv.LAYERS)), f"kernel groups cover layers {covered}"
    for g in groups:
        expected = torch.stack(
            [_kv.chunk_rows(reg.layers[layer].cpu(), reg.fmt, blocks, num_tokens) for layer in g["layers"]],
            dim=1,
        )
        assert g["shape"] == list(expected.shape), f"staged shape {g['shape']} != {list(expected.shape)}"
        assert g["dtype"] == str(expected.dtype).removeprefix("torch.")
        assert g["data"] == _kv.to_bytes(expected), (
            f"store_chunk of blocks {blocks} ({num_tokens} tokens) is not bit-exact in layers {g['layers']}"
        )


@pytest.mark.parametrize("case", _kv.CASES, ids=_kv.case_id)
def test_store_and_retrieve_are_bit_exact_and_touch_nothing_else(
    case: tuple[KVFormat, str | None],
    lmcache_backend: Target,
    lmcache_device: torch.device,
    lmcache_peer: Peer,
) -> None:
    fmt, engine_layout = case
    reg = register(lmcache_peer, lmcache_backend, lmcache_device, fmt, engine_layout)
    try:
        info = reg.info
        cls = lmcache_backend.context_class
        assert cls is not None
        assert info["class"] == f"{cls.__module__}.{cls.__qualname__}", "the peer chose another context class"
        assert info["device_type"] == lmcache_device.type
        assert (info["num_layers"], info["num_blocks"]) == (_kv.LAYERS, _kv.BLOCKS)
        assert set(info["kv_formats"]) == {fmt.value}
        itemsize = torch.empty((), dtype=_kv.FORMAT_DTYPES[fmt]).element_size()
        planes = FORMATS[fmt].planes
        hidden = _kv.HEAD_SIZE if planes == 1 else _kv.HEADS * _kv.HEAD_SIZE
        assert info["cache_size_per_token"] == _kv.LAYERS * planes * hidden * itemsize
        json.loads(info["status_json"])  # report_status() is JSON-ready

        original = reg.snapshot()
        full = lmcache_peer.call("store", handle=reg.handle, ids=[[1, 2]], slot=0, num_tokens=_kv.CHUNK)
        check_staged(reg, full, [1, 2], _kv.CHUNK)
        partial = lmcache_peer.call("store", handle=reg.handle, ids=[[5, 6]], slot=1, num_tokens=5)
        check_staged(reg, partial, [5, 6], 5)
        reg.assert_layers_equal(original, "store_chunk wrote to the paged blocks")

        # Retrieve into other blocks: blocks 4, 7 get old 1, 2; block 3 gets old 5; of
        # block 0 only token 0 changes (old block 6, token 0). Nothing else changes.
        lmcache_peer.call("retrieve", handle=reg.handle, ids=[[4, 7]], slot=0, num_tokens=_kv.CHUNK)
        lmcache_peer.call("retrieve", handle=reg.handle, ids=[[3, 0]], slot=1, num_tokens=5)
        _kv.synchronize(lmcache_device)
        expected = [t.clone() for t in original]
        for e, o in zip(expected, original, strict=True):
            for dst, src, count in ((4, 1, 4), (7, 2, 4), (3, 5, 4), (0, 6, 1)):
                _kv.token_view(e, fmt, dst, 0, count).copy_(_kv.token_view(o, fmt, src, 0, count))
        reg.assert_layers_equal(expected, "retrieve_chunk is not bit-exact or wrote other tokens")
    finally:
        closed = unregister(lmcache_peer, reg)
    assert closed["closed"] and all(closed["wrappers_closed"]), f"close() left {closed}"
    assert closed["store_after_close"], "a closed context must refuse transfers with TransferError"


def blocks_moved(original: list[torch.Tensor], fmt: KVFormat, moves: dict[int, int]) -> list[torch.Tensor]:
    """``original`` with each source block's tokens copied into its destination block."""
    expected = [t.clone() for t in original]
    for e, o in zip(expected, original, strict=True):
        for src, dst in moves.items():
            _kv.token_view(e, fmt, dst, 0, _kv.BLOCK_SIZE).copy_(
                _kv.token_view(o, fmt, src, 0, _kv.BLOCK_SIZE)
            )
    return expected


@pytest.fixture(
    params=[(case, chunk_format) for chunk_format in ("tokens", "blocks") for case in _kv.CASES],
    ids=lambda p: f"{_kv.case_id(p[0])}-{p[1]}",
)
def chunked(
    request: pytest.FixtureRequest, lmcache_backend: Target, lmcache_device: torch.device, lmcache_peer: Peer
) -> Iterator[tuple[Registered, KVFormat, str]]:
    """A context of each format and layout, in each chunk format, registered in the peer."""
    (fmt, engine_layout), chunk_format = request.param
    reg = register(lmcache_peer, lmcache_backend, lmcache_device, fmt, engine_layout, chunk_format)
    try:
        yield reg, fmt, chunk_format
    finally:
        unregister(lmcache_peer, reg)


def test_chunks_move_through_host_tensors_bit_exact_in_either_format(
    chunked: tuple[Registered, KVFormat, str], lmcache_device: torch.device, lmcache_peer: Peer
) -> None:
    """``read_chunk`` into ``allocate_chunk``'s host tensors, ``write_chunk`` into other blocks."""
    reg, fmt, chunk_format = chunked
    original = reg.snapshot()
    moved = lmcache_peer.call("move", handle=reg.handle, src=[[1, 2]], dst=[[6, 0]])
    assert moved == _kv.CHUNK * int(reg.info["cache_size_per_token"])
    _kv.synchronize(lmcache_device)
    expected = blocks_moved(original, fmt, {1: 6, 2: 0})
    reg.assert_layers_equal(expected, f"a {chunk_format} chunk is not bit-exact or wrote other blocks")


def test_a_batch_of_chunks_moves_as_the_single_chunk_calls_do(
    chunked: tuple[Registered, KVFormat, str], lmcache_device: torch.device, lmcache_peer: Peer
) -> None:
    """``read_chunks`` / ``write_chunks`` of three chunks, each in a slot of its own, in flight together."""
    reg, fmt, chunk_format = chunked
    pairs = {(1, 2): (7, 0), (3, 4): (2, 5), (5, 6): (6, 1)}  # source blocks -> destination blocks
    original = reg.snapshot()
    moved = lmcache_peer.call(
        "move_batch",
        handle=reg.handle,
        src=[[list(s)] for s in pairs],
        dst=[[list(d)] for d in pairs.values()],
    )
    assert moved == {"chunks": 3, "batch_equals_single": True}
    _kv.synchronize(lmcache_device)
    moves = {s: d for src, dst in pairs.items() for s, d in zip(src, dst, strict=True)}
    expected = blocks_moved(original, fmt, moves)
    reg.assert_layers_equal(expected, f"a batch of {chunk_format} chunks is not bit-exact or wrote elsewhere")


def bad_requests() -> dict[str, tuple[str, list[list[int]], int, int]]:
    chunk, nb = _kv.CHUNK, _kv.BLOCKS
    return {
        "block id past the end": ("retrieve", [[1, nb]], 0, chunk),
        "negative block id": ("retrieve", [[-2, 2]], 0, chunk),
        "skipped block (-1) in a store": ("store", [[-1, 2]], 0, chunk),
        "too few block ids": ("retrieve", [[1]], 0, chunk),
        "repeated block ids": ("retrieve", [[2, 2]], 0, chunk),
        "ids for two engine groups": ("retrieve", [[1, 2], [3, 4]], 0, chunk),
        "slot past the end": ("retrieve", [[1, 2]], 1 << 10, chunk),
        "more tokens than a chunk": ("retrieve", [[1, 2, 3]], 0, chunk + 1),
        "store from a block past the end": ("store", [[nb + 5, 2]], 0, chunk),
    }


def test_bad_transfer_requests_raise_transfer_error_and_write_nothing(
    lmcache_backend: Target, lmcache_device: torch.device, lmcache_peer: Peer
) -> None:
    fmt = lmcache_backend.supported_formats[0]
    layout = "LBHNC" if fmt is KVFormat.VLLM else None
    reg = register(lmcache_peer, lmcache_backend, lmcache_device, fmt, layout)
    try:
        # Fill slot 0 with other data, so a retrieve that wrote anything would show.
        lmcache_peer.call("store", handle=reg.handle, ids=[[5, 6]], slot=0, num_tokens=_kv.CHUNK)
        original = reg.snapshot()
        for what, (op, ids, slot, num_tokens) in bad_requests().items():
            error = lmcache_peer.error(op, handle=reg.handle, ids=ids, slot=slot, num_tokens=num_tokens)
            assert error.is_a("TransferError"), f"{what}: expected TransferError, got {error}"
            _kv.synchronize(lmcache_device)
            reg.assert_layers_equal(original, f"{what}: a refused request wrote to the blocks")
    finally:
        unregister(lmcache_peer, reg)


def test_an_empty_wrapper_list_is_a_value_error(
    lmcache_backend: Target, lmcache_device: torch.device
) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        lp.create_cache_context([])
    cls = lmcache_backend.context_class
    assert cls is not None
    with pytest.raises(ValueError):
        cls([], CacheContextConfig())

"""The ``"blocks"`` chunk format and the host chunk API (``read_chunk``/``write_chunk``).

Every layout engines allocate (current vLLM in its six physical orders and its MLA, the
older vLLM formats as one allocation and as one allocation per layer, SGLang's pools)
round-trips bit-exact through a blocks-format chunk: the target blocks then hold the
source blocks' tokens, checked against the hand-indexed references, and no other block
changed. Sliding-window kept ranges, kernel blocks smaller than the engine's and skipped
(``-1``) blocks are covered too, and on the host the chunk API never touches staging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_platform import (
    CacheContextConfig,
    EngineGroupInfo,
    EngineType,
    KVFormat,
    LayoutError,
    LayoutHints,
    TransferError,
)
from support.cache import HostContext, engine_kv, slot_rows, token_rows
from support.layouts import BS, NB, ORDERS, D, H, L, fill, host_context

SRC, DST = [3, 7], [9, 1]


def allocate(fmt: KVFormat, order: str | None = None, *, per_layer: bool = False, nb: int = NB) -> list[Any]:
    """``L`` layers of ``fmt`` as its engine allocates them (or one allocation per layer)."""
    layers = engine_kv(fmt, L, nb, BS, H, D, torch.bfloat16, order=order)
    if per_layer:
        layers = [tuple(t.clone() for t in e) if isinstance(e, tuple) else e.clone() for e in layers]
    fill(layers)
    return layers


#: id -> (format, engine layout, one allocation per layer, config)
CASES: dict[str, tuple[KVFormat, str | None, bool, dict[str, Any]]] = {
    **{f"vllm-{o}": (KVFormat.VLLM, o, False, {}) for o in ORDERS},
    "vllm_mla": (
        KVFormat.VLLM_MLA,
        "LBNHC",
        False,
        {"layout_hints": LayoutHints(kv_format=KVFormat.VLLM_MLA)},
    ),
    **{
        f"{f.value}{'-per-layer' if per else ''}": (f, None, per, {})
        for f in (KVFormat.FLASH_ATTN, KVFormat.FLASH_ATTN_HND, KVFormat.FLASHINFER, KVFormat.FLASHINFER_HND)
        for per in (False, True)
    },
    "mla": (KVFormat.MLA, None, False, {}),
    "sglang": (KVFormat.SGLANG, None, False, {"layout_hints": LayoutHints(block_size=BS)}),
    "sglang_mla": (
        KVFormat.SGLANG_MLA,
        None,
        False,
        {"layout_hints": LayoutHints(block_size=BS), "engine_type": EngineType.SGLANG},
    ),
}
HND_HINTS = {KVFormat.FLASH_ATTN_HND, KVFormat.FLASHINFER_HND, KVFormat.FLASH_ATTN, KVFormat.FLASHINFER}


def reference(fmt: KVFormat) -> Callable[[Any, int], torch.Tensor]:
    """Hand-indexed bytes of one whole block of a layer (``[kv, tokens, hidden]``)."""
    if fmt in (KVFormat.SGLANG, KVFormat.SGLANG_MLA):
        return lambda e, b: as_bytes(slot_rows(e if isinstance(e, tuple) else (e,), BS, b, 0, BS))
    return lambda e, b: as_bytes(token_rows(e, fmt, b, 0, BS))


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(-1)


def snapshot(layers: list[Any], fmt: KVFormat) -> dict[tuple[int, int], torch.Tensor]:
    rows = reference(fmt)
    return {(i, b): rows(e, b).clone() for i, e in enumerate(layers) for b in range(NB)}


def config_of(fmt: KVFormat, extra: dict[str, Any]) -> dict[str, Any]:
    config = dict(extra)
    if fmt in HND_HINTS:  # dims 2 and 3 are both 4 here: the hint says which is the block
        config["layout_hints"] = LayoutHints(kv_format=fmt, block_size=BS)
    return config


@pytest.mark.parametrize("case", list(CASES))
def test_every_layout_round_trips_bit_exact_through_a_blocks_chunk(case: str) -> None:
    fmt, order, per_layer, extra = CASES[case]
    layers = allocate(fmt, order, per_layer=per_layer)
    before = snapshot(layers, fmt)
    with host_context(layers, chunk_format="blocks", **config_of(fmt, extra)) as ctx:
        assert ctx.chunk_format == "blocks"
        chunk = ctx.allocate_chunk()
        ctx.read_chunk([SRC], chunk)
        ctx.write_chunk([DST], chunk)
        after = snapshot(layers, fmt)
        for (layer, block), old in before.items():
            if block in DST:  # the target blocks now hold the source blocks' bytes
                src = SRC[DST.index(block)]
                assert torch.equal(after[layer, block], before[layer, src]), (layer, block)
            else:  # and nothing else moved
                assert torch.equal(after[layer, block], old), (layer, block)
        with host_context(layers, **config_of(fmt, extra)) as tokens:  # same bytes per chunk as token-major
            assert tokens.chunk_nbytes == ctx.chunk_nbytes
            assert (
                tokens.report_status()["kernel_groups"][0]["block_order"]
                == (ctx.report_status()["kernel_groups"][0]["block_order"])
            )


@pytest.mark.parametrize(
    ("order", "block_order"),
    [
        ("LBHNC", "block head token kv_dim"),
        ("LBNHC", "block token head kv_dim"),
        ("LHBNC", "head block token kv_dim"),
        ("BLHNC", "block head token kv_dim"),
        ("BHLNC", "block head token kv_dim"),
    ],
)
def test_a_blocks_chunk_is_the_engine_blocks_in_memory_order(order: str, block_order: str) -> None:
    layers = allocate(KVFormat.VLLM, order)
    with host_context(layers, chunk_format="blocks") as ctx:
        kg = ctx.report_status()["kernel_groups"][0]
        assert (kg["block_order"], kg["stacked"]) == (block_order, True)
        chunk = ctx.allocate_chunk()
        ctx.read_chunk([SRC], chunk)
        if block_order.startswith("block"):  # per layer, each block's bytes as the engine keeps them
            axes = "BHNC"
            perm = [axes.index(a) for a in order if a != "L"]
            want = torch.cat([as_bytes(x.permute(perm)[SRC]) for x in layers])
            assert torch.equal(chunk[0], want)


def test_the_vllm_cpu_layout_payload_is_whole_contiguous_blocks() -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    with host_context(layers, chunk_format="blocks") as ctx:
        chunk = ctx.allocate_chunk()
        ctx.read_chunk([SRC], chunk)
        assert torch.equal(chunk[0], torch.cat([as_bytes(x[SRC]) for x in layers]))


def hybrid(window: int, **config: Any) -> tuple[list[Any], HostContext]:
    """A sliding-window group and a full-attention group, one allocation each."""
    sw, full = allocate(KVFormat.VLLM, "LBHNC")[:2]
    infos = [
        EngineGroupInfo(layer_indices=[0], block_size=BS, sliding_window=window),
        EngineGroupInfo(layer_indices=[1], block_size=BS),
    ]
    return [sw, full], host_context([sw, full], engine_group_infos=infos, **config)


def test_sliding_window_groups_keep_their_last_blocks() -> None:
    (sw, full), ctx = hybrid(BS, chunk_format="blocks")
    with ctx:
        kept = ctx.tokens_kept_per_chunk(0)
        assert kept == BS and ctx.report_status()["kernel_groups"][0]["sliding_window"] == BS
        want_sw, want_full = as_bytes(sw[5]).clone(), as_bytes(full[[2, 3]]).clone()
        untouched = as_bytes(sw[4]).clone()
        chunk = ctx.allocate_chunk()
        ctx.read_chunk([[0, 5], [2, 3]], chunk)
        ctx.write_chunk([[4, 6], [8, 1]], chunk)
        assert torch.equal(as_bytes(sw[6]), want_sw)  # the window's one block
        assert torch.equal(as_bytes(sw[4]), untouched)  # outside the window: never written
        assert torch.equal(as_bytes(full[[8, 1]]), want_full)


def test_a_window_that_is_not_whole_blocks_is_refused_for_blocks_chunks() -> None:
    with pytest.raises(LayoutError, match=r"keeps 6 tokens .* not a multiple of its block size 4"):
        hybrid(6, chunk_format="blocks")
    hybrid(6)[1].close()  # token-major chunks keep any window
    hybrid(6, chunk_format="blocks", full_sw_kv=True)[1].close()  # so does keeping the whole chunk


def test_kernel_blocks_smaller_than_the_engine_block() -> None:
    kernel_bs, ratio = BS, 2
    layers = allocate(KVFormat.VLLM, "LBNHC", nb=NB * ratio)
    infos = [EngineGroupInfo(layer_indices=range(L), block_size=kernel_bs * ratio)]
    with host_context(
        layers, engine_group_infos=infos, lmcache_tokens_per_chunk=16, chunk_format="blocks"
    ) as ctx:
        # Engine blocks 3 and 6 are kernel blocks 6, 7 and 12, 13; 1 and 9 are 2, 3 and 18, 19.
        want = [as_bytes(x[[6, 7, 12, 13]]).clone() for x in layers]
        chunk = ctx.allocate_chunk()
        ctx.read_chunk([[3, 6]], chunk)
        ctx.write_chunk([[1, 9]], chunk)
        for i, x in enumerate(layers):
            assert torch.equal(as_bytes(x[[2, 3, 18, 19]]), want[i])


def test_skipped_blocks_are_neither_read_nor_written() -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    with host_context(layers, chunk_format="blocks") as ctx:
        chunk = ctx.allocate_chunk()
        ctx.read_chunk([SRC], chunk)
        skipped = [as_bytes(x[9]).clone() for x in layers]
        ctx.write_chunk([[-1, 1]], chunk)
        for i, x in enumerate(layers):
            assert torch.equal(as_bytes(x[1]), as_bytes(x[SRC[1]]))
            assert torch.equal(as_bytes(x[9]), skipped[i])
        with pytest.raises(TransferError, match="allowed only in a retrieve"):
            ctx.read_chunk([[-1, 1]], chunk)


def test_blocks_chunks_hold_whole_blocks_only() -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    with host_context(layers, chunk_format="blocks") as ctx:
        chunk = ctx.allocate_chunk()
        with pytest.raises(TransferError, match=r"num_tokens 5 is not a multiple of kernel group 0's block"):
            ctx.read_chunk([SRC], chunk, num_tokens=5)
        ctx.read_chunk([SRC[:1]], chunk, num_tokens=BS)  # a chunk of whole blocks, shorter than full
        ctx.write_chunk([[0]], chunk, num_tokens=BS)
        for x in layers:
            assert torch.equal(as_bytes(x[0]), as_bytes(x[SRC[0]]))


def test_store_and_retrieve_through_staging_use_the_same_format() -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    with host_context(layers, chunk_format="blocks") as ctx:
        ctx.store_chunk([SRC], slot=1)
        assert torch.equal(
            ctx.get_temp_object_group_buffer(1, 0), torch.cat([as_bytes(x[SRC]) for x in layers])
        )
        ctx.retrieve_chunk([DST], slot=1)
        for x in layers:
            assert torch.equal(as_bytes(x[DST]), as_bytes(x[SRC]))


def test_an_unknown_chunk_format_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_format must be one of 'tokens', 'blocks', got 'pages'"):
        CacheContextConfig(chunk_format="pages")


# -- the host chunk API: one pass, no staging ------------------------------------------------


@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
def test_on_the_host_read_and_write_never_touch_staging(chunk_format: str) -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    with host_context(layers, chunk_format=chunk_format) as ctx:
        ctx.store_chunk([SRC], slot=0)  # what staging would hold after a staged store
        staged = ctx.get_temp_object_group_buffer(0, 0).clone()
        staging = [ctx.get_temp_object_group_buffer(s, 0) for s in range(ctx.max_batch_size)]
        for buf in staging:
            buf.fill_(0xA5)
        chunk = ctx.allocate_chunk()
        ctx.read_chunk([SRC], chunk)
        assert torch.equal(chunk[0], staged)  # the same bytes a staged store gives
        ctx.write_chunk([DST], chunk)
        assert all(bool((buf == 0xA5).all()) for buf in staging)  # one pass: staging untouched
        for x in layers:
            assert torch.equal(as_bytes(x[DST]), as_bytes(x[SRC]))


def test_host_tensors_staging_cannot_align_with_go_through_staging() -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    with host_context(layers, chunk_format="blocks") as ctx:
        (nbytes,) = ctx.chunk_nbytes
        odd = torch.zeros(nbytes + 8, dtype=torch.uint8)[8:]  # 8 bytes in: not like a slot
        ctx.read_chunk([SRC], [odd])
        assert torch.equal(odd, torch.cat([as_bytes(x[SRC]) for x in layers]))
        ctx.write_chunk([DST], [odd.clone()])
        for x in layers:
            assert torch.equal(as_bytes(x[DST]), as_bytes(x[SRC]))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda n: [], "expected 1 host tensors"),
        (
            lambda n: [torch.zeros(n - 1, dtype=torch.uint8)],
            "object group 0: expected a contiguous 1-D uint8",
        ),
        (lambda n: [torch.zeros(n // 2, dtype=torch.int16)], r"got torch.int16"),
        (lambda n: [torch.zeros(2, n, dtype=torch.uint8)[:, : n // 2].reshape(-1)[::2]], "contiguous"),
        (lambda n: ["not a tensor"], "got str"),
    ],
)
def test_host_tensors_are_checked_before_anything_moves(bad: Any, match: str) -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    with host_context(layers) as ctx:
        (nbytes,) = ctx.chunk_nbytes
        with pytest.raises(TransferError, match=match):
            ctx.read_chunk([SRC], bad(nbytes))


def test_allocate_chunk_lays_a_chunk_out_like_a_slot() -> None:
    layers = allocate(KVFormat.VLLM, "LBHNC")
    sw, full = layers[:2]
    infos = [
        EngineGroupInfo(layer_indices=[0], block_size=BS, sliding_window=BS),
        EngineGroupInfo(layer_indices=[1], block_size=BS),
    ]
    with host_context([sw, full], engine_group_infos=infos) as ctx:
        chunk = ctx.allocate_chunk()
        assert [t.numel() for t in chunk] == ctx.chunk_nbytes and len(chunk) == 2
        assert all(t.dtype == torch.uint8 and t.device.type == "cpu" and not t.is_pinned() for t in chunk)
        assert chunk[0].untyped_storage().data_ptr() == chunk[1].untyped_storage().data_ptr()
        assert all(t.storage_offset() % 256 == 0 for t in chunk)

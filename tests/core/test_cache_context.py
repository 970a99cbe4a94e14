"""BaseCacheContext on real host tensors: store/retrieve bit-exactness, groups, errors, lifetime."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platform import (
    BaseCacheContext,
    CacheContextConfig,
    EngineGroupInfo,
    KVFormat,
    LayoutError,
    LayoutHints,
    TransferError,
)
from lmcache_platform._kv.context import NullStream
from support.cache import (
    HeldWrapper,
    HostContext,
    context,
    make_layers,
    random_bytes,
    token_rows,
)
from support.cache import hybrid as support_hybrid

CHUNK, BS, NB = 16, 4, 12


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def chunk_rows(t, fmt, ids, lo, hi, bs=BS):
    """Reference: chunk positions [lo, hi) of the chunk held by blocks ``ids``."""
    parts = []
    for pos in range(lo, hi):
        parts.append(token_rows(t, fmt, ids[pos // bs], pos % bs, pos % bs + 1))
    return torch.cat(parts, 1)


def snapshot(ctx, layers):
    return [x.clone() for x in layers] + [ctx._staging.clone()]


def assert_unchanged(ctx, layers, snap):
    for now, before in zip([*layers, ctx._staging], snap, strict=True):
        assert torch.equal(as_bytes(now), as_bytes(before))


# -- round trips ---------------------------------------------------------------------------


HINTS: dict[str, Callable[[KVFormat], dict[str, Any]]] = {
    "format": lambda fmt: {"layout_hints": LayoutHints(kv_format=fmt)},
    "group": lambda fmt: {"engine_group_infos": [EngineGroupInfo(layer_indices=[0, 1, 2], block_size=BS)]},
    "none": lambda fmt: {},
}


#: Formats of one tensor per layer and block-major memory; SGLang's slot pools have
#: their own tests (tests/core/test_engine_layouts.py).
BLOCK_FORMATS = [f for f in KVFormat if f not in (KVFormat.SGLANG, KVFormat.SGLANG_MLA)]
# Dense 5-D layers need a hint (see test_ambiguous_layout_*); MLA and vLLM's current
# layout (more than one head) need none; vLLM's MLA (one head) needs the format or head size.
NEEDS_NO_HINT = (KVFormat.MLA, KVFormat.VLLM)
CASES = [
    (f, h)
    for f in BLOCK_FORMATS
    for h in HINTS
    if (h != "none" or f in NEEDS_NO_HINT) and (h != "group" or f is not KVFormat.VLLM_MLA)
]


@pytest.mark.parametrize(("fmt", "hint"), CASES, ids=[f"{f.name}-{h}" for f, h in CASES])
@pytest.mark.parametrize("shared", [False, True], ids=["separate", "one-allocation"])
@pytest.mark.parametrize("num_tokens", [CHUNK, 10])
def test_store_then_retrieve_into_other_blocks_is_bit_exact(fmt, shared, hint, num_tokens):
    layers = make_layers(fmt, 3, nb=NB, bs=BS, shared=shared, dtype=torch.bfloat16)
    src, dst = [3, 0, 7, 9], [1, 11, 5, 2]
    n_ids = -(-num_tokens // BS)
    src, dst = src[:n_ids], dst[:n_ids]
    with context(layers, **HINTS[hint](fmt)) as ctx:
        assert ctx.report_status()["kernel_groups"][0]["stacked"] is shared
        original = [chunk_rows(x, fmt, src, 0, num_tokens) for x in layers]
        ctx.store_chunk([src], slot=2, num_tokens=num_tokens)
        buf = ctx.get_temp_kernel_group_buffer(2, 0)
        for i in range(3):
            assert torch.equal(as_bytes(buf[:, i, :num_tokens]), as_bytes(original[i]))
        # The engine overwrites its source blocks; the staged copy must not change.
        for x in layers:
            x.view(torch.uint8).fill_(0x5A)
        before = [x.clone() for x in layers]
        ctx.retrieve_chunk([dst], slot=2, num_tokens=num_tokens)
        for i, x in enumerate(layers):
            assert torch.equal(as_bytes(chunk_rows(x, fmt, dst, 0, num_tokens)), as_bytes(original[i]))
            # Everything else, including the rest of a partial last block, is untouched.
            mask = _written_mask(x, fmt, dst, 0, num_tokens)
            assert torch.equal(as_bytes(x[~mask]), as_bytes(before[i][~mask]))


def _written_mask(x, fmt, ids, lo, hi, bs=BS):
    mask = torch.zeros(x.shape, dtype=torch.bool)
    for pos in range(lo, hi):
        b, o = ids[pos // bs], pos % bs
        if fmt is KVFormat.MLA:
            mask[b, o] = True
        elif fmt in (KVFormat.VLLM, KVFormat.VLLM_MLA):
            mask[b, :, o] = True
        elif fmt is KVFormat.FLASH_ATTN:
            mask[:, b, o] = True
        elif fmt is KVFormat.FLASH_ATTN_HND:
            mask[:, b, :, o] = True
        elif fmt is KVFormat.FLASHINFER:
            mask[b, :, o] = True
        else:
            mask[b, :, :, o] = True
    return mask


def test_nhd_view_over_hnd_memory_round_trips_without_hints():
    gen = torch.Generator().manual_seed(1)
    layers = [random_bytes((2, NB, 2, BS, 8), torch.float16, gen).permute(0, 1, 3, 2, 4) for _ in range(2)]
    with context(layers) as ctx:
        assert ctx.get_engine_kv_format(0) is KVFormat.FLASH_ATTN
        want = [chunk_rows(x, KVFormat.FLASH_ATTN, [4, 5, 6, 7], 0, CHUNK) for x in layers]
        ctx.store_chunk([[4, 5, 6, 7]])
        ctx.retrieve_chunk([[0, 1, 2, 3]])
        for x, w in zip(layers, want, strict=True):
            assert torch.equal(
                as_bytes(chunk_rows(x, KVFormat.FLASH_ATTN, [0, 1, 2, 3], 0, CHUNK)), as_bytes(w)
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.int8, torch.float64])
def test_any_dtype_moves_bit_exact(dtype):
    layers = make_layers(KVFormat.FLASHINFER, 2, nb=NB, bs=BS, d=6, dtype=dtype)
    with context(layers, layout_hints=LayoutHints(block_size=BS)) as ctx:
        want = [chunk_rows(x, KVFormat.FLASHINFER, [8, 9, 10, 11], 0, CHUNK) for x in layers]
        ctx.store_chunk([[8, 9, 10, 11]], slot=3)
        ctx.retrieve_chunk([[0, 2, 4, 6]], slot=3)
        for x, w in zip(layers, want, strict=True):
            assert torch.equal(
                as_bytes(chunk_rows(x, KVFormat.FLASHINFER, [0, 2, 4, 6], 0, CHUNK)), as_bytes(w)
            )


# -- two engine groups, one with a sliding window ------------------------------------------------

WINDOW = 6


def hybrid(separate, full, seed=0):
    # Layers 0 and 2: full attention (flash-attn); 1 and 3: 6-token window (FlashInfer HND).
    return support_hybrid(
        nb=NB, bs=BS, window=WINDOW, seed=seed, separate_object_groups=separate, full_sw_kv=full
    )


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("num_tokens", [CHUNK, 13, 5])
def test_sliding_window_group_keeps_only_the_window_unless_full_sw_kv(separate, full, num_tokens):
    ctx, layers = hybrid(separate, full)
    fmts = [KVFormat.FLASH_ATTN, KVFormat.FLASHINFER_HND] * 2
    n_ids = -(-num_tokens // BS)
    src = [[0, 1, 2, 3][:n_ids], [4, 5, 6, 7][:n_ids]]
    dst = [[8, 9, 10, 11][:n_ids], [11, 10, 9, 8][:n_ids]]
    with ctx:
        m = ctx.kv_layer_groups_manager
        assert m.num_engine_groups == 2 and m.num_kernel_groups == 2
        assert m.num_object_groups == (2 if separate else 1)
        sw_kg = next(kg for kg in m.kernel_groups if kg.sliding_window)
        kept = CHUNK if full else WINDOW
        assert ctx.get_slots_per_chunk_in_sw(sw_kg.index) == kept
        assert ctx.get_temp_kernel_group_buffer(0, sw_kg.index).shape == (2, 2, kept, 16)
        first = 0 if full else max(0, num_tokens - WINDOW)

        want = {}
        for i, x in enumerate(layers):
            g = 1 if i % 2 else 0
            lo = first if g else 0
            want[i] = (lo, chunk_rows(x, fmts[i], src[g], lo, num_tokens))
        ctx.store_chunk(src, slot=1, num_tokens=num_tokens)
        before = [x.clone() for x in layers]
        ctx.retrieve_chunk(dst, slot=1, num_tokens=num_tokens)
        for i, x in enumerate(layers):
            g = 1 if i % 2 else 0
            lo, rows = want[i]
            assert torch.equal(as_bytes(chunk_rows(x, fmts[i], dst[g], lo, num_tokens)), as_bytes(rows))
            mask = _written_mask(x, fmts[i], dst[g], lo, num_tokens)
            assert torch.equal(as_bytes(x[~mask]), as_bytes(before[i][~mask]))


@pytest.mark.parametrize("separate", [True, False])
def test_object_group_buffer_spans_exactly_its_kernel_groups(separate):
    ctx, _ = hybrid(separate, False)
    with ctx:
        m = ctx.kv_layer_groups_manager
        for slot in range(ctx.max_batch_size):
            for og in m.object_groups:
                flat = ctx.get_temp_object_group_buffer(slot, og.index)
                assert flat.dtype == torch.uint8 and flat.dim() == 1
                views = [ctx.get_temp_kernel_group_buffer(slot, k) for k in og.kernel_group_indices]
                assert flat.data_ptr() == views[0].data_ptr()
                assert flat.nbytes == sum(v.nbytes for v in views)
                for k, v in zip(og.kernel_group_indices, views, strict=True):
                    shape, dtype = ctx.get_kernel_group_shape_dtype(CHUNK, k)
                    assert (v.shape, v.dtype) == (shape, dtype)
                    assert v.is_contiguous()
        # Slots do not overlap.
        a, b = ctx.get_temp_object_group_buffer(0, 0), ctx.get_temp_object_group_buffer(1, 0)
        assert b.data_ptr() >= a.data_ptr() + a.nbytes


def test_shapes_pointers_and_report():
    ctx, layers = hybrid(True, False)
    with ctx:
        assert ctx.num_layers == 4 and ctx.num_blocks == NB and ctx.device == torch.device("cpu")
        assert ctx.kv_tensors == layers and ctx.max_batch_size == 4
        assert isinstance(ctx.stream, NullStream)
        kgs = ctx.kv_layer_groups_manager.kernel_groups
        for kg in kgs:
            ptrs = ctx.get_kernel_group_kv_pointers(kg.index)
            assert ptrs.dtype == torch.int64 and ptrs.device == ctx.device
            assert ptrs.tolist() == [layers[i].data_ptr() for i in kg.layer_indices]
        sw = next(kg.index for kg in kgs if kg.sliding_window)
        full = next(kg.index for kg in kgs if not kg.sliding_window)
        assert ctx.get_kernel_group_shape_dtype(3 * CHUNK + 2, sw)[0] == (2, 2, 3 * WINDOW + 2, 16)
        assert ctx.get_kernel_group_shape_dtype(3 * CHUNK + 2, full)[0] == (2, 2, 3 * CHUNK + 2, 16)
        assert ctx.calculate_num_blocks(13, sw) == 4 and ctx.calculate_num_blocks(CHUNK, full) == 4
        assert ctx.cache_size_per_token() == 4 * 2 * 16 * 2  # layers x kv x hidden x bytes
        assert ctx.hidden_dim_sizes == [16, 16]
        report = json.loads(json.dumps(ctx.report_status()))
        assert report["num_layers"] == 4 and len(report["kernel_groups"]) == 2
        assert {g["kv_format"] for g in report["kernel_groups"]} == {"flash_attn", "flashinfer_hnd"}
        assert [g["sliding_window"] for g in report["object_groups"]] == [None, WINDOW]


def test_stage_block_ids_returns_one_view_per_engine_group():
    ctx, _ = hybrid(True, False)
    with ctx:
        views = ctx.stage_block_ids([[1, 2, 3], [4]])
        assert [v.tolist() for v in views] == [[1, 2, 3], [4]]
        assert all(v.dtype == torch.int64 for v in views)
        with pytest.raises(TransferError, match="exceed the staging capacity"):
            ctx.stage_block_ids([[0] * 100, [0]])
        with pytest.raises(TransferError, match="engine group 1: block id 12 at position 0"):
            ctx.stage_block_ids([[0], [12]])


def test_concurrent_transfers_on_different_slots_stay_correct():
    layers = make_layers(KVFormat.FLASH_ATTN, 2, nb=32, bs=BS)
    with context(layers, layout_hints=LayoutHints(block_size=BS)) as ctx:
        want = {
            s: [chunk_rows(x, KVFormat.FLASH_ATTN, [4 * s + j for j in range(4)], 0, CHUNK) for x in layers]
            for s in range(4)
        }
        errors = []

        def worker(s):
            try:
                for _ in range(20):
                    ctx.store_chunk([[4 * s + j for j in range(4)]], slot=s)
                    ctx.retrieve_chunk([[16 + 4 * s + j for j in range(4)]], slot=s)
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for s in range(4):
            for x, w in zip(layers, want[s], strict=True):
                got = chunk_rows(x, KVFormat.FLASH_ATTN, [16 + 4 * s + j for j in range(4)], 0, CHUNK)
                assert torch.equal(as_bytes(got), as_bytes(w))


# -- errors: typed, naming the culprit, and nothing written ----------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ids": [[0, 1, 2]]}, "engine group 0: 16 tokens with block size 4 need 4 block ids, got 3"),
        ({"ids": [[0, 1, 2, 3, 4]]}, "need 4 block ids, got 5"),
        ({"ids": [[0, 1, 2, 12]]}, r"block id 12 at position 3 is out of range 0..11"),
        ({"ids": [[0, -2, 2, 3]]}, "block id -2 at position 1"),
        ({"ids": [[0, 1.0, 2, 3]]}, "block ids must be ints"),
        ({"ids": [[0, 1, 2, 3], [4]]}, r"block ids for 1 engine group\(s\), got 2"),
        ({"ids": []}, "got 0"),
        ({"slot": 4}, "staging slot 4 out of range 0..3"),
        ({"slot": -1}, "staging slot -1 out of range"),
        ({"slot": True}, "staging slot True out of range"),
        ({"num_tokens": 0}, r"num_tokens must be an int in 1..16, got 0"),
        ({"num_tokens": 17}, "got 17"),
        ({"num_tokens": 2.0}, "got 2.0"),
    ],
)
@pytest.mark.parametrize("op", ["store_chunk", "retrieve_chunk"])
def test_bad_requests_raise_before_anything_is_written(op, kwargs, match):
    layers = make_layers(KVFormat.FLASH_ATTN, 2, nb=NB, bs=BS)
    with context(layers, layout_hints=LayoutHints(block_size=BS)) as ctx:
        ctx.store_chunk([[4, 5, 6, 7]], slot=3)  # make the staging non-trivial
        snap = snapshot(ctx, layers)
        kwargs = dict(kwargs)
        ids = kwargs.pop("ids", [[0, 1, 2, 3]])
        with pytest.raises(TransferError, match=match):
            getattr(ctx, op)(ids, **kwargs)
        assert_unchanged(ctx, layers, snap)


def test_retrieve_refuses_repeated_blocks_but_store_may_read_twice():
    layers = make_layers(KVFormat.MLA, 1, nb=NB, bs=BS)
    with context(layers) as ctx:
        ctx.store_chunk([[1, 1, 2, 3]])
        snap = snapshot(ctx, layers)
        with pytest.raises(TransferError, match="some repeat"):
            ctx.retrieve_chunk([[5, 6, 5, 7]])
        assert_unchanged(ctx, layers, snap)


def test_trimmed_window_ignores_repeats_outside_the_window():
    # vLLM hands out its null block (0) for blocks that left the window.
    ctx, _ = hybrid(True, False)
    with ctx:
        ctx.store_chunk([[0, 1, 2, 3], [0, 0, 6, 7]])
        ctx.retrieve_chunk([[8, 9, 10, 11], [0, 0, 4, 5]])
        with pytest.raises(TransferError, match="some repeat"):
            ctx.retrieve_chunk([[8, 9, 10, 11], [0, 0, 4, 4]])


def test_getters_reject_bad_indices():
    with context(make_layers(KVFormat.MLA, 1, nb=NB, bs=BS)) as ctx:
        for call, match in [
            (lambda: ctx.get_temp_kernel_group_buffer(4, 0), "staging slot 4"),
            (lambda: ctx.get_temp_kernel_group_buffer(0, 1), "kernel group 1 out of range 0..0"),
            (lambda: ctx.get_temp_object_group_buffer(0, 2), "object group 2 out of range"),
            (lambda: ctx.get_kernel_group_kv_pointers(-1), "kernel group -1"),
            (lambda: ctx.get_kernel_group_shape_dtype(-1, 0), "num_tokens must be a non-negative"),
            (lambda: ctx.calculate_num_blocks(3, 5), "kernel group 5"),
        ]:
            with pytest.raises(TransferError, match=match):
                call()


def test_ambiguous_layout_names_the_hint_and_closes_the_wrappers():
    layers = make_layers(KVFormat.FLASH_ATTN, 2, nb=NB, bs=BS)
    wrappers = [HeldWrapper.wrap(x) for x in layers]
    with pytest.raises(LayoutError, match=r"Pass LayoutHints\(kv_format=KVFormat.FLASH_ATTN or"):
        HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK))
    assert all(w.closed and w.releases == 1 for w in wrappers)


# -- lifetime ------------------------------------------------------------------------------------


def test_close_is_idempotent_closes_every_wrapper_and_refuses_later_transfers():
    layers = make_layers(KVFormat.MLA, 3, nb=NB, bs=BS)
    wrappers = [HeldWrapper.wrap(x) for x in layers]
    ctx = HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK))
    assert not any(w.closed for w in wrappers) and [w.opens for w in wrappers] == [1, 1, 1]
    ctx.close()
    ctx.close()
    assert ctx.closed and [w.releases for w in wrappers] == [1, 1, 1]
    with pytest.raises(TransferError, match="closed"):
        ctx.store_chunk([[0, 1, 2, 3]])
    with pytest.raises(TransferError, match="closed"):
        ctx.stage_block_ids([[0]])
    for getter in (ctx.get_temp_kernel_group_buffer, ctx.get_temp_object_group_buffer):
        with pytest.raises(TransferError, match="closed"):
            getter(0, 0)
    with pytest.raises(TransferError, match="closed"):
        ctx.get_kernel_group_kv_pointers(0)
    assert "closed" in repr(ctx)
    assert ctx.kv_tensors == []  # the layer views are dropped; the layout report stays
    assert ctx.report_status()["num_layers"] == 3 and len(ctx.report_status()["kernel_groups"]) == 1


def test_context_manager_closes_on_error():
    wrappers = [HeldWrapper.wrap(x) for x in make_layers(KVFormat.MLA, 2, nb=NB, bs=BS)]
    with (
        contextlib.suppress(RuntimeError),
        HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK)),
    ):
        raise RuntimeError("boom")
    assert all(w.closed for w in wrappers)


class OtherHeldWrapper(HeldWrapper):
    """A second wrapper class: the context reopens each class with its own to_tensors call."""

    wire_tag = "test.held-other/1"


def test_failed_reopen_closes_the_wrappers_it_tried_to_reopen_and_no_others():
    """One to_tensors call per class, in layer order: a failure closes that call's wrappers
    and those of the calls before it; a class not reached yet stays the caller's."""
    layers = make_layers(KVFormat.MLA, 5, nb=NB, bs=BS)
    wrappers = [HeldWrapper.wrap(x) for x in layers[:3]] + [OtherHeldWrapper.wrap(x) for x in layers[3:]]
    wrappers[1].fail_open = True
    with pytest.raises(OSError, match="cannot reopen wrapper"):
        HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK))
    assert [w.closed for w in wrappers] == [True, True, True, False, False]
    assert [w.opens for w in wrappers] == [1, 1, 0, 0, 0]


def test_each_wrapper_class_reopens_its_wrappers_with_one_call_in_layer_order(monkeypatch):
    layers = make_layers(KVFormat.MLA, 4, nb=NB, bs=BS)
    wrappers = [(HeldWrapper if i % 2 else OtherHeldWrapper).wrap(x) for i, x in enumerate(layers)]
    calls = []

    def to_tensors(cls, batch):
        calls.append((cls, [w.serial for w in batch]))
        return [w.to_tensor() for w in batch]

    monkeypatch.setattr(HeldWrapper, "to_tensors", classmethod(to_tensors))
    with HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK)) as ctx:
        assert [t.data_ptr() for t in ctx.kv_tensors] == [t.data_ptr() for t in layers]
    serials = [w.serial for w in wrappers]
    assert calls == [(OtherHeldWrapper, serials[0::2]), (HeldWrapper, serials[1::2])]


def test_to_tensors_returning_the_wrong_count_is_a_layout_error(monkeypatch):
    wrappers = [HeldWrapper.wrap(x) for x in make_layers(KVFormat.MLA, 3, nb=NB, bs=BS)]
    monkeypatch.setattr(HeldWrapper, "to_tensors", classmethod(lambda cls, batch: [batch[0].to_tensor()]))
    with pytest.raises(LayoutError, match=r"HeldWrapper\.to_tensors returned 1 tensors for 3 wrappers"):
        HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK))
    assert all(w.closed for w in wrappers)


def test_close_closes_every_wrapper_even_if_one_fails():
    wrappers = [HeldWrapper.wrap(x) for x in make_layers(KVFormat.MLA, 3, nb=NB, bs=BS)]
    ctx = HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK))
    wrappers[0].fail_close = True
    with pytest.raises(OSError, match="cannot release wrapper"):
        ctx.close()
    assert all(w.closed for w in wrappers) and [w.releases for w in wrappers] == [1, 1, 1]
    ctx.close()  # already closed: nothing more happens
    assert [w.releases for w in wrappers] == [1, 1, 1]


def test_init_failure_raises_its_own_error_when_cleanup_also_fails(caplog):
    wrappers = [HeldWrapper.wrap(x) for x in make_layers(KVFormat.FLASH_ATTN, 2, nb=NB, bs=BS)]
    wrappers[1].fail_close = True
    with pytest.raises(LayoutError, match="ambiguous"):
        HostContext(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK))
    assert all(w.closed for w in wrappers)
    assert "closing wrappers after a failed HostContext init failed" in caplog.text
    assert "cannot release wrapper" in caplog.text


def test_empty_list_wrong_device_and_missing_device_type_are_refused():
    cfg = CacheContextConfig(lmcache_tokens_per_chunk=CHUNK)
    with pytest.raises(LayoutError, match="non-empty"):
        HostContext([], cfg)
    meta = HeldWrapper.wrap(torch.empty(NB, BS, 8, device="meta"))
    with pytest.raises(LayoutError, match="serves 'cpu' tensors, got tensors on meta"):
        HostContext([meta], cfg)
    assert meta.closed
    mixed = [
        HeldWrapper.wrap(torch.empty(NB, BS, 8)),
        HeldWrapper.wrap(torch.empty(NB, BS, 8, device="meta")),
    ]
    with pytest.raises(LayoutError, match=r"one device, got \['cpu', 'meta'\]"):
        HostContext(mixed, cfg)
    assert all(w.closed for w in mixed)

    class NoType(BaseCacheContext):
        pass

    with pytest.raises(TypeError, match="has no device_type"):
        NoType([HeldWrapper.wrap(torch.empty(NB, BS, 8))], cfg)


# -- customization points --------------------------------------------------------------------------


class RecordingStream:
    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


class CustomContext(HostContext):
    """What a device backend overrides, recorded so the test can see each hook used."""

    def __init__(self, *args, **kwargs):
        self.events: list[str] = []
        self.staging_requests: list[int] = []
        super().__init__(*args, **kwargs)

    def allocate_staging(self, nbytes):
        self.staging_requests.append(nbytes)
        return torch.zeros(nbytes + 64, dtype=torch.uint8)

    def create_stream(self):
        return RecordingStream()

    @contextlib.contextmanager
    def stream_context(self):
        self.events.append("enter")
        yield
        self.events.append("exit")

    def store(self, plan):
        self.events.append(f"store slot={plan.slot} n={plan.num_tokens}")
        (part,) = plan.groups
        assert part.block_id_list == (2, 3, 4)
        assert part.block_ids.tolist() == [2, 3, 4] and part.num_tokens == 9
        assert part.buffer.data_ptr() == self.get_temp_kernel_group_buffer(plan.slot, 0).data_ptr()
        super().store(plan)

    def release(self):
        self.events.append("release")


def test_backend_hooks_are_used():
    layers = make_layers(KVFormat.MLA, 2, nb=NB, bs=BS)
    ctx = CustomContext(
        [HeldWrapper.wrap(x) for x in layers], CacheContextConfig(lmcache_tokens_per_chunk=CHUNK)
    )
    assert ctx.staging_requests == [ctx.report_status()["staging_bytes"]]
    ctx.store_chunk([[2, 3, 4]], slot=1, num_tokens=9)
    assert ctx.events == ["enter", "store slot=1 n=9", "exit"]
    want = chunk_rows(layers[0], KVFormat.MLA, [2, 3, 4], 0, 9)
    assert torch.equal(as_bytes(ctx.get_temp_kernel_group_buffer(1, 0)[:, 0, :9]), as_bytes(want))
    stream = ctx.stream
    ctx.close()
    assert stream.syncs == 1 and ctx.events[-1] == "release"


@pytest.mark.parametrize(
    "allocate",
    [
        lambda n: torch.empty(n, dtype=torch.float16),
        lambda n: torch.empty(n - 1, dtype=torch.uint8),
        lambda n: torch.empty(1, n, dtype=torch.uint8),
        lambda n: torch.empty(n + 1, dtype=torch.uint8)[1:],
    ],
    ids=["dtype", "short", "2-D", "misaligned"],
)
def test_bad_staging_allocation_is_a_backend_bug_and_closes_the_wrappers(allocate):
    class Bad(HostContext):
        def allocate_staging(self, nbytes):
            return allocate(nbytes)

    wrappers = [HeldWrapper.wrap(x) for x in make_layers(KVFormat.MLA, 1, nb=NB, bs=BS)]
    with pytest.raises(TypeError, match="must return a 1-D uint8 tensor"):
        Bad(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK))
    assert wrappers[0].closed


# -- property: any window, any chunk length, any format ----------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(BLOCK_FORMATS),
    window=st.one_of(st.none(), st.integers(1, 20)),
    num_tokens=st.integers(1, CHUNK),
    shared=st.booleans(),
    data=st.data(),
)
def test_round_trip_property(fmt, window, num_tokens, shared, data):
    layers = make_layers(fmt, 2, nb=NB, bs=BS, shared=shared, seed=num_tokens)
    n_ids = -(-num_tokens // BS)
    src = data.draw(st.permutations(range(NB)))[:n_ids]
    dst = data.draw(st.permutations(range(NB)))[:n_ids]
    infos = [EngineGroupInfo(layer_indices=[0, 1], block_size=BS, sliding_window=window)]
    with context(layers, engine_group_infos=infos, layout_hints=LayoutHints(kv_format=fmt)) as ctx:
        first = max(0, num_tokens - window) if window else 0
        want = [chunk_rows(x, fmt, src, first, num_tokens) for x in layers]
        ctx.store_chunk([src], num_tokens=num_tokens)
        buf = ctx.get_temp_kernel_group_buffer(0, 0)
        for i in range(2):
            assert torch.equal(as_bytes(buf[:, i, : num_tokens - first]), as_bytes(want[i]))
        before = [x.clone() for x in layers]
        ctx.retrieve_chunk([dst], num_tokens=num_tokens)
        for i, x in enumerate(layers):
            assert torch.equal(as_bytes(chunk_rows(x, fmt, dst, first, num_tokens)), as_bytes(want[i]))
            mask = _written_mask(x, fmt, dst, first, num_tokens)
            assert torch.equal(as_bytes(x[~mask]), as_bytes(before[i][~mask]))


def test_a_context_refuses_formats_it_does_not_claim_and_closes_the_wrappers():
    class NoMLA(HostContext):
        supported_kv_formats = (KVFormat.FLASH_ATTN, KVFormat.FLASHINFER)

    layers = make_layers(KVFormat.MLA, 2, nb=NB, bs=BS)
    wrappers = [HeldWrapper.wrap(x) for x in layers]
    hints = LayoutHints(kv_format=KVFormat.MLA)
    with pytest.raises(LayoutError, match=r"layer 0: NoMLA does not serve the mla format"):
        NoMLA(wrappers, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK, layout_hints=hints))
    assert all(w.closed for w in wrappers)
    ok = [HeldWrapper.wrap(x) for x in make_layers(KVFormat.FLASH_ATTN, 2, nb=NB, bs=BS)]
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN)
    with NoMLA(ok, CacheContextConfig(lmcache_tokens_per_chunk=CHUNK, layout_hints=hints)) as ctx:
        assert ctx.num_layers == 2

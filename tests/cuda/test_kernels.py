"""The fused Triton kernels against the torch path, byte for byte, for every layout.

Each case builds the same paged KV caches twice (same allocation shape, same random
bytes), one context that moves chunks with the kernels and one that moves them with the
base's torch ops, runs the same stores and retrieves on both, and compares every byte
of the staging buffer and of the engine's memory. Without a GPU the kernels run in
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``): the same kernel source,
every address computed as on the device, but executed by numpy. The ``cuda`` cases run
the compiled kernels on a GPU and print both paths' speed (never asserted).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_platform import (
    BaseCacheContext,
    CacheContextConfig,
    EngineGroupInfo,
    EngineType,
    KVFormat,
    LayoutHints,
)
from lmcache_platform_cuda import GPUCacheContext, _kernels
from support.cache import HeldWrapper, engine_kv
from support.cuda_fakes import InterpretedContext
from support.layouts import ORDERS, fill, planes

triton = pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run here")

NB, BS, H, D, L = 12, 4, 2, 8, 3
CHUNK = 2 * BS
OLDER = [
    KVFormat.FLASH_ATTN,
    KVFormat.FLASH_ATTN_HND,
    KVFormat.FLASHINFER,
    KVFormat.FLASHINFER_HND,
    KVFormat.MLA,
]
CUDA = pytest.mark.cuda
HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[CUDA, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]


class HeldCudaWrapper(HeldWrapper):
    device_type = "cuda"
    wire_tag = "test.held-cuda/1"


def torch_path(cls: type[BaseCacheContext]) -> type[BaseCacheContext]:
    """``cls`` with the base's generic store and retrieve (the reference)."""

    class TorchPath(cls):  # type: ignore[valid-type, misc]
        def store(self, plan: Any) -> None:
            BaseCacheContext.store(self, plan)

        def retrieve(self, plan: Any) -> None:
            BaseCacheContext.retrieve(self, plan)

    return TorchPath


def on_cuda(item: pytest.Item) -> bool:
    """Whether a case runs on a GPU: its ``device`` parameter, else its ``cuda`` marker."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "device" in callspec.params:
        return bool(callspec.params["device"] == "cuda")
    return item.get_closest_marker("cuda") is not None


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Triton's interpreter for the CPU cases only: a GPU case runs the compiled kernel."""
    if on_cuda(request.node):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("LMCACHE_PLATFORM_CUDA_KERNELS", raising=False)


def raw_bytes(layers: list[Any]) -> list[torch.Tensor]:
    out, seen = [], set()
    for t in (t for entry in planes(layers) for t in entry):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            out.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu())
    return out


Builder = Callable[[str], list[Any]]


def engine(
    fmt: KVFormat,
    order: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    d: int = D,
    h: int = H,
    nb: int = NB,
    bs: int = BS,
    separate: bool = False,
) -> Builder:
    """Layers as the engine of ``fmt`` allocates them (``separate``: one allocation a layer)."""

    def build(device: str) -> list[Any]:
        layers = engine_kv(fmt, L, nb, bs, h, d, dtype, device=device, order=order)
        if separate:
            return [tuple(x.clone() for x in e) if isinstance(e, tuple) else e.clone() for e in layers]
        return list(layers)

    return build


class Pair:
    """The same caches twice, a kernel context and a torch-path context over them."""

    def __init__(self, build: Builder, device: str, **config: Any) -> None:
        config.setdefault("lmcache_tokens_per_chunk", CHUNK)
        cls: type[GPUCacheContext] = InterpretedContext if device == "cpu" else GPUCacheContext
        wrapper = HeldWrapper if device == "cpu" else HeldCudaWrapper
        self.layers = [build(device), build(device)]
        for layers in self.layers:
            fill(layers, seed=11)
        self.contexts = [
            c([self.entry(wrapper, e) for e in layers], CacheContextConfig(**config))
            for c, layers in zip((cls, torch_path(cls)), self.layers, strict=True)
        ]
        assert isinstance(self.contexts[0], GPUCacheContext)
        self.kernels: GPUCacheContext = self.contexts[0]
        for ctx in self.contexts:  # staging starts uninitialised: the same bytes on both sides
            for og in range(ctx.kv_layer_groups_manager.num_object_groups):
                for slot in range(ctx.max_batch_size):
                    ctx.get_temp_object_group_buffer(slot, og).fill_(0xA5)
        if device == "cuda":  # the fills ran on the default stream, the transfers run on the contexts'
            torch.cuda.synchronize()

    @staticmethod
    def entry(wrapper: type[HeldWrapper], e: Any) -> Any:
        return tuple(wrapper.wrap(t) for t in e) if isinstance(e, tuple) else wrapper.wrap(e)

    def both(self, op: Callable[[BaseCacheContext], object]) -> None:
        """Run ``op`` on both contexts and compare staging and KV memory, byte for byte."""
        kernels, reference = self.contexts
        before = kernels.transfer_kernels().launches if isinstance(kernels, GPUCacheContext) else 0
        for ctx in self.contexts:
            with ctx.stream_context():
                op(ctx)
            ctx.synchronize()
        assert isinstance(kernels, GPUCacheContext)
        assert kernels.transfer_kernels().launches > before, kernels.transfer_kernels().reason
        for og in range(kernels.kv_layer_groups_manager.num_object_groups):
            for slot in range(kernels.max_batch_size):
                a = kernels.get_temp_object_group_buffer(slot, og).cpu()
                b = reference.get_temp_object_group_buffer(slot, og).cpu()
                assert torch.equal(a, b), f"staging slot {slot}, object group {og} differs"
        for i, (a, b) in enumerate(zip(*map(raw_bytes, self.layers), strict=True)):
            assert torch.equal(a, b), f"KV storage {i} differs at {int((a != b).nonzero()[0])}"

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def round_trip(
    pair: Pair, src: list[list[int]], dst: list[list[int]], num_tokens: int, slot: int = 0
) -> None:
    pair.both(lambda c: c.store_chunk(src, slot=slot, num_tokens=num_tokens))
    pair.both(lambda c: c.retrieve_chunk(dst, slot=slot, num_tokens=num_tokens))


#: Every layout of the layout model: current vLLM in its six physical orders, its MLA, the
#: older per-layer formats, SGLang's pools (pair and MLA).
LAYOUTS: dict[str, tuple[Builder, dict[str, Any]]] = {
    **{f"vllm-{o}": (engine(KVFormat.VLLM, o), {}) for o in ORDERS},
    "vllm_mla": (engine(KVFormat.VLLM_MLA, "LBNHC", d=24, h=1), {"layout_hints": LayoutHints(head_size=24)}),
    **{f.value: (engine(f), {"layout_hints": LayoutHints(kv_format=f)}) for f in OLDER},
    "flash_attn-separate": (
        engine(KVFormat.FLASH_ATTN, separate=True),
        {"layout_hints": LayoutHints(kv_format=KVFormat.FLASH_ATTN)},
    ),
    "sglang": (
        engine(KVFormat.SGLANG),
        {"engine_group_infos": (EngineGroupInfo(layer_indices=range(L), block_size=BS),)},
    ),
    "sglang_mla": (
        engine(KVFormat.SGLANG_MLA, d=24, h=1),
        {"engine_type": EngineType.SGLANG, "layout_hints": LayoutHints(block_size=BS)},
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_matches_the_torch_path(layout: str, chunk_format: str, device: str) -> None:
    build, config = LAYOUTS[layout]
    with Pair(build, device, chunk_format=chunk_format, **config) as pair:
        # A full chunk from shuffled blocks, into others; then a partial one (a block and a
        # part in "tokens", one whole block in "blocks") in another slot.
        round_trip(pair, [[7, 2]], [[4, 9]], CHUNK)
        partial = BS + 3 if chunk_format == "tokens" else BS
        n = -(-partial // BS)
        round_trip(pair, [[5, 0][:n]], [[11, 1][:n]], partial, slot=1)
        status = pair.contexts[0].report_status()["transfers"]
        assert status == {"path": "triton", "reason": None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
@pytest.mark.parametrize("layout", ["vllm-LBNHC", "vllm-BHLNC", "flash_attn", "sglang"])
def test_retrieve_skips_blocks(layout: str, chunk_format: str, device: str) -> None:
    build, config = LAYOUTS[layout]
    with Pair(build, device, chunk_format=chunk_format, lmcache_tokens_per_chunk=4 * BS, **config) as pair:
        pair.both(lambda c: c.store_chunk([[3, 8, 1, 6]]))
        pair.both(lambda c: c.retrieve_chunk([[-1, 5, -1, 10]]))  # two parts, around null blocks
        pair.both(
            lambda c: c.retrieve_chunk(
                [[2, -1, -1, 0]], num_tokens=4 * BS - 1 if chunk_format == "tokens" else 4 * BS
            )
        )


DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["vllm", "flashinfer_hnd", "mla"])
def test_dtypes_and_odd_head_sizes(layout: str, dtype: torch.dtype, device: str) -> None:
    # Head sizes whose rows are an odd number of bytes move in narrower words.
    if device == "cuda" and dtype not in (torch.float8_e4m3fn, torch.float32):
        pytest.skip("on a GPU two dtypes cover the word types (each case compiles kernels)")
    fmt = {"vllm": KVFormat.VLLM, "flashinfer_hnd": KVFormat.FLASHINFER_HND, "mla": KVFormat.MLA}[layout]
    for d in (D, 3):
        order = "LBNHC" if fmt is KVFormat.VLLM else None
        with Pair(
            engine(fmt, order, dtype=dtype, d=d), device, layout_hints=LayoutHints(kv_format=fmt, head_size=d)
        ) as pair:
            round_trip(pair, [[7, 2]], [[4, 9]], CHUNK - 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
@pytest.mark.parametrize("full_sw_kv", [False, True])
def test_sliding_window_groups(chunk_format: str, full_sw_kv: bool, device: str) -> None:
    # One allocation, two engine groups: a window of one block (only the chunk's last block
    # kept unless full_sw_kv) and full attention; separate object groups.
    def build(dev: str) -> list[Any]:
        layers: list[Any] = engine(KVFormat.VLLM, "LBNHC")(dev)
        return layers

    infos = (
        EngineGroupInfo(layer_indices=[0], block_size=BS, sliding_window=BS),
        EngineGroupInfo(layer_indices=[1, 2], block_size=BS),
    )
    with Pair(
        build,
        device,
        chunk_format=chunk_format,
        engine_group_infos=infos,
        full_sw_kv=full_sw_kv,
        lmcache_tokens_per_chunk=3 * BS,
    ) as pair:
        pair.both(lambda c: c.store_chunk([[1, 2, 3], [4, 5, 6]]))
        pair.both(lambda c: c.retrieve_chunk([[7, 8, 9], [10, 11, 0]]))
        pair.both(lambda c: c.retrieve_chunk([[-1, 8, 2], [-1, 3, 1]], num_tokens=3 * BS))
        if chunk_format == "tokens":
            pair.both(lambda c: c.store_chunk([[1, 2, 3], [4, 5, 6]], num_tokens=2 * BS + 1, slot=1))
            pair.both(lambda c: c.retrieve_chunk([[9, 10, 11], [6, 7, 8]], num_tokens=2 * BS + 1, slot=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
def test_kernel_blocks_smaller_than_the_engine_block(chunk_format: str, device: str) -> None:
    build = engine(KVFormat.VLLM, "LBNHC", nb=2 * NB)
    infos = (EngineGroupInfo(layer_indices=range(L), block_size=2 * BS),)
    with Pair(
        build, device, chunk_format=chunk_format, engine_group_infos=infos, lmcache_tokens_per_chunk=4 * BS
    ) as pair:
        round_trip(pair, [[3, 6]], [[1, 9]], 4 * BS)


def test_the_kernel_itself_writes_no_block_of_id_minus_one() -> None:
    # Plans never carry -1 (a retrieve splits around null blocks); the kernel masks it anyway.
    from lmcache_platform import ChunkTransfer, GroupTransfer

    build, config = LAYOUTS["vllm-LBNHC"]
    with Pair(build, "cpu", **config) as pair:
        pair.both(lambda c: c.store_chunk([[7, 2]]))
        kernels, reference = pair.kernels, pair.contexts[1]
        part = GroupTransfer(
            0, 0, CHUNK, torch.tensor([-1, 5]), (-1, 5), kernels.get_temp_kernel_group_buffer(0, 0)
        )
        assert kernels.transfer_kernels().run(ChunkTransfer(0, CHUNK, (part,)), store=False)
        reference.retrieve_chunk([[-1, 5]])
        for a, b in zip(*map(raw_bytes, pair.layers), strict=True):
            assert torch.equal(a, b)


def test_host_tensors_move_in_place_through_the_kernels() -> None:
    # read_chunk/write_chunk on a host context: the parts' buffers are the caller's tensors.
    build, config = LAYOUTS["vllm-LBHNC"]
    with Pair(build, "cpu", **config) as pair:
        chunks = [ctx.allocate_chunk() for ctx in pair.contexts]
        ops = iter(chunks)
        pair.both(lambda c: c.read_chunk([[6, 1]], next(ops)))
        assert all(torch.equal(a, b) for a, b in zip(*chunks, strict=True))
        for t in chunks[0]:
            t.copy_(
                torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
            )
        for a, b in zip(*chunks, strict=True):
            b.copy_(a)
        ops = iter(chunks)
        pair.both(lambda c: c.write_chunk([[0, 10]], next(ops), num_tokens=CHUNK - 2))


def test_a_strided_last_dim_moves_element_by_element() -> None:
    # Head-size elements two apart (a permuted engine view): no wide word fits; the
    # kernel moves the group's own elements.
    def build(device: str) -> list[Any]:
        whole = torch.empty((L, 2, NB, BS, D, H), dtype=torch.bfloat16, device=device)
        return list(whole.transpose(-1, -2).unbind(0))  # [2, NB, BS, H, D], D stride H

    with Pair(build, "cpu", layout_hints=LayoutHints(kv_format=KVFormat.FLASH_ATTN)) as pair:
        round_trip(pair, [[7, 2]], [[4, 9]], CHUNK - 3)
        launch = pair.kernels.transfer_kernels()._groups[0]
        assert not isinstance(launch, str) and launch.width == 2 and launch.strides[3] == H


def test_offsets_past_2_to_the_31_words_are_computed_in_int64() -> None:
    # A unit's third plane 2**31 + 64 words from its first (a large cache, heads outermost):
    # in int32 the offset wraps negative. The memory is a sparse mapping: two pages touched.
    import mmap

    stride = (1 << 30) + 32
    region = mmap.mmap(-1, 2 * stride + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    paged = torch.frombuffer(region, dtype=torch.uint8)
    for plane in range(3):
        paged[plane * stride : plane * stride + 4] = torch.arange(4, dtype=torch.uint8) + 10 * plane + 1
    staged = torch.zeros(16, dtype=torch.uint8)
    launch = _kernels._launcher("cpu")
    assert launch is not None
    launch[(1, 1)](
        paged,
        staged,
        torch.zeros(2, dtype=torch.int64),  # one unit: at the anchor, at the buffer's start
        torch.zeros(1, dtype=torch.int64),  # block 0
        0,
        1,
        0,
        0,
        0,
        stride,
        1,
        ROWS=1,
        ROW_TILE=1,
        OUTER=3,
        INNER=4,
        ELEM_TILE=16,
        VEC=1,
        STORE=True,
    )
    assert staged[:12].tolist() == [1, 2, 3, 4, 11, 12, 13, 14, 21, 22, 23, 24]
    del paged
    region.close()


# -- where the kernels do not run --------------------------------------------------------------


def kernel_context(**env: str) -> tuple[GPUCacheContext, list[Any]]:
    layers = engine(KVFormat.VLLM, "LBNHC")("cpu")
    fill(layers, seed=2)
    ctx = InterpretedContext(
        [HeldWrapper.wrap(t) for t in layers], CacheContextConfig(lmcache_tokens_per_chunk=CHUNK)
    )
    return ctx, layers


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (
            lambda mp: mp.setenv("LMCACHE_PLATFORM_CUDA_KERNELS", "torch"),
            "LMCACHE_PLATFORM_CUDA_KERNELS=torch",
        ),
        (lambda mp: mp.delenv("TRITON_INTERPRET"), "no triton kernel for cpu tensors"),
        (lambda mp: mp.setattr(_kernels, "triton", None), "triton is not installed"),
    ],
    ids=["operator-chose-torch", "cpu-without-interpreter", "no-triton"],
)
def test_fallback_moves_with_torch_and_says_why(
    monkeypatch: pytest.MonkeyPatch, setup: Any, reason: str
) -> None:
    setup(monkeypatch)
    ctx, layers = kernel_context()
    with ctx:
        before = raw_bytes(layers)[0].clone()
        ctx.store_chunk([[3, 4]])
        ctx.retrieve_chunk([[5, 6]])
        kernels = ctx.transfer_kernels()
        assert kernels.launches == 0 and kernels.reason is not None and kernels.reason.startswith(reason)
        assert ctx.report_status()["transfers"]["path"] == "torch"
        after = raw_bytes(layers)[0]
        assert not torch.equal(before, after)  # the torch path moved the chunk
    assert ctx._kernels is None  # close dropped the tables and views


def test_an_unknown_kernels_choice_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_platform import EnvironmentValueError

    monkeypatch.setenv("LMCACHE_PLATFORM_CUDA_KERNELS", "cutlass")
    # Refused when the context is made (a server's registration), not in its first transfer.
    with pytest.raises(
        EnvironmentValueError, match=r"LMCACHE_PLATFORM_CUDA_KERNELS='cutlass'.*triton, torch"
    ):
        kernel_context()


def test_a_failing_first_launch_falls_back_without_moving_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, _ = kernel_context()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ptxas not found")

    with ctx:
        kernels = ctx.transfer_kernels()
        monkeypatch.setattr(kernels, "_one", broken)
        ctx.store_chunk([[3, 4]])  # the torch path stored it
        assert kernels.reason == "the triton kernel failed to launch: RuntimeError: ptxas not found"
        assert ctx.report_status()["transfers"]["path"] == "torch"


def test_a_failing_later_launch_falls_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # A launch after the first may compile again (a buffer of another alignment): covered too.
    build, config = LAYOUTS["vllm-LBNHC"]
    with Pair(build, "cpu", **config) as pair:
        pair.both(lambda c: c.store_chunk([[7, 2]]))
        kernels = pair.kernels.transfer_kernels()

        def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("recompile failed")

        monkeypatch.setattr(kernels, "_one", broken)
        for ctx in pair.contexts:  # the same kernel group and direction as the launch before
            ctx.store_chunk([[4, 9]])
        assert kernels.reason == "the triton kernel failed to launch: RuntimeError: recompile failed"
        for og in range(pair.kernels.kv_layer_groups_manager.num_object_groups):
            a, b = (c.get_temp_object_group_buffer(0, og) for c in pair.contexts)
            assert torch.equal(a, b)


# -- compiled when the context is made ---------------------------------------------------------


def test_every_kernel_is_launched_once_each_way_when_the_context_is_made_moving_nothing() -> None:
    layers = engine(KVFormat.FLASH_ATTN, separate=True)("cpu")
    fill(layers, seed=5)
    before = [t.clone() for t in raw_bytes(layers)]
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN)
    config = CacheContextConfig(lmcache_tokens_per_chunk=CHUNK, layout_hints=hints)
    with InterpretedContext([HeldWrapper.wrap(t) for t in layers], config) as ctx:
        kernels = ctx.transfer_kernels()
        groups = ctx.kv_layer_groups_manager.num_kernel_groups
        assert kernels.launches == 2 * groups and kernels.reason is None  # both directions, no transfer yet
        assert ctx.report_status()["transfers"] == {"path": "triton", "reason": None}
        views = [ctx.get_temp_object_group_buffer(0, og) for og in range(len(ctx.chunk_nbytes))]
        for view in views:
            view.fill_(0xA5)
        kernels.warm(ctx)  # again, with known staging bytes: every access is masked
        assert kernels.launches == 4 * groups
        assert all(bool((view == 0xA5).all()) for view in views)
        assert all(torch.equal(a, b) for a, b in zip(before, raw_bytes(layers), strict=True))


class FakeJit:
    """A kernel whose compile is slow and cached per specialization, as triton's JIT is,
    without triton's (absent) lock: it counts compiles per specialization."""

    def __init__(self) -> None:
        self.compiled: dict[tuple[Any, ...], int] = {}
        self.cache: set[tuple[Any, ...]] = set()

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            key = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (int, bool))))
            if key not in self.cache:
                time.sleep(0.3)  # a cold compile, long enough for another thread to arrive
                self.compiled[key] = self.compiled.get(key, 0) + 1
                self.cache.add(key)

        return launch


def test_two_contexts_made_at_once_compile_each_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeJit()
    monkeypatch.setattr(_kernels, "_launcher", lambda device_type: fake)
    made: list[GPUCacheContext] = []
    errors: list[BaseException] = []

    def make() -> None:
        try:
            made.append(kernel_context()[0])
        except BaseException as exc:  # reported below, not lost on the thread
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(2)]  # a TP=2 engine's two registrations
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors and len(made) == 2
        assert fake.compiled and set(fake.compiled.values()) == {1}, fake.compiled
        assert len(fake.compiled) == 2  # one kernel group: a gather and a scatter
    finally:
        for ctx in made:
            ctx.close()


def test_a_failed_build_falls_back_logs_once_and_is_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # On a GPU host without a C compiler triton cannot build its launcher (gpu-check runs that
    # for real, CC=/bin/false); here the launch raises what such a build raises.
    def no_compiler(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "Failed to build the launcher: command '/bin/false' returned non-zero exit status 1"
        )

    monkeypatch.setattr(_kernels.TritonTransfers, "_one", no_compiler)
    monkeypatch.setattr(_kernels, "FALLBACKS", __import__("collections").Counter())
    with caplog.at_level(logging.DEBUG, logger=_kernels.__name__):
        contexts = [kernel_context() for _ in range(2)]
    try:
        why = "the triton kernel failed to build: RuntimeError: Failed to build the launcher"
        for ctx, layers in contexts:
            transfers = ctx.report_status()["transfers"]
            assert transfers["path"] == "torch" and transfers["reason"].startswith(why)
            before = raw_bytes(layers)[0].clone()
            ctx.store_chunk([[3, 4]])
            ctx.retrieve_chunk([[5, 6]])  # the torch path moves the chunk
            assert not torch.equal(before, raw_bytes(layers)[0])
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and why in r.getMessage()]
        assert len(warnings) == 1  # once per process, not per context
        assert sum(n for reason, n in _kernels.FALLBACKS.items() if reason.startswith(why)) == 2
    finally:
        for ctx, _ in contexts:
            ctx.close()


class _BrokenTriton(importlib.abc.MetaPathFinder):
    """An install whose ``import triton`` fails with something other than ImportError."""

    def find_spec(self, fullname: str, *args: object) -> None:
        if fullname == "triton" or fullname.startswith("triton."):
            raise RuntimeError("libcuda.so: cannot open shared object file")


def test_a_triton_that_fails_to_import_leaves_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTriton(), *sys.meta_path])
    spec = importlib.util.spec_from_file_location(_kernels.__name__, _kernels.__file__)
    assert spec is not None and spec.loader is not None
    broken = importlib.util.module_from_spec(spec)
    with caplog.at_level(logging.WARNING, logger=_kernels.__name__):
        spec.loader.exec_module(broken)
    why = "triton failed to import: RuntimeError: libcuda.so: cannot open shared object file"
    assert broken.triton is None
    assert why == broken._UNAVAILABLE
    assert why in caplog.text
    monkeypatch.setitem(sys.modules, _kernels.__name__, broken)  # what the context imports
    ctx, _ = kernel_context()
    with ctx:
        ctx.store_chunk([[3, 4]])
        assert ctx.report_status()["transfers"] == {"path": "torch", "reason": why}


def test_the_cuda_kernel_is_compiled_even_under_the_interpreter() -> None:
    # TRITON_INTERPRET=1 is set here (the CPU cases); a CUDA launcher must not be interpreted:
    # the interpreter copies each tensor's own storage, and the kernel reaches other layers
    # through offsets from the anchor. Block ids come at any alignment: no specialization.
    from triton.runtime.jit import JITFunction

    launcher = _kernels._launcher("cuda")
    assert isinstance(launcher, JITFunction)
    params = {p.name: p for p in launcher.params}
    assert params["ids"].do_not_specialize_on_alignment
    assert all(params[name].do_not_specialize for name in _kernels._PART_ARGS)


@CUDA
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.skipif(
    os.environ.get("CC") != "/bin/false",
    reason="scripts/gpu-check runs it alone with CC=/bin/false and a fresh TRITON_CACHE_DIR",
)
def test_without_a_c_compiler_chunks_still_move_and_the_context_says_how(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # triton builds its launcher with the host's C compiler; without one the context falls
    # back to the torch path when it is made, says why, and logs it once.
    build, config = LAYOUTS["vllm-LBNHC"]
    with caplog.at_level(logging.WARNING, logger=_kernels.__name__), Pair(build, "cuda", **config) as pair:
        for ctx in pair.contexts:
            with ctx.stream_context():
                ctx.store_chunk([[7, 2]])
                ctx.retrieve_chunk([[4, 9]])
            ctx.synchronize()
        kernels = pair.contexts[0]
        for og in range(kernels.kv_layer_groups_manager.num_object_groups):
            a, b = (c.get_temp_object_group_buffer(0, og).cpu() for c in pair.contexts)
            assert torch.equal(a, b)
        for a, b in zip(*map(raw_bytes, pair.layers), strict=True):
            assert torch.equal(a, b)
        transfers = kernels.report_status()["transfers"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if transfers["path"] == "torch":
        assert transfers["reason"].startswith(("the triton kernel failed to build", "no triton kernel"))
        assert len(warned) == 1 and transfers["reason"] in warned[0]  # two contexts, one warning
    with capsys.disabled():
        print(f"\nno C compiler: transfers take the {transfers['path']} path ({transfers['reason']})")


# -- on a GPU: speed of both paths, printed ------------------------------------------------------


#: The benchmark model's sizes (8 heads of 128, or a 576-wide latent; blocks of 16, 256-token chunks).
GPU_MODEL: dict[str, tuple[Builder, dict[str, Any]]] = {
    "vllm-LBNHC": (engine(KVFormat.VLLM, "LBNHC", d=128, h=8, nb=64, bs=16), {}),
    "vllm_mla": (
        engine(KVFormat.VLLM_MLA, "LBNHC", d=576, h=1, nb=64, bs=16),
        {"layout_hints": LayoutHints(head_size=576)},
    ),
    "flash_attn": (
        engine(KVFormat.FLASH_ATTN, d=128, h=8, nb=64, bs=16, separate=True),
        {"layout_hints": LayoutHints(kv_format=KVFormat.FLASH_ATTN)},
    ),
    "mla": (
        engine(KVFormat.MLA, d=576, nb=64, bs=16, separate=True),
        {"layout_hints": LayoutHints(kv_format=KVFormat.MLA)},
    ),
}


@CUDA
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
@pytest.mark.parametrize("layout", list(GPU_MODEL))
def test_gpu_speed_of_both_paths_is_printed(
    layout: str, chunk_format: str, capsys: pytest.CaptureFixture[str]
) -> None:
    build, config = GPU_MODEL[layout]
    with Pair(build, "cuda", chunk_format=chunk_format, lmcache_tokens_per_chunk=256, **config) as pair:
        ids = [list(range(3, 19))]
        pair.both(lambda c: c.store_chunk(ids))  # compiles, and checks the bytes once more
        figures = []
        for ctx in pair.contexts:
            nbytes = sum(ctx.chunk_nbytes)
            for op in (ctx.store_chunk, ctx.retrieve_chunk):
                ctx.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    op(ids)
                ctx.synchronize()
                figures.append(50 * nbytes / (time.perf_counter() - t0) / 1e9)
        with capsys.disabled():
            print(
                f"\n{layout} ({chunk_format}): kernel store {figures[0]:.1f} GB/s, retrieve {figures[1]:.1f} GB/s; "
                f"torch path store {figures[2]:.1f} GB/s, retrieve {figures[3]:.1f} GB/s (host-timed)"
            )

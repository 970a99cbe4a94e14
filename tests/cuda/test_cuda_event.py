"""``CudaEvent``: the cuda backend's device events (the hook, handle checks, and on a GPU, ordering).

The first tests run anywhere. The ``cuda``-marked ones need an NVIDIA GPU and skip cleanly
without one: the engine (this process) delays its stream with a spin kernel, then writes
the blocks a put reads; the server process's copies must wait for the engine's event, or
they would read the blocks as they were before the write. A get's writes likewise wait
for the kernels the engine queued before it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import lmcache_platform
from lmcache_platform import TransferError
from lmcache_platform_cuda import CudaEvent, _plugin
from lmcache_platform_cuda._event import HANDLE_BYTES, RING
from support.cache import engine_views

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 4, 64, 16, 8, 128
CHUNK = 4 * BLOCK
SPIN_CYCLES = 500_000_000  # about a quarter of a second of one SM, ahead of the write


def test_the_hook_gives_cuda_events_for_cuda_only() -> None:
    assert _plugin.lmcache_platform_device_event_class("cuda") is CudaEvent
    assert _plugin.lmcache_platform_device_event_class("cpu") is None
    assert CudaEvent.device_type == "cuda"


@pytest.mark.parametrize("handle", [b"", b"x" * (HANDLE_BYTES - 1), b"x" * (HANDLE_BYTES + 1)])
def test_a_handle_of_the_wrong_size_is_refused_before_the_driver_sees_it(handle: bytes) -> None:
    with pytest.raises(
        TransferError, match=f"a CUDA event handle is {HANDLE_BYTES} bytes, got {len(handle)}"
    ):
        CudaEvent.open(handle, torch.device("cuda", 0))


@pytest.mark.cuda
@needs_gpu
def test_recording_cycles_through_a_few_reused_events() -> None:
    device = torch.device("cuda", 0)
    handles = [lmcache_platform.record_event(device) for _ in range(2 * RING)]
    assert all(isinstance(h, bytes) and len(h) == HANDLE_BYTES for h in handles)
    assert handles[:RING] == handles[RING:]  # the same events again: a server opens each once


@pytest.fixture
def engine() -> Iterator[list[torch.Tensor]]:
    tensors = engine_views(LAYERS, BLOCKS, BLOCK, HEADS, HEAD, device="cuda", order="LBNHC")
    for v in tensors:
        v.zero_()
    torch.cuda.synchronize()
    yield tensors


def key(i: int) -> bytes:
    return i.to_bytes(4, "big").ljust(32, b"e")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("chunk_format", ["tokens", "blocks"])
def test_the_server_orders_its_copies_after_the_engines_kernels(
    engine: list[torch.Tensor], chunk_format: str
) -> None:
    from lmcache_platform.server import ServerClient, ServerProcess, cache_namespace

    src, dst = [3, 9, 4, 20], [30, 31, 40, 41]
    ns = cache_namespace(
        model=f"events-{chunk_format}",
        kv_layout="vllm LBNHC",
        dtype="float16",
        block_size=BLOCK,
        chunk_size=CHUNK,
    )
    wrappers = lmcache_platform.wrap_kv_caches(engine)
    try:
        with ServerProcess() as proc, ServerClient(proc.socket_path, timeout=120) as c:
            ctx = c.register(
                wrappers, namespace=ns, lmcache_tokens_per_chunk=CHUNK, chunk_format=chunk_format
            ).context
            # The engine's stream: a long spin, then the write a put must see.
            torch.cuda._sleep(SPIN_CYCLES)
            for v in engine:
                v[src] = 7.0
            event = lmcache_platform.record_event("cuda")
            assert event is not None
            assert c.put(ctx, [(key(0), [src])], event=event).stored == 1  # the server's reads wait
            # And a get must land after what the engine queued before it (a zeroing here).
            torch.cuda._sleep(SPIN_CYCLES)
            for v in engine:
                v[dst] = -1.0
            event = lmcache_platform.record_event("cuda")
            assert c.get(ctx, [(key(0), [dst])], event=event).retrieved == 1
            torch.cuda.synchronize()
            for v in engine:
                assert bool((v[dst] == 7.0).all()), (
                    "the server read before the write, or wrote before the zeroing"
                )
    finally:
        for w in wrappers:
            w.close()

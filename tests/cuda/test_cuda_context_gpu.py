"""``GPUCacheContext`` on a real GPU, built through ``create_cache_context`` in a peer.

Needs an NVIDIA GPU (``cuda`` marker; skipped cleanly without one). The test
process allocates paged KV caches in every supported format and wraps them with
either IPC kind; a spawned peer builds the context, stores a chunk from some
blocks and retrieves it into others. The test then checks every byte: the target
blocks hold the source tokens, and nothing else changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_platform import DeviceIPCWrapper, KVFormat, wire
from lmcache_platform_cuda import CudaIPCWrapper, RawCudaIPCWrapper
from support.cache import engine_kv
from support.cuda_workers import PeerHandle, pattern
from support.gpu import NEEDS_GPU

pytestmark = NEEDS_GPU
KINDS = [CudaIPCWrapper, RawCudaIPCWrapper]
LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 24, 16, 4, 64
TOKENS = 4 * BLOCK  # one chunk spans four blocks

#: format -> (layer shape, view that puts [block, token] first)
FORMATS: dict[KVFormat, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]] = {
    KVFormat.FLASH_ATTN: ((2, BLOCKS, BLOCK, HEADS, HEAD), lambda t: t.permute(1, 2, 0, 3, 4)),
    KVFormat.FLASH_ATTN_HND: ((2, BLOCKS, HEADS, BLOCK, HEAD), lambda t: t.permute(1, 3, 0, 2, 4)),
    KVFormat.FLASHINFER: ((BLOCKS, 2, BLOCK, HEADS, HEAD), lambda t: t.permute(0, 2, 1, 3, 4)),
    KVFormat.FLASHINFER_HND: ((BLOCKS, 2, HEADS, BLOCK, HEAD), lambda t: t.permute(0, 3, 1, 2, 4)),
    KVFormat.MLA: ((BLOCKS, BLOCK, HEAD), lambda t: t),
    # Current vLLM on GPUs: [B, H, N, 2D] views of one allocation in flash-attention's
    # LBNHC order (tokens before heads in memory), and MLA's [B, 1, N, latent].
    KVFormat.VLLM: ((BLOCKS, HEADS, BLOCK, 2 * HEAD), lambda t: t.permute(0, 2, 1, 3)),
    KVFormat.VLLM_MLA: ((BLOCKS, 1, BLOCK, HEAD), lambda t: t[:, 0]),
}
MLA_FORMATS = (KVFormat.MLA, KVFormat.VLLM_MLA)


def spec(fmt: KVFormat) -> dict[str, Any]:
    return {"tokens": TOKENS, "format": fmt.value, "block_size": BLOCK, "heads": HEADS}


def caches(fmt: KVFormat, dtype: torch.dtype) -> list[torch.Tensor]:
    shape, _ = FORMATS[fmt]
    if fmt in (KVFormat.VLLM, KVFormat.VLLM_MLA):
        views = engine_kv(fmt, LAYERS, BLOCKS, BLOCK, HEADS, HEAD, dtype, device="cuda", order="LBNHC")
        layers = [v for v in views if isinstance(v, torch.Tensor)]
        assert [tuple(v.shape) for v in layers] == [shape] * LAYERS
    else:
        layers = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(LAYERS)]
    for i, t in enumerate(layers):
        t.copy_(pattern(t, seed=100 + i))
    torch.cuda.synchronize()
    return layers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def expected_after(
    before: torch.Tensor, fmt: KVFormat, src: list[int], dst: list[int], num_tokens: int
) -> torch.Tensor:
    """``before`` with the first ``num_tokens`` tokens of ``src`` copied into ``dst``."""
    out = before.clone()
    by_token, src_tokens = FORMATS[fmt][1](out), FORMATS[fmt][1](before)
    for i in range(num_tokens):
        by_token[dst[i // BLOCK], i % BLOCK] = src_tokens[src[i // BLOCK], i % BLOCK]
    return out


def wrap_all(kind: type[DeviceIPCWrapper], layers: list[torch.Tensor]) -> str:
    return wire.encode([kind.wrap(t) for t in layers]).hex()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: f.value)
def test_store_then_retrieve_is_bit_exact(
    peer: PeerHandle, fmt: KVFormat, kind: type[DeviceIPCWrapper]
) -> None:
    dtype = torch.float32 if fmt in MLA_FORMATS else torch.bfloat16
    layers = caches(fmt, dtype)
    info = peer.call("context", "ctx", wrap_all(kind, layers), spec(fmt))
    assert info["type"] == "GPUCacheContext" and info["device"] == "cuda:0"
    per_token = (1 if fmt in MLA_FORMATS else 2 * HEADS) * HEAD * layers[0].element_size() * LAYERS
    assert info["chunk_bytes"] == TOKENS * per_token

    # A full chunk, then a partial one whose last block is only partly written;
    # destinations are shuffled and disjoint from the sources.
    for src, dst, num_tokens in (
        ([0, 1, 2, 3], [17, 9, 22, 14], TOKENS),
        ([4, 5, 6, 7], [3, 20, 11, 8], TOKENS - 5),
    ):
        before = [t.clone() for t in layers]
        peer.call("transfer", "ctx", src, dst, num_tokens)
        torch.cuda.synchronize()
        for i, (t, b) in enumerate(zip(layers, before, strict=True)):
            want = expected_after(b, fmt, src, dst, num_tokens)
            assert torch.equal(bits(t), bits(want)), f"layer {i}: {fmt.value}, {num_tokens} tokens"
    closed = peer.call("close_context", "ctx")
    assert closed["wrappers_closed"] and closed["refs"] == [0] * LAYERS


def test_transfers_use_a_dedicated_stream_and_close_releases_everything(peer: PeerHandle) -> None:
    layers = caches(KVFormat.FLASH_ATTN, torch.bfloat16)
    info = peer.call("context", "life", wrap_all(RawCudaIPCWrapper, layers), spec(KVFormat.FLASH_ATTN))
    assert info["dedicated_stream"] and info["stream_context_uses_it"]
    assert info["memory_after"] > info["memory_before"]  # staging and block-id buffers
    closed = peer.call("close_context", "life")
    assert closed["after_close"].startswith("TransferError: the cache context is closed")
    assert closed["memory"] == info["memory_before"]  # every buffer went back
    assert closed["wrappers_closed"]
    assert closed["alive"] == [False] * LAYERS  # raw mappings were unmapped


def test_chunk_memory_is_registered_with_the_device_and_moves_bit_exact(peer: PeerHandle) -> None:
    # 8 layers of 8 heads x 128, bf16: a 256-token chunk is 8 MiB, so its host memory comes
    # from the server's pool and is registered with the device (cuMemHostRegister), not pinned
    # per chunk.
    layers = [torch.empty((2, 64, BLOCK, 8, 128), dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    for i, t in enumerate(layers):
        t.copy_(pattern(t, seed=300 + i))
    torch.cuda.synchronize()
    before = [t.clone() for t in layers]
    spec = {"tokens": 256, "format": KVFormat.FLASH_ATTN.value, "block_size": BLOCK, "heads": 8}
    peer.call("context", "big", wrap_all(RawCudaIPCWrapper, layers), spec)
    src, dst = list(range(16)), list(range(40, 56))
    moved = peer.call("chunk_round_trip", "big", src, dst)
    assert moved["chunk_bytes"] == 8 << 20 and moved["pinned"], moved  # registered memory is pinned
    assert moved["registered_bytes"] >= moved["chunk_bytes"] and moved["register_failures"] == 0, moved
    torch.cuda.synchronize()
    for i, (t, b) in enumerate(zip(layers, before, strict=True)):
        want = expected_after(b, KVFormat.FLASH_ATTN, src, dst, 256)
        assert torch.equal(bits(t), bits(want)), f"layer {i}"
    assert peer.call("close_context", "big")["wrappers_closed"]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_a_failing_context_closes_the_wrappers_it_opened(
    peer: PeerHandle, kind: type[DeviceIPCWrapper]
) -> None:
    layers = caches(KVFormat.FLASH_ATTN, torch.bfloat16)
    wrong = {**spec(KVFormat.FLASH_ATTN), "format": KVFormat.MLA.value}  # 5-D tensors are not MLA
    result = peer.call("failing_context", wrap_all(kind, layers), wrong)
    assert result["error"].startswith("LayoutError")
    assert result["wrappers_closed"] and result["refs"] == [0] * LAYERS


def demo(*args: str, ipc: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("LMCACHE_PLATFORM_CUDA_IPC", None)
    if ipc is not None:
        env["LMCACHE_PLATFORM_CUDA_IPC"] = ipc
    cmd = [sys.executable, "-m", "lmcache_platform._cli", "demo", "--device", "cuda", "--json", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    report: dict[str, Any] = json.loads(out.stdout)
    assert out.returncode == 0, (report.get("error"), out.stderr[-2000:])
    return report


@pytest.mark.parametrize(
    "args, ipc",
    [
        ((), None),
        (("--format", "mla", "--dtype", "float16", "--layers", "8"), None),
        (("--format", "flashinfer_hnd", "--layers", "8"), "raw"),
    ],
    ids=["default", "mla", "flashinfer_hnd-raw"],
)
def test_demo_on_cuda(args: tuple[str, ...], ipc: str | None) -> None:
    report = demo(*args, ipc=ipc)
    assert report["ok"] and report["error"] is None
    assert report["verify"]["ok"] and report["verify"]["mismatched_bytes"] == 0
    assert report["backend"]["name"] == "cuda" and report["backend"]["device_type"] == "cuda"
    assert report["backend"]["distribution"] == "lmcache-platform-cuda"
    assert report["server_backend"]["name"] == "cuda"
    assert report["config"]["device"] == "cuda"
    assert report["timings"]["store"]["gb_per_s"] > 0 and report["timings"]["retrieve"]["gb_per_s"] > 0

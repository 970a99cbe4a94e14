"""On a GPU: vLLM 0.34's layer-compact KV cache through a real ``serve``, first transfer timed apart.

Needs an NVIDIA GPU (``cuda`` marker; skipped cleanly without one); ``scripts/gpu-check``
runs it early. The test process plays the engine as vLLM 0.34 does with ``EXPORTS_FD``
and a layer-compact layout (FlashAttention, FlashInfer): one physical allocation per layer
(``cuMemCreate`` with the POSIX-fd handle type, ``support.cuda_vmm.VmmArena``), shared with
the VMM kind (one fd per layer). ``lmcache-platform serve`` runs in its own process with
default flags (its host memory prepared from its start and registered with the device as
it is). Nothing is faked.

Printed, never asserted: the registration's seconds (the kernels compile there), the first
``put`` and ``get`` apart from the steady state, each against a pinned ``copy_`` of the
same bytes. Asserted: bytes identical both ways, blocks never asked for untouched, the
fds closed once mapped, the server's chunk memory registered and its transfers on the
fused kernels.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_platform import KVFormat, LayoutHints, wrap_kv_caches
from lmcache_platform.server import ServerClient, cache_namespace
from lmcache_platform_cuda import IPC_ENV, CudaVmmIPCWrapper, _plugin
from support.cuda_vmm import VmmArena, pattern
from support.gpu import NEEDS_GPU
from support.serve import Serve, private_dir
from support.waits import wait_until

pytestmark = NEEDS_GPU
MIB = 1 << 20
#: A small model's worth: 32 layers of [2, blocks, 16, 8, 128] bf16, 256-token chunks (32 MiB).
LAYERS, BLOCK_SIZE, HEADS, HEAD, TOKENS = 32, 16, 8, 128, 256
CHUNKS, PER_REQUEST = 16, 4
BLOCKS_PER_CHUNK = TOKENS // BLOCK_SIZE
BLOCKS = CHUNKS * BLOCKS_PER_CHUNK + BLOCKS_PER_CHUNK  # the last chunk's worth is never asked for
LAYER_BYTES = 2 * BLOCKS * BLOCK_SIZE * HEADS * HEAD * 2
GRANULE = 2 * MIB


@pytest.fixture
def vmm_kind(lmcache_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IPC_ENV, "vmm")
    lmcache_registry.install("cuda", _plugin, distribution="lmcache-platform-cuda")


@pytest.fixture
def layers() -> Iterator[list[torch.Tensor]]:
    """One physical allocation per layer, each its own reservation, as vLLM 0.34 maps them."""
    size = -(-LAYER_BYTES // GRANULE) * GRANULE
    arenas = [VmmArena([size]) for _ in range(LAYERS)]
    views = [
        a.tensor()[:LAYER_BYTES].view(torch.bfloat16).view(2, BLOCKS, BLOCK_SIZE, HEADS, HEAD) for a in arenas
    ]
    yield views
    del views
    for a in arenas:
        a.free()


def pinned_copy_gb_s(nbytes: int) -> tuple[float, float]:
    """A pinned ``copy_`` of ``nbytes`` each way (median of 5 after a warm-up)."""
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out: list[list[float]] = [[], []]
    for _ in range(6):
        for i, (dst, s) in enumerate(((host, flat), (flat, host))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(s, non_blocking=True)
            torch.cuda.synchronize()
            out[i].append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(out[0][1:]), statistics.median(out[1][1:])


def test_vllm_034_per_layer_vmm_through_serve_first_transfer_apart(
    vmm_kind: None, layers: list[torch.Tensor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    for i, t in enumerate(layers):
        t.view(torch.uint8).copy_(pattern(t.view(torch.uint8), seed=i))
    expected = [t.clone() for t in layers]
    torch.cuda.synchronize()
    env = {"LMCACHE_PLATFORM_HOST_MEMORY": ""}  # serve's default: memory prepared from the start
    with Serve(sock, "--max-host-bytes", "2G", "--json-log", env=env) as serve:
        wrapped = wrap_kv_caches(layers)
        assert all(isinstance(w, CudaVmmIPCWrapper) for w in wrapped)
        fds = {fd for w in wrapped if isinstance(w, CudaVmmIPCWrapper) for fd in w.segment_fds}
        assert len(fds) == LAYERS  # one fd per layer
        ns = cache_namespace(
            model="vmm-per-layer",
            kv_layout=f"flash_attn [2, *, {BLOCK_SIZE}, {HEADS}, {HEAD}] x {LAYERS}",
            dtype="bfloat16",
            block_size=BLOCK_SIZE,
            chunk_size=TOKENS,
        )
        with ServerClient(str(sock), timeout=300) as client:
            t0 = time.perf_counter()
            reg = client.register(
                wrapped,
                namespace=ns,
                lmcache_tokens_per_chunk=TOKENS,
                layout_hints=LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=BLOCK_SIZE),
                chunk_format="blocks",
            )
            register_s = time.perf_counter() - t0
            status = client.status(reg.context)
            assert status["context"]["transfers"]["path"] == "triton", status["context"]["transfers"]
            fds_registered = len(os.listdir(f"/proc/{serve.proc.pid}/fd"))
            t0 = time.perf_counter()
            wait_until(
                lambda: (
                    (s := client.status()["server"])["host_registered_bytes"] >= s["host_mapped_bytes"] > 0
                ),
                "the server's prepared memory registered",
                120,
            )
            ready_s = time.perf_counter() - t0
            ids = [[list(range(c * BLOCKS_PER_CHUNK, (c + 1) * BLOCKS_PER_CHUNK))] for c in range(CHUNKS)]
            keys = [f"c{c}".encode().ljust(32, b".") for c in range(CHUNKS)]
            puts, gets = [], []
            for lo in range(0, CHUNKS, PER_REQUEST):
                batch = list(zip(keys[lo : lo + PER_REQUEST], ids[lo : lo + PER_REQUEST], strict=True))
                t0 = time.perf_counter()
                assert client.put(reg.context, batch).stored == len(batch)
                puts.append(time.perf_counter() - t0)
            for t in layers:
                t[:, : CHUNKS * BLOCKS_PER_CHUNK].zero_()
            torch.cuda.synchronize()
            for lo in range(0, CHUNKS, PER_REQUEST):
                batch = list(zip(keys[lo : lo + PER_REQUEST], ids[lo : lo + PER_REQUEST], strict=True))
                t0 = time.perf_counter()
                assert client.get(reg.context, batch).retrieved == len(batch)
                gets.append(time.perf_counter() - t0)
            server = client.status()["server"]
            client.unregister(reg.context)
            # Kept for the context's life, the layers' fds would go with it: they went when mapped.
            fds_unregistered = len(os.listdir(f"/proc/{serve.proc.pid}/fd"))
            assert fds_registered - fds_unregistered < LAYERS // 2, (fds_registered, fds_unregistered)
        for w in wrapped:
            w.close()
        torch.cuda.synchronize()
        for got, want in zip(layers, expected, strict=True):
            assert torch.equal(got, want)  # every chunk back, the spare blocks never touched
        assert serve.stop() == 0
    assert server["host_slow_takes"] == 0 and server["host_register_failures"] == 0
    request = reg.chunk_bytes * PER_REQUEST
    to_host, from_host = pinned_copy_gb_s(request)
    rate = [request / s / 1e9 for s in puts], [request / s / 1e9 for s in gets]
    with capsys.disabled():
        print(
            f"\nvLLM 0.34 per-layer VMM ({LAYERS} fds) through serve, {request / MIB:.0f} MiB requests: "
            f"register {register_s:.2f} s (kernels compiled), host memory registered {ready_s:.1f} s later; "
            f"put first {rate[0][0]:.1f} GB/s, then {statistics.median(rate[0][1:]):.1f} "
            f"({statistics.median(rate[0][1:]) / to_host:.2f}x pinned copy_ {to_host:.1f}); "
            f"get first {rate[1][0]:.1f} GB/s, then {statistics.median(rate[1][1:]):.1f} "
            f"({statistics.median(rate[1][1:]) / from_host:.2f}x pinned copy_ {from_host:.1f})"
        )

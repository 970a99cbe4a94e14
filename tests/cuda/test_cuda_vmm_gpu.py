"""The VMM kind on a real GPU: vLLM 0.34's extensible KV cache, shared with another process.

Needs an NVIDIA GPU (``cuda`` marker; skipped cleanly without one). The test process lays
out memory as vLLM 0.34's extensible KV cache does (``support.cuda_vmm.VmmArena``: one
reservation, physical chunks created with the POSIX-fd handle type, mapped side by side)
and plays the engine; a spawned process plays the server, receiving the fds over a UNIX
socket (``SCM_RIGHTS``). Nothing is faked here.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmcache_platform import wire, wrap_kv_caches
from lmcache_platform_cuda import (
    IPC_ENV,
    CudaIPCWrapper,
    CudaVmmIPCWrapper,
    RawCudaIPCWrapper,
    VmmMemoryError,
    VmmNotExportableError,
    _plugin,
    is_vmm_memory,
)
from support import commands
from support.cuda_vmm import (
    ALLOWED,
    VmmArena,
    digest,
    gpu_exporter_main,
    gpu_server_main,
    pattern,
    recv_json,
    send_json,
)
from support.cuda_workers import device_memory_freed
from support.gpu import NEEDS_GPU
from support.procs import stop_worker

pytestmark = NEEDS_GPU
MIB = 1 << 20
#: vLLM's block-outermost layout: [blocks, layers, 2 (K/V), block_size, heads, head_size] bf16.
BLOCKS, LAYERS, BLOCK_SIZE, HEADS, HEAD = 64, 4, 16, 8, 128
LAYER_BLOCK_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD * 2  # 64 KiB


class Server:
    """The test side of ``gpu_server_main`` in a spawned process."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = mp.get_context("spawn").Process(target=gpu_server_main, args=(theirs,), daemon=True)
        self.process.start()
        theirs.close()
        self.sock.settimeout(120)
        self.channel = commands.SocketChannel(self.sock)

    def call(self, op: str, fds: list[int] | None = None, **args: Any) -> Any:
        """``op`` in the server (``support.commands``), ``fds`` beside it; its result."""
        self.channel.send(commands.message(op, args), fds)
        return commands.result_of(op, self.channel.recv())

    def stop(self) -> None:
        try:
            stop_worker(self.process, lambda: self.call("exit"), 60)
        finally:
            self.sock.close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def auto(lmcache_registry: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda backend resolved afresh with the default kind, ``auto``."""
    monkeypatch.setenv(IPC_ENV, "auto")
    lmcache_registry.install("cuda", _plugin, distribution="lmcache-platform-cuda")


def vllm_layers(arena: VmmArena) -> list[torch.Tensor]:
    """Per-layer views of one flat buffer, as vLLM binds block-outermost caches."""
    flat = arena.tensor()
    shaped = flat.view(torch.bfloat16).view(BLOCKS, LAYERS, 2, BLOCK_SIZE, HEADS, HEAD)
    return [shaped[:, i].transpose(0, 1) for i in range(LAYERS)]  # [2, blocks, block_size, heads, head]


def arena_for_layers(**kw: Any) -> VmmArena:
    total = BLOCKS * LAYERS * LAYER_BLOCK_BYTES  # 16 MiB
    return VmmArena([4 * MIB, 2 * MIB, total - 6 * MIB], **kw)  # three chunks, as commits grow it


def test_the_server_reopens_vllm_layers_byte_exact_both_ways(auto: None, server: Server) -> None:
    arena = arena_for_layers()
    flat = arena.tensor()
    flat.copy_(pattern(flat, seed=1))
    torch.cuda.synchronize()
    layers = vllm_layers(arena)
    assert all(is_vmm_memory(t) for t in layers)
    before = flat.clone()

    wrapped = wrap_kv_caches(layers)  # auto: the VMM kind for this memory
    assert all(type(w) is CudaVmmIPCWrapper for w in wrapped)
    assert isinstance(wrapped[0], CudaVmmIPCWrapper) and len(wrapped[0].segment_fds) == 3
    data, fds = wire.encode_with_fds(wrapped)
    assert len(fds) == 3  # one fd per physical chunk, for every layer

    opened = server.call("open", fds, data=data.hex())
    assert opened["kinds"] == ["CudaVmmIPCWrapper"] * LAYERS
    assert opened["digests"] == [digest(t) for t in layers]
    assert opened["one_storage"] and opened["device"] == "cuda:0"

    server.call("fill", layer=2, seed=9)  # the server writes one layer; the engine sees it, only there
    torch.cuda.synchronize()
    expected = before.view(torch.bfloat16).view(BLOCKS, LAYERS, 2, BLOCK_SIZE, HEADS, HEAD).clone()
    written = expected[:, 2].transpose(0, 1).view(torch.uint8)
    written.copy_(pattern(written, seed=9))
    assert torch.equal(flat, expected.view(torch.uint8).view(-1))

    flat.copy_(pattern(flat, seed=5))  # the engine writes; the server reads it
    torch.cuda.synchronize()
    assert server.call("read") == [digest(t) for t in layers]
    server.call("close")
    for w in wrapped:
        w.close()
    del layers, flat
    gc.collect()
    arena.free()


def test_the_legacy_kinds_refuse_it_and_name_the_vmm_kind() -> None:
    arena = arena_for_layers()
    flat = arena.tensor()
    for kind in (CudaIPCWrapper, RawCudaIPCWrapper):
        with pytest.raises(VmmMemoryError, match="LMCACHE_PLATFORM_CUDA_IPC=auto"):
            kind.wrap(flat)
    del flat
    gc.collect()
    arena.free()


def test_memory_created_without_exportable_handles_is_refused_with_the_fix() -> None:
    arena = VmmArena([2 * MIB], handle_types=0)  # what vLLM makes when no connector asks for EXPORTS_FD
    flat = arena.tensor()
    with pytest.raises(VmmNotExportableError, match=r"kv_cache_access\(\) -> KVCacheAccess\.EXPORTS_FD"):
        CudaVmmIPCWrapper.wrap(flat)
    del flat
    gc.collect()
    arena.free()


def test_auto_picks_per_tensor_on_the_gpu(auto: None) -> None:
    arena = VmmArena([2 * MIB])
    vmm = arena.tensor()
    plain = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    assert not is_vmm_memory(plain) and is_vmm_memory(vmm)
    wrapped = wrap_kv_caches([plain, vmm])
    assert [type(w) for w in wrapped] == [CudaIPCWrapper, CudaVmmIPCWrapper]
    for w in wrapped:
        w.close()
    del vmm
    gc.collect()
    arena.free()


def test_an_engine_reopening_its_own_export_aliases_it() -> None:
    arena = VmmArena([2 * MIB, 2 * MIB])
    flat = arena.tensor()
    flat.copy_(pattern(flat, seed=4))
    w = CudaVmmIPCWrapper.wrap(flat[100:])
    mine = w.to_tensor()
    assert mine.data_ptr() != flat.data_ptr() + 100 and torch.equal(mine, flat[100:])
    mine[0] = 0xEE
    torch.cuda.synchronize()
    assert int(flat[100]) == 0xEE
    w.close()
    del mine, flat
    gc.collect()
    arena.free()


def test_closing_returns_the_memory_of_an_engine_that_freed_its_side() -> None:
    """The server's import is the last holder once the engine freed its mapping; closing frees it."""
    nbytes = 1 << 30
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(180)
    engine = mp.get_context("spawn").Process(target=gpu_exporter_main, args=(theirs, nbytes), daemon=True)
    engine.start()
    theirs.close()
    try:
        message, fds = recv_json(ours, max_fds=16)
        (w,) = wire.decode(bytes.fromhex(message["data"]), fds=fds, allowed=ALLOWED)
        t = w.to_tensor()
        assert t.numel() == nbytes and int(t[12345].item()) == 7
        send_json(ours, {"go": True})
        assert recv_json(ours) == {"freed": True}
        engine.join(60)
        assert engine.exitcode == 0
        assert int(t[nbytes - 1].item()) == 7  # still ours to read
        views = [t]
        del t
        freed = device_memory_freed(views, [w])
        assert freed >= 0.8 * nbytes, freed
    finally:
        if engine.is_alive():
            engine.kill()
        ours.close()

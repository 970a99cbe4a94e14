"""Processes for the VMM-kind tests: a fake server (no GPU) and vLLM's layout on a real GPU.

Messages between the processes are JSON over a UNIX socket (length-prefixed); the
descriptors' fds travel beside them (``SCM_RIGHTS``), as the server's transport sends them.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import socket
from typing import Any

import torch

from lmcache_platform import wire
from lmcache_platform_cuda import CudaVmmIPCWrapper
from support import commands

ALLOWED = {CudaVmmIPCWrapper.wire_tag: CudaVmmIPCWrapper}


def send_json(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    commands.SocketChannel(sock).send(message, fds)


def recv_json(sock: socket.socket, *, max_fds: int = 0) -> Any:
    """One message; with ``max_fds``, ``(message, fds)``."""
    channel = commands.SocketChannel(sock, max_fds=max_fds)
    message = channel.recv()
    return (message, channel.fds) if max_fds else message


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in logical order."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def fake_server_main(sock: socket.socket) -> None:
    """A server process without a GPU: ``FakeVmmLib`` of its own, the fds from the socket."""
    import os

    from lmcache_platform_cuda import _devices, _vmm_ipc
    from support.cuda_fakes import UUIDS, FakeVmmLib, HostCudaDriver, open_fds

    lib = FakeVmmLib()
    driver = HostCudaDriver(lib)  # type: ignore[arg-type]
    _vmm_ipc.get_runtime = lambda: driver  # type: ignore[assignment]
    _devices._enumerate = lambda: [UUIDS[0]]
    _devices.DEVICES.reset()
    baseline = open_fds()
    data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 64)
    wrappers = wire.decode(data, fds=fds, allowed=ALLOWED)
    tensors = [w.to_tensor() for w in wrappers]
    report: dict[str, Any] = {
        "digests": [digest(t) for t in tensors],
        "one_storage": len({t.untyped_storage().data_ptr() for t in tensors}) == 1,
    }
    tensors[1].fill_(0xAB)
    for w in wrappers:
        w.close()
    del tensors
    gc.collect()
    report["leaked"] = {
        "fds": open_fds() - baseline,
        "mappings": len(lib.mappings),
        "reservations": len(lib.reservations),
    }
    send_json(sock, report)
    sock.close()
    os._exit(0)  # nothing of this process outlives the report


# -- vLLM 0.34's extensible KV cache on a real GPU ----------------------------------------


class VmmArena:
    """Device memory laid out as vLLM 0.34's extensible KV cache lays it out (``ExtensibleTensor``).

    One address reservation, physical chunks (``cuMemCreate``, requested handle type POSIX
    fd unless ``handle_types`` says otherwise) mapped side by side from its start, read-write
    access granted over the run; tensors view the mapped bytes. Made through the backend's
    own ctypes binding (its primary context, its structures), plus ``cuMemCreate``, which
    only an engine calls.
    """

    def __init__(
        self, chunks: list[int], *, ordinal: int = 0, handle_types: int = 1, reserve: int = 0
    ) -> None:
        from lmcache_platform_cuda import _driver

        self.driver = d = _driver.driver()
        d._vmm()
        if "cuMemCreate" not in d._fns:
            d._bind(
                {
                    "cuMemCreate": [
                        ctypes.POINTER(ctypes.c_uint64),
                        ctypes.c_size_t,
                        ctypes.POINTER(_driver.CUmemAllocationProp),
                        ctypes.c_ulonglong,
                    ]
                }
            )
        self.ordinal = ordinal
        self.nbytes = sum(chunks)
        self.reserved = max(self.nbytes, reserve)
        self.offsets = [sum(chunks[:i]) for i in range(len(chunks))]
        self.sizes = list(chunks)
        self.handles: list[int] = []
        ptr = ctypes.c_uint64()
        prop = _driver.device_allocation_prop(ordinal, handle_types)
        with d._on(ordinal):
            d._call("cuMemAddressReserve", ctypes.byref(ptr), self.reserved, 0, 0, 0)
            self.base = int(ptr.value)
            for offset, size in zip(self.offsets, self.sizes, strict=True):
                handle = ctypes.c_uint64()
                d._call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
                self.handles.append(int(handle.value))
                d._call("cuMemMap", self.base + offset, size, 0, handle, 0)
            access = _driver.CUmemAccessDesc(
                _driver.CUmemLocation(_driver.CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
            )
            access.flags = _driver.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            d._call("cuMemSetAccess", self.base, self.nbytes, ctypes.byref(access), 1)

    def tensor(self) -> torch.Tensor:
        """The committed bytes as one flat uint8 CUDA tensor (it keeps this arena alive)."""
        return self.driver.as_tensor(self, self.base, self.nbytes, self.ordinal)

    def free(self) -> None:
        """What vLLM's ``free()`` does: unmap, release the handles, free the reservation."""
        d = self.driver
        torch.cuda.synchronize(self.ordinal)
        with d._on(self.ordinal):
            for offset, size in zip(self.offsets, self.sizes, strict=True):
                d._call("cuMemUnmap", self.base + offset, size)
            for handle in self.handles:
                d._call("cuMemRelease", ctypes.c_uint64(handle))
            d._call("cuMemAddressFree", self.base, self.reserved)
        self.handles = []


def pattern(like: torch.Tensor, seed: int) -> torch.Tensor:
    """Deterministic bytes shaped like ``like`` (uint8), different for every element and seed."""
    idx = torch.arange(like.numel(), dtype=torch.int64, device=like.device)
    return (((idx + 1) * 2654435761 + seed * 40503) >> 5).to(torch.uint8).view(like.shape)


def gpu_server_main(sock: socket.socket) -> None:
    """The KV-cache server on a GPU: decode with the received fds, reopen, read, write, close.

    Requests (``support.commands``): ``open`` (the fds beside it), ``read`` (digests),
    ``fill`` one layer with a pattern, ``close``; each answered with a JSON report.
    """

    from lmcache_platform._plugins.registry import wire_classes_for

    channel = commands.SocketChannel(sock, max_fds=253)
    wrappers: list[Any] = []
    tensors: list[torch.Tensor] = []

    def open_(data: str) -> dict[str, Any]:
        nonlocal wrappers, tensors
        wrappers = wire.decode(bytes.fromhex(data), fds=channel.fds, allowed=dict(wire_classes_for("cuda")))
        tensors = [w.to_tensor() for w in wrappers]
        torch.cuda.synchronize()
        return {
            "kinds": [type(w).__name__ for w in wrappers],
            "digests": [digest(t) for t in tensors],
            "one_storage": len({t.untyped_storage().data_ptr() for t in tensors}) == 1,
            "device": str(tensors[0].device),
        }

    def read() -> list[str]:
        torch.cuda.synchronize()
        return [digest(t) for t in tensors]

    def fill(layer: int, seed: int) -> None:
        t = tensors[layer].view(torch.uint8)
        t.copy_(pattern(t, seed))
        torch.cuda.synchronize()

    def close() -> dict[str, bool]:
        nonlocal wrappers, tensors
        for w in wrappers:
            w.close()
        wrappers, tensors = [], []
        gc.collect()
        torch.cuda.synchronize()
        return {"closed": True}

    commands.serve_commands(channel, {"open": open_, "read": read, "fill": fill, "close": close})


def gpu_exporter_main(sock: socket.socket, nbytes: int) -> None:
    """An engine that exports ``nbytes`` of VMM memory, then frees its own side and exits."""
    from lmcache_platform_cuda import CudaVmmIPCWrapper

    torch.cuda.init()
    arena = VmmArena([nbytes])
    flat = arena.tensor()
    flat.fill_(7)
    torch.cuda.synchronize()
    w = CudaVmmIPCWrapper.wrap(flat)
    data, fds = wire.encode_with_fds([w])
    send_json(sock, {"data": data.hex()}, fds)
    recv_json(sock)  # "go": the server has imported it
    w.close()
    del flat
    gc.collect()
    arena.free()  # the engine's own mapping and handles are gone: only the server's import holds it
    send_json(sock, {"freed": True})

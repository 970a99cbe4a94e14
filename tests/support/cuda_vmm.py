"""Processes for the VMM-kind tests: a fake server (no GPU) and vLLM's layout on a real GPU.

Messages between the processes are JSON over a UNIX socket (length-prefixed); the
descriptors' fds travel beside them (``SCM_RIGHTS``), as the server's transport sends them.
"""

from __future__ import annotations

import gc
import hashlib
import json
import socket
import struct
from typing import Any

import torch

from lmcache_platform import wire
from lmcache_platform_cuda import CudaVmmIPCWrapper

ALLOWED = {CudaVmmIPCWrapper.wire_tag: CudaVmmIPCWrapper}


def send_json(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def recv_json(sock: socket.socket, *, max_fds: int = 0) -> Any:
    """One message; with ``max_fds``, ``(message, fds)``."""
    head, fds, _, _ = socket.recv_fds(sock, 4, max_fds) if max_fds else (sock.recv(4), [], 0, None)
    (size,) = struct.unpack("!I", _exactly(sock, head, 4))
    message = json.loads(_exactly(sock, b"", size))
    return (message, list(fds)) if max_fds else message


def _exactly(sock: socket.socket, got: bytes, n: int) -> bytes:
    while len(got) < n:
        more = sock.recv(n - len(got))
        if not more:
            raise EOFError("peer closed the socket")
        got += more
    return got


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

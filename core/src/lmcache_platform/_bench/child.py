"""The receiving process of the hand-off benchmark (started with the spawn method).

It stands in for a KV-cache server: it receives a KV-cache set by each method
under test, opens every layer as a tensor (ours with ``to_tensors``, as a cache
context does; the stage keeps its name ``to_tensor``), reads the first and last element of
the first and last layer (so the parent can check the memory really is its own)
and acknowledges. Control messages and acknowledgements are JSON; our method's
payload is the wire format. The torch baseline is torch's own queue mechanism,
between two processes of this benchmark. The pickle baseline's bytes are received
and counted here but never unpickled: nothing unpickles bytes from another process.
The parent unpickles its own copy of those bytes and adds that time.
"""

from __future__ import annotations

import json
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def corner_values(tensors: list[torch.Tensor]) -> list[float]:
    """First and last element of the first and last layer."""
    out: list[float] = []
    for t in (tensors[0], tensors[-1]):
        out.append(float(t[(0,) * t.dim()].item()))
        out.append(float(t[tuple(n - 1 for n in t.shape)].item()))
    return out


def serve(conn: Connection, queue: Any) -> None:
    """Answer hand-offs until told to stop. ``queue`` carries the torch methods' tensors."""
    import torch.multiprocessing  # noqa: F401 - registers torch's sharing reductions

    from .. import wire

    while True:
        command = json.loads(conn.recv_bytes())
        method = command["method"]
        if method == "stop":
            return
        conn.send_bytes(b'{"ready": true}')
        times: dict[str, float] = {}
        wrappers: list[Any] = []
        if method == "ours":
            data = conn.recv_bytes()
            t0 = time.perf_counter()
            wrappers = wire.decode(data)
            t1 = time.perf_counter()
            # As a cache context reopens them: one to_tensors call (the set is of one class).
            tensors = type(wrappers[0]).to_tensors(wrappers)
            times = {"decode": t1 - t0, "to_tensor": time.perf_counter() - t1}
        elif method == "torch":
            tensors = queue.get()
        elif method == "pickle":  # receive only; see the module docstring
            received = len(conn.recv_bytes())
            conn.send_bytes(json.dumps({"received_bytes": received}).encode())
            continue
        else:
            raise ValueError(f"unknown hand-off method {method!r}")
        ack = {"corners": corner_values(tensors), "layers": len(tensors), **times}
        conn.send_bytes(json.dumps(ack).encode())
        del tensors
        for w in wrappers:
            w.close()

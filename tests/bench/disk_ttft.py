"""Time to first token on a restarted server: a disk-tier hit against recompute and a memory hit.

Run with the vLLM virtualenv's Python (``make bench-disk``)::

    PYTHONPATH=tests .venv-vllm/bin/python -m bench.disk_ttft [--prompt-tokens 2065] [--prompts 3] [--json]

``vllm_ttft.py``'s model (prefill dominates on 2 cores) through ``remote_ttft.py``'s
engine processes. Engine A computes the prompts through ``serve --remote file:///DIR``;
that server stops (SIGTERM: its queue drains to disk) and a new one starts on the same
directory with empty memory. Engine B1 (a fresh process) loads every prompt from disk;
B2 (another fresh process) finds them in the new server's memory; C recomputes without
a connector. The page cache is dropped before B1 where this process may (root), so the
disk hit is a cold read; otherwise the figures say "warm". Also: the file store's fetch
of one prompt's entries against plain reads of the same files.

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from bench.remote_ttft import PREFIX, start_serve, wait_written
from bench.vllm_ttft import CHUNK, arguments, medians, prompts_of, run_engine, work_dir


def drop_page_cache() -> bool:
    """Drop the page cache (root only), so that a read comes from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def read_bandwidth(disk: Path, url: str, prompts: int, cold: bool) -> dict[str, float]:
    """One prompt's entries: the file store's checked fetch, against plain reads of the same files."""
    from lmcache_platform.remote._tier import RemoteTier

    files = sorted(p for p in disk.iterdir() if p.name.startswith("e."))
    per = len(files) // prompts
    names = [p.name.removeprefix("e.").split(":") for p in files[:per]]
    namespace = bytes.fromhex(names[0][1])
    keys = [bytes.fromhex(k) for _, _, k in names]
    nbytes = sum(p.stat().st_size for p in files[:per])
    tier = RemoteTier.open(url, prefix=PREFIX, call_timeout_s=60)
    try:
        assert tier.wait_ready(10)
        # Untimed: the first fetch imports torch and starts the decoders (seconds, once per process).
        tier.fetch(namespace, keys[:1])
        out: dict[str, float] = {"entries": per, "bytes": nbytes}
        for label in ("cold", "warm") if cold else ("warm",):
            if label == "cold":
                drop_page_cache()
            t0 = time.perf_counter()
            got = tier.fetch(namespace, keys)
            out[f"fetch_{label}_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
            assert all(g is not None for g in got), tier.stats()
            if label == "cold":
                drop_page_cache()
            t0 = time.perf_counter()
            for p in files[:per]:
                with open(p, "rb") as f:
                    f.read()
            out[f"plain_{label}_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        tier.close()
    return out


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument(
        "--keep-page-cache",
        action="store_true",
        help="never drop the host's page cache (which needs root and slows everything else running)",
    )
    args = parser.parse_args()
    prompts = prompts_of(args)
    chunks = (args.prompt_tokens - 1) // CHUNK
    with work_dir() as work:
        disk = work / "disk"
        url = f"file://{disk}"
        base = {"prompts": prompts, "tokens": 2 * CHUNK + 17, "model_id": "bench disk ttft"}
        first = start_serve(work / "srv", url)
        sock = work / "srv" / "kv.sock"
        try:
            run_engine({**base, "socket": str(sock)})  # A computes; the server writes behind
            wait_written(sock, chunks * args.prompts, "the server")
        finally:
            first.terminate()
            first.wait(60)
        restarted = start_serve(work / "srv", url)
        try:
            cold = not args.keep_page_cache and drop_page_cache()
            disk_hit = run_engine({**base, "socket": str(sock)})  # B1: from disk, into memory
            memory_hit = run_engine({**base, "socket": str(sock)})  # B2: from the server's memory
            recompute = run_engine({**base, "socket": None})  # C
        finally:
            restarted.terminate()
            restarted.wait(60)
        bandwidth = read_bandwidth(disk, url, args.prompts, cold)
    result = {
        **medians(args, recompute=recompute, disk_hit=disk_hit, memory_hit=memory_hit),
        "page_cache": "dropped before the disk hit" if cold else "warm (not root: could not drop it)",
        "cached_tokens_disk_hit": statistics.median(r["cached"] for r in disk_hit),
        "loaded_bytes": statistics.median(r["loaded_bytes"] for r in disk_hit),
        **bandwidth,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result
    print(
        f"time to first token on a restarted server, {args.prompt_tokens}-token prompts "
        f"(median of {args.prompts}; page cache {r['page_cache']}):"
    )
    print(f"  recompute (no connector)     {r['ttft_recompute_s'] * 1e3:9.1f} ms")
    print(
        f"  disk hit (file store)        {r['ttft_disk_hit_s'] * 1e3:9.1f} ms   "
        f"({r['cached_tokens_disk_hit']:.0f} tokens, {r['loaded_bytes'] / 2**20:.1f} MiB)"
    )
    print(f"  host-memory hit              {r['ttft_memory_hit_s'] * 1e3:9.1f} ms")
    line = f"one prompt's {r['entries']:.0f} entries ({r['bytes'] / 2**20:.1f} MiB):"
    for label in ("cold", "warm"):
        if f"fetch_{label}_gbps" in r:
            line += (
                f" {label}: file store {r[f'fetch_{label}_gbps']:.2f} GB/s, "
                f"plain reads {r[f'plain_{label}_gbps']:.2f} GB/s;"
            )
    print(line.rstrip(";"))


if __name__ == "__main__":
    main()

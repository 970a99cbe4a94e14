"""The remote tiers against their medium: the entry checksum, the disk tier, the Valkey tier.

Run with the project's Python (``make bench-tiers``)::

    PYTHONPATH=tests .venv/bin/python -m bench.tier_io [--entries 8] [--entry-mib 8] [--runs 5] [--json] [--keep-page-cache]
        [--section checksum --section disk --section valkey]
    PYTHONPATH=tests .venv-vllm/bin/python -m bench.tier_io --section disk --section vllm-fs

* ``checksum``: GB/s of the entry checksum on one core, version 1 (keyed BLAKE2b) against
  version 2 (keyed BLAKE3), over one entry-sized buffer; and a whole ``encode`` + ``decode``
  of one entry in each version (copy, checksum, every check).
* ``disk``: one prompt's entries (``--entries`` of ``--entry-mib``) through a
  :class:`RemoteTier` over the file store (a store: queue, encode, write; a fetch: read,
  every check) against plain ``write``/``read`` of the same bytes in as many files (the
  reads' bytes held until the batch is read, as a fetch returns them), warm
  (page cache) and cold (the files' pages dropped with ``posix_fadvise(DONTNEED)`` after
  an ``fsync``, and the whole page cache where this process may, as root).
  ``fetch_direct``: the same fetch with ``?direct=1`` (``O_DIRECT``: every read from the disk);
  ``fetch_placed``: the server's fetch, read straight into chunk memory prepared ahead
  (``fetch(into=...)``, the file store's ``get_many_into``).
* ``vllm-fs`` (with the vLLM venv's Python): vLLM's own ``fs`` tier's I/O on the same
  bytes, as its manager runs it; run it with ``disk`` in one command to compare.
* ``valkey``: the same entries through the tier over a local ``valkey-server`` against a
  raw pipelined ``SET``/``GET`` of the same bytes through the tier's own client (whose
  packer sends a large value unjoined); ``raw_set_default_client``: the same ``SET`` through
  a client with the library's default packer (libvalkey's, which joins each command).

Every figure is the best of ``--runs``. Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NS = bytes(range(32))
PREFIX = "bench"


def best(fn: Callable[[], object], runs: int, before: Callable[[], object] | None = None) -> float:
    """The shortest of ``runs`` timed calls of ``fn`` (``before`` runs untimed ahead of each)."""
    times = []
    for _ in range(runs):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def chunks(entries: int, entry_mib: float) -> list[list[Any]]:
    import torch

    n = int(entry_mib * (1 << 20)) // 2
    return [[torch.randn(n).to(torch.bfloat16)] for _ in range(entries)]


def keys(entries: int) -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(entries)]


# -- checksum ---------------------------------------------------------------------------------


def checksum(args: argparse.Namespace) -> dict[str, float]:
    from lmcache_platform.remote import _entry

    secret = _entry.derive_secret(b"a deployment key of enough bytes")
    size = int(args.entry_mib * (1 << 20))
    data = memoryview(os.urandom(size))
    out: dict[str, float] = {"bytes": size}
    for version in (1, 2):

        def digest(version: int = version) -> None:
            h = _entry._hasher(secret, version)
            h.update(data)
            h.digest()

        out[f"v{version}_checksum_gbps"] = size / best(digest, args.runs) / 1e9
    (tensors,) = chunks(1, args.entry_mib)
    who = _entry.EntryIdentity(PREFIX.encode(), NS, b"k" * 32)
    for version in (1, 2):
        entry = bytes(_entry.encode(tensors, who, secret, version=version))

        def enc(version: int = version) -> None:
            _entry.encode(tensors, who, secret, version=version)

        def dec(entry: bytes = entry) -> None:
            _entry.decode(entry, who, secret)

        out[f"v{version}_encode_gbps"] = size / best(enc, args.runs) / 1e9
        out[f"v{version}_decode_gbps"] = size / best(dec, args.runs) / 1e9
    out["speedup"] = out["v2_checksum_gbps"] / out["v1_checksum_gbps"]
    return out


# -- disk -------------------------------------------------------------------------------------


def drop_cache(files: list[Path], keep_page_cache: bool) -> str:
    """The files' pages out of the page cache: ``cold``; and the whole cache where allowed,
    unless ``keep_page_cache`` (a shared host's, as the test suite's)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if keep_page_cache:
        return "fadvise"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return "fadvise"
    return "fadvise+drop_caches"


def disk(args: argparse.Namespace) -> dict[str, Any]:
    from lmcache_platform.remote._entry import EntryIdentity, encode
    from lmcache_platform.remote._tier import RemoteTier

    base = Path(tempfile.mkdtemp(prefix="lmcp-bench-", dir=args.dir))
    data = chunks(args.entries, args.entry_mib)
    ks = keys(args.entries)
    tier = RemoteTier.open(f"file://{base / 'kv'}", prefix=PREFIX, call_timeout_s=120, write_timeout_s=120)
    assert tier.wait_ready(10)
    raw = [bytes(encode(c, EntryIdentity(PREFIX.encode(), NS, k))) for c, k in zip(data, ks, strict=True)]
    nbytes = sum(len(r) for r in raw)
    plain_dir = base / "plain"
    plain_dir.mkdir()
    plain = [plain_dir / f"f{i}" for i in range(args.entries)]
    out: dict[str, Any] = {"entries": args.entries, "bytes": nbytes}
    try:

        def store() -> None:
            for c, k in zip(data, ks, strict=True):
                assert tier.write_behind(NS, k, c)
            assert tier.flush(120)

        def write_plain() -> None:
            for p, r in zip(plain, raw, strict=True):
                with open(p, "wb") as f:
                    f.write(r)

        def clear(directory: Path, pattern: str) -> None:
            for p in directory.glob(pattern):
                p.unlink()

        # New files each time, as vllm-fs's store (its files removed untimed before each run)
        out["store_gbps"] = nbytes / best(store, args.runs, lambda: clear(base / "kv", "e.*")) / 1e9
        out["plain_write_gbps"] = nbytes / best(write_plain, args.runs, lambda: clear(plain_dir, "f*")) / 1e9
        entry_files = sorted((base / "kv").glob("e.*"))

        def fetch() -> None:
            got = tier.fetch(NS, ks)
            assert all(g is not None for g in got), tier.stats()

        def read_plain() -> None:  # the batch held at once, as a fetch returns it
            held = []
            for p in plain:
                with open(p, "rb") as f:
                    held.append(f.read())

        import torch

        from lmcache_platform.remote._entry import spec_of

        expect = [spec_of(t) for t in data[0]]
        from lmcache_platform._kv.hostalloc import host_empty

        def chunk_memory(t: torch.Tensor) -> torch.Tensor:  # as allocate_chunk's: page-aligned, faulted in
            return host_empty(int(t.nbytes)).view(t.dtype).view(t.shape).fill_(0)

        pool = [[chunk_memory(t) for t in data[0]] for _ in ks]
        free = iter(range(1 << 30))

        def fetch_placed() -> None:  # the server's path: straight into its prepared chunk memory
            got = tier.fetch(NS, ks, expect=expect, into=lambda: pool[next(free) % len(pool)])
            assert all(g is not None and g.placed for g in got), tier.stats()

        out["fetch_warm_gbps"] = nbytes / best(fetch, args.runs) / 1e9
        out["fetch_placed_warm_gbps"] = nbytes / best(fetch_placed, args.runs) / 1e9
        out["plain_read_warm_gbps"] = nbytes / best(read_plain, args.runs) / 1e9
        how = drop_cache(entry_files, args.keep_page_cache)
        out["cold"] = how
        out["fetch_cold_gbps"] = (
            nbytes / best(fetch, args.runs, lambda: drop_cache(entry_files, args.keep_page_cache)) / 1e9
        )
        out["fetch_placed_cold_gbps"] = (
            nbytes
            / best(fetch_placed, args.runs, lambda: drop_cache(entry_files, args.keep_page_cache))
            / 1e9
        )
        out["plain_read_cold_gbps"] = (
            nbytes / best(read_plain, args.runs, lambda: drop_cache(plain, args.keep_page_cache)) / 1e9
        )
        direct = RemoteTier.open(f"file://{base / 'kv'}?direct=1", prefix=PREFIX, call_timeout_s=120)
        try:
            assert direct.wait_ready(10)

            def fetch_direct() -> None:
                assert all(g is not None for g in direct.fetch(NS, ks)), direct.stats()

            out["fetch_direct_gbps"] = nbytes / best(fetch_direct, args.runs) / 1e9
            out["direct_taken"] = direct.store._direct  # type: ignore[attr-defined]
        finally:
            direct.close()
        for kind in ("warm", "cold"):
            out[f"fetch_{kind}_ratio"] = out[f"fetch_{kind}_gbps"] / out[f"plain_read_{kind}_gbps"]
        out["fetch_direct_cold_ratio"] = out["fetch_direct_gbps"] / out["plain_read_cold_gbps"]
        out["store_ratio"] = out["store_gbps"] / out["plain_write_gbps"]
    finally:
        tier.close()
        for p in [*plain, *(base / "kv").iterdir()]:
            p.unlink()
        (base / "kv").rmdir()
        plain_dir.rmdir()
        base.rmdir()
    return out


# -- valkey -----------------------------------------------------------------------------------


def valkey(args: argparse.Namespace) -> dict[str, Any]:
    from lmcache_platform.remote._entry import EntryIdentity, encode
    from lmcache_platform.remote._tier import RemoteTier
    from support.valkey import ValkeyNode

    data = chunks(args.entries, args.entry_mib)
    ks = keys(args.entries)
    raw = [bytes(encode(c, EntryIdentity(PREFIX.encode(), NS, k))) for c, k in zip(data, ks, strict=True)]
    nbytes = sum(len(r) for r in raw)
    out: dict[str, Any] = {"entries": args.entries, "bytes": nbytes}
    with tempfile.TemporaryDirectory(prefix="lmcp-bench-valkey-") as d, ValkeyNode(Path(d)) as node:
        tier = RemoteTier.open(node.url, prefix=PREFIX, call_timeout_s=60, write_timeout_s=60)
        assert tier.wait_ready(10)
        client = tier.store._standalone()  # type: ignore[attr-defined]  # the tier's own client
        raw_keys = [b"raw:" + k.hex().encode() for k in ks]
        try:

            def store() -> None:
                for c, k in zip(data, ks, strict=True):
                    assert tier.write_behind(NS, k, c)
                assert tier.flush(60)

            def set_raw() -> None:
                pipe = client.pipeline(transaction=False)
                for k, r in zip(raw_keys, raw, strict=True):
                    pipe.set(k, r)
                assert all(pipe.execute())

            default = node.client()  # the library's default packer

            def set_default() -> None:
                pipe = default.pipeline(transaction=False)
                for k, r in zip(raw_keys, raw, strict=True):
                    pipe.set(k, r)
                assert all(pipe.execute())

            def fetch() -> None:
                assert all(g is not None for g in tier.fetch(NS, ks))

            def get_raw() -> None:
                pipe = client.pipeline(transaction=False)
                for k in raw_keys:
                    pipe.get(k)
                assert all(v is not None for v in pipe.execute())

            out["store_gbps"] = nbytes / best(store, args.runs) / 1e9
            out["raw_set_gbps"] = nbytes / best(set_raw, args.runs) / 1e9
            out["raw_set_default_client_gbps"] = nbytes / best(set_default, args.runs) / 1e9
            out["fetch_gbps"] = nbytes / best(fetch, args.runs) / 1e9
            out["raw_get_gbps"] = nbytes / best(get_raw, args.runs) / 1e9
            out["store_ratio"] = out["store_gbps"] / out["raw_set_gbps"]
            out["fetch_ratio"] = out["fetch_gbps"] / out["raw_get_gbps"]
        finally:
            tier.close()
    return out


# -- vLLM's own fs tier ---------------------------------------------------------------------


def vllm_fs(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's ``fs`` secondary tier's I/O on the same bytes, as its manager runs it: one job of
    the batch's chunks (``batch_store_block``/``batch_load_block``, ``O_DIRECT`` where
    ``probe_o_direct`` says so) on its ``DualQueueThreadPool`` (16 read, 16 write threads),
    from and into a page-aligned primary region (vLLM's is an mmap'd file in /dev/shm)."""
    import mmap

    from vllm.v1.kv_offload.tiering.fs.io import (  # type: ignore[import-not-found]
        batch_load_block,
        batch_store_block,
        probe_o_direct,
    )
    from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool  # type: ignore[import-not-found]

    from lmcache_platform.remote._entry import byte_view

    data = chunks(args.entries, args.entry_mib)
    block = int(data[0][0].nbytes)
    region = mmap.mmap(-1, block * args.entries)
    view = memoryview(region)
    for i, c in enumerate(data):
        view[i * block : (i + 1) * block] = byte_view(c[0])
    base = Path(tempfile.mkdtemp(prefix="lmcp-bench-vllmfs-", dir=args.dir))
    paths = [str(base / f"k{i}.bin") for i in range(args.entries)]
    offsets = [i * block for i in range(args.entries)]
    direct = probe_o_direct(str(base))
    pool = DualQueueThreadPool(16, 16)
    jobs = iter(range(1 << 30))
    nbytes = block * args.entries
    out: dict[str, Any] = {"entries": args.entries, "bytes": nbytes, "o_direct": direct}

    def run(enqueue: Callable[..., None], fn: Callable[[], None]) -> None:
        enqueue(next(jobs), 1, [fn])
        pool.wait_idle()
        for _, ok, _ in pool.get_finished():
            assert ok

    def clear() -> None:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)

    try:

        def store() -> None:
            run(pool.enqueue_store, lambda: batch_store_block(paths, view, offsets, block, direct))

        def load() -> None:
            run(pool.enqueue_load, lambda: batch_load_block(paths, view, offsets, block, direct))

        out["store_gbps"] = nbytes / best(store, args.runs, clear) / 1e9
        files = [Path(p) for p in paths]
        out["load_warm_gbps"] = nbytes / best(load, args.runs) / 1e9
        out["load_cold_gbps"] = (
            nbytes / best(load, args.runs, lambda: drop_cache(files, args.keep_page_cache)) / 1e9
        )
    finally:
        pool.shutdown()
        clear()
        base.rmdir()
        view.release()
        region.close()
    return out


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "checksum": checksum,
    "disk": disk,
    "valkey": valkey,
    "vllm-fs": vllm_fs,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entries", type=int, default=8, help="entries per batch (default: 8, one prompt's)")
    parser.add_argument("--entry-mib", type=float, default=8.0, help="MiB per entry (default: 8)")
    parser.add_argument("--runs", type=int, default=5, help="repeats; the best counts (default: 5)")
    parser.add_argument("--dir", default=None, help="where the disk section writes (default: the temp dir)")
    parser.add_argument("--section", action="append", choices=sorted(SECTIONS), help="repeatable")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--keep-page-cache", action="store_true", help="never drop the whole page cache (root): fadvise only"
    )
    args = parser.parse_args(argv)
    report = {"cpus": os.cpu_count(), "loadavg": os.getloadavg()[0]}
    default = [n for n in SECTIONS if n != "vllm-fs"]  # that one needs vLLM (.venv-vllm)
    results = {name: SECTIONS[name](args) for name in args.section or default}
    if args.json:
        print(json.dumps({**report, **results}, indent=1))
        return
    print(f"tier I/O, {os.cpu_count()} CPUs, load {report['loadavg']:.2f} (best of {args.runs})")
    for name, figures in results.items():
        print(f"{name}:")
        for key, value in figures.items():
            print(f"  {key:24} {value:.3f}" if isinstance(value, float) else f"  {key:24} {value}")


if __name__ == "__main__":
    main()

"""A real server between two engine processes: ``put`` and ``get`` timed from the engine.

``lmcache-platform bench --section server [--device cuda] [--chunks N] [--per-request N]``
(the section :func:`bench_server`); ``scripts/gpu-check`` runs it with its own report
(``python -m lmcache_platform._bench.serverpath --device cuda --json FILE``).

The contexts move chunks as the vLLM connector registers them: the engine's own blocks
(``--chunk-format blocks``, the default; ``tokens`` for token-major chunks).

Per scenario, a real ``lmcache-platform serve`` in its own process and two spawned
engine processes with vLLM-style KV caches (one flat allocation, a ``[B, H, N, C]`` view
per layer in current vLLM's order: ``LBNHC`` on CUDA, ``LBHNC`` on the host; bfloat16,
32 layers x 8 KV heads x 128, blocks of 16 tokens, chunks of 256 tokens). Engine A fills
its caches with a seeded pattern, measures a pinned ``copy_`` of one request's bytes each
way (on the host, a ``copy_`` between two host buffers), and ``put`` s every chunk of the
working set; engine B ``get`` s them into other blocks. Each request (``--per-request``
chunks) is timed by the engine from the request to its answer, from the moment the server
has mapped the engine's memory (``engine_memory`` in ``status``; vLLM registers when its
engine starts, well before its first request; the wait is reported). B then regenerates A's
pattern and checks every byte it received, and that blocks it never asked for are still
zero.

Scenarios: ``fresh``, a server that never stored before (one round of puts, its memory
prepared ahead of use as the stores arrive: ``--host-memory ahead``); ``prepared``, the
same with ``--host-memory eager`` and the puts started once the server has the working
set's memory ready (a server started before its engines' first stores; the time that
took is reported); ``evicting``,
``--max-host-bytes`` just above the working set and three rounds of new keys, so rounds 2
and 3 evict as much as they store (their puts are timed). The gets read the last round.
Figures are printed, never asserted; the exit status is 1 when bytes differ or a step
fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

LAYERS, HEADS, HEAD_SIZE, BLOCK, TOKENS = 32, 8, 128, 16, 256
BLOCKS_PER_CHUNK = TOKENS // BLOCK
#: Blocks engine B keeps that no chunk is written to: they must stay zero.
SPARE_BLOCKS = BLOCKS_PER_CHUNK
SEED = 1234
_TIMEOUT_S = 600.0
#: How long an engine waits for the server to map its memory (a few seconds per 10 GiB).
_MAPPING_TIMEOUT_S = 120.0
#: The server's chunk-memory counters each scenario reports (``status``, after the puts).
_HOST_COUNTERS = ("host_prepared_bytes", "host_slow_takes", "host_registered_bytes", "host_register_failures")


def _layers(device: str, num_blocks: int) -> tuple[Any, list[Any]]:
    """The flat allocation and its per-layer views, as vLLM makes them."""
    import torch

    from .. import KVFormat, allocate_kv_caches

    views = allocate_kv_caches(
        KVFormat.VLLM,
        num_layers=LAYERS,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
        device=device,
        engine_layout=_order(device),
    )
    first = views[0]
    assert isinstance(first, torch.Tensor)
    flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
    return flat, list(views)


def _order(device: str) -> str:
    return "LBNHC" if device == "cuda" else "LBHNC"


def _pattern(flat: Any) -> Any:
    """The seeded bytes engine A writes (and B regenerates to check), made on the device."""
    import torch

    gen = torch.Generator(device=flat.device).manual_seed(SEED)
    return torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=flat.device, generator=gen)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _namespace() -> bytes:
    from ..protocol import cache_namespace

    return cache_namespace(
        model="serverpath",
        kv_layout=f"vllm [B, {HEADS}, {BLOCK}, {2 * HEAD_SIZE}] x {LAYERS}",
        dtype="bfloat16",
        block_size=BLOCK,
        chunk_size=TOKENS,
    )


def _keys(round_: int, chunks: int) -> list[bytes]:
    return [f"r{round_}-c{i}".encode().ljust(32, b".") for i in range(chunks)]


def _copy_baseline(flat: Any, nbytes: int, device: str) -> dict[str, float]:
    """GB/s of a ``copy_`` of one request's bytes each way: pinned on CUDA, host to host on CPU."""
    import torch

    src = flat[:nbytes]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    host.fill_(0)  # touched: the server's memory is touched too by the time it is reused
    out: dict[str, list[float]] = {"to_host": [], "from_host": []}
    for _ in range(4):
        for name, (dst, source) in {"to_host": (host, src), "from_host": (src, host)}.items():
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(source, non_blocking=True)
            _sync(device)
            out[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    return {name: statistics.median(v[1:]) for name, v in out.items()}  # the first warms up


def engine_main(conn: Connection, spec: dict[str, Any]) -> None:
    """An engine process: role ``A`` (puts) or ``B`` (gets, then checks); replies are JSON."""
    try:
        conn.send_bytes(json.dumps({"ok": True, **_engine(spec)}).encode())
    except Exception as exc:  # reported to the parent, which fails the run
        conn.send_bytes(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}).encode())


def _engine(spec: dict[str, Any]) -> dict[str, Any]:
    from .. import LayoutHints, wrap_kv_caches
    from ..client import ServerClient
    from ..server import DEFAULT_TORCH_THREADS

    device, chunks, per_request = spec["device"], spec["chunks"], spec["per_request"]
    flat, views = _layers(device, chunks * BLOCKS_PER_CHUNK + SPARE_BLOCKS)
    out: dict[str, Any] = {"kv_bytes": flat.numel()}
    if spec["role"] == "A":
        flat.copy_(_pattern(flat))
    else:
        flat.zero_()
    _sync(device)
    wrapped = wrap_kv_caches(views)
    hints = LayoutHints(block_size=BLOCK, engine_layout=_order(device), head_size=HEAD_SIZE)
    with ServerClient(spec["socket"], timeout=_TIMEOUT_S) as client:
        reg = client.register(
            wrapped,
            namespace=_namespace(),
            lmcache_tokens_per_chunk=TOKENS,
            layout_hints=hints,
            chunk_format=spec["chunk_format"],
        )
        out["chunk_bytes"] = reg.chunk_bytes
        request_bytes = reg.chunk_bytes * per_request
        out["mapped_s"] = _wait_mapped(client, reg.context)
        # A's chunk i is its blocks i*16.. in order; B's is the reverse order of chunks, after
        # the spare blocks, so every byte lands elsewhere than it came from.
        if spec["role"] == "A":
            ids = [[list(range(i * BLOCKS_PER_CHUNK, (i + 1) * BLOCKS_PER_CHUNK))] for i in range(chunks)]
            if spec.get("prepared"):  # a server started before its engines' stores: memory ready
                t0 = time.perf_counter()
                while client.status()["server"]["host_prepared_bytes"] < spec["prepared"]:
                    time.sleep(0.02)
                out["prepare_s"] = out["mapped_s"] + time.perf_counter() - t0  # from registering
            out["copy"] = _copy_baseline(flat, request_bytes, device)
            if device == "cpu":  # again with the server's torch threads (serve --torch-threads)
                import torch

                torch.set_num_threads(DEFAULT_TORCH_THREADS)  # the puts' copies are the server's
                out["copy_server_threads"] = _copy_baseline(flat, request_bytes, device)
            out["puts"] = []
            for round_ in range(spec["rounds"]):
                keys = _keys(round_, chunks)
                seconds = []
                for lo in range(0, chunks, per_request):
                    batch = list(zip(keys[lo : lo + per_request], ids[lo : lo + per_request], strict=True))
                    t0 = time.perf_counter()
                    stored = client.put(reg.context, batch).stored
                    seconds.append(time.perf_counter() - t0)
                    if stored != len(batch):
                        raise RuntimeError(f"round {round_}: the server stored {stored} of {len(batch)}")
                out["puts"].append(seconds)
            server = client.status()["server"]  # how the server's chunk memory was had
            out["host"] = {k: server[k] for k in _HOST_COUNTERS}
        else:
            ids = [
                [list(range(SPARE_BLOCKS + j * BLOCKS_PER_CHUNK, SPARE_BLOCKS + (j + 1) * BLOCKS_PER_CHUNK))]
                for j in reversed(range(chunks))
            ]
            keys = _keys(spec["rounds"] - 1, chunks)
            out["gets"] = []
            for lo in range(0, chunks, per_request):
                batch = list(zip(keys[lo : lo + per_request], ids[lo : lo + per_request], strict=True))
                t0 = time.perf_counter()
                got = client.get(reg.context, batch).retrieved
                out["gets"].append(time.perf_counter() - t0)
                if got != len(batch):
                    raise RuntimeError(f"the server gave back {got} of {len(batch)} chunks")
            out.update(_check(flat, views, ids, device))
        out["request_bytes"] = request_bytes
        client.unregister(reg.context)
    for w in wrapped:
        w.close()
    return out


def _wait_mapped(client: Any, context: int) -> float:
    """Seconds until the server has mapped this engine's memory (``engine_memory``).

    vLLM registers when its engine starts, seconds before its first request; a
    request sent at once would time the server's page faults on the engine's memory
    instead of the transfer (the operator guide, "The engine's memory").
    """
    t0 = time.perf_counter()
    while (memory := client.status(context)["context"]["engine_memory"])["state"] == "mapping":
        if time.perf_counter() - t0 > _MAPPING_TIMEOUT_S:
            late = f"the server did not map this engine's memory in {_MAPPING_TIMEOUT_S:.0f} s"
            raise RuntimeError(f"{late}: {memory}")
        time.sleep(0.02)
    return time.perf_counter() - t0


def _check(flat: Any, views: list[Any], ids: list[list[list[int]]], device: str) -> dict[str, Any]:
    """Every received block against A's pattern at its source block; the spare blocks zero."""
    import torch

    expected = torch.empty(0, dtype=torch.bfloat16, device=flat.device).set_(_pattern(flat).untyped_storage())
    want = [expected.as_strided(v.shape, v.stride(), v.storage_offset()) for v in views]
    mismatched = 0
    for j, (dst,) in enumerate(ids):  # key j holds A's chunk j
        src = list(range(j * BLOCKS_PER_CHUNK, (j + 1) * BLOCKS_PER_CHUNK))
        for got, ref in zip(views, want, strict=True):
            a = got[dst].contiguous().view(torch.int16)
            b = ref[src].contiguous().view(torch.int16)
            mismatched += int((a != b).sum())
    spare = sum(int(v[:SPARE_BLOCKS].contiguous().view(torch.int16).count_nonzero()) for v in views)
    _sync(device)
    return {"mismatched_elements": mismatched, "spare_nonzero": spare, "checked_chunks": len(ids)}


class _Serve:
    """``lmcache-platform serve`` in a subprocess, log in a file."""

    def __init__(self, socket_path: str, max_host_bytes: int, log: Path, host_memory: str = "ahead") -> None:
        self.socket = socket_path
        self.log = log
        cmd = [sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", socket_path]
        cmd += ["--max-host-bytes", str(max_host_bytes), "--host-memory", host_memory]
        with log.open("wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
        from ..client import ServerClient

        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                with ServerClient(socket_path, timeout=30) as c:
                    c.status()
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"serve did not listen within 120 s: {self.tail()}") from None
                time.sleep(0.05)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=engine_main, args=(theirs, spec), daemon=True)
    proc.start()
    theirs.close()
    try:
        if not ours.poll(_TIMEOUT_S):
            raise RuntimeError(f"engine {spec['role']} did not answer within {_TIMEOUT_S:g} s")
        answer: dict[str, Any] = json.loads(ours.recv_bytes())
    except EOFError:
        raise RuntimeError(f"engine {spec['role']} died (exit code {proc.exitcode})") from None
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()
    if not answer.pop("ok"):
        raise RuntimeError(f"engine {spec['role']}: {answer['error']}")
    return answer


def _rates(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    rates = [nbytes / s / 1e9 for s in seconds]
    stats = {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "requests": len(rates)}
    return {**stats, "each": rates}  # in request order


def scenario(
    name: str, device: str, chunks: int, per_request: int, workdir: Path, chunk_format: str = "blocks"
) -> dict[str, Any]:
    """One server, engine A's puts then engine B's gets; figures in GB/s."""
    rounds = 3 if name == "evicting" else 1
    # The working set's chunk bytes, known without a context: bf16 K and V of every layer.
    chunk_bytes = TOKENS * LAYERS * 2 * HEADS * HEAD_SIZE * 2
    working = chunks * chunk_bytes
    cap = working + chunk_bytes // 2 if name == "evicting" else 4 * working  # evicting: just above
    sock = str(workdir / f"{name}.sock")
    # prepared: `serve --host-memory eager`, and the stores wait until the working set is ready
    mode = "eager" if name == "prepared" else "ahead"
    serve = _Serve(sock, cap, workdir / f"serve-{name}.log", mode)
    base = {
        "device": device,
        "chunks": chunks,
        "per_request": per_request,
        "socket": sock,
        "rounds": rounds,
        "chunk_format": chunk_format,
    }
    if name == "prepared":
        base["prepared"] = cap  # eager: the whole bound, prepared before the first store
    try:
        a = _run_engine({**base, "role": "A"})
        b = _run_engine({**base, "role": "B"})
    finally:
        serve.stop()
    request_bytes = a["request_bytes"]
    timed = [s for r in (a["puts"][1:] if name == "evicting" else a["puts"]) for s in r]
    put, get = _rates(request_bytes, timed), _rates(request_bytes, b["gets"])
    ok = b["mismatched_elements"] == 0 and b["spare_nonzero"] == 0
    return {
        "scenario": name,
        "max_host_bytes": cap,
        "working_set_bytes": working,
        "request_bytes": request_bytes,
        "copy_to_host_gb_s": a["copy"]["to_host"],
        "copy_from_host_gb_s": a["copy"]["from_host"],
        "put_gb_s": put,
        "get_gb_s": get,
        "host_memory": mode,
        "prepare_s": a.get("prepare_s"),
        "engine_mapped_s": {"A": a["mapped_s"], "B": b["mapped_s"]},
        "host": a["host"],
        "put_vs_copy": put["median"] / a["copy"]["to_host"],
        "get_vs_copy": get["median"] / a["copy"]["from_host"],
        **_like_for_like(put["median"], get["median"], a.get("copy_server_threads")),
        "bytes_identical": ok,
        "check": {k: b[k] for k in ("mismatched_elements", "spare_nonzero", "checked_chunks")},
    }


def _like_for_like(put: float, get: float, copy: dict[str, float] | None) -> dict[str, float]:
    """On a host: the copy_ baseline with the server's torch threads, and the ratios to it."""
    if copy is None:
        return {}
    return {
        "copy_to_host_server_threads_gb_s": copy["to_host"],
        "copy_from_host_server_threads_gb_s": copy["from_host"],
        "put_vs_copy_server_threads": put / copy["to_host"],
        "get_vs_copy_server_threads": get / copy["from_host"],
    }


def run(device: str, chunks: int, per_request: int, chunk_format: str = "blocks") -> dict[str, Any]:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible")
    with tempfile.TemporaryDirectory(prefix="lmcache-serverpath-") as tmp:
        names = ("fresh", "prepared", "evicting")
        results = [scenario(n, device, chunks, per_request, Path(tmp), chunk_format) for n in names]
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": {
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_size": HEAD_SIZE,
            "block_size": BLOCK,
            "chunk_tokens": TOKENS,
            "dtype": "bfloat16",
            "layout": _order(device),
            "chunks": chunks,
            "chunks_per_request": per_request,
            "chunk_format": chunk_format,
        },
        "scenarios": results,
    }


def bench_server(
    report: Any, settings: Any, *, chunks: int | None, per_request: int | None, chunk_format: str
) -> None:
    """The ``server`` section of ``lmcache-platform bench``: every scenario's put and get rates.

    Each request's rate is one value of its row (GB/s); the ratio is to a ``copy_`` of the
    same bytes (on the host, with the server's torch threads). Bytes that differ raise.
    """
    from .stats import Result, SpeedTarget

    device = settings.device
    chunks = chunks or (64 if device == "cuda" else (4 if settings.quick else 8))
    per_request = per_request or (8 if device == "cuda" else (2 if settings.quick else 4))
    if chunks % per_request:
        raise ValueError(f"--chunks ({chunks}) must be a multiple of --per-request ({per_request})")
    r = run(device, chunks, per_request, chunk_format)
    report.meta["server"] = r  # the whole run, as ``--json`` of this module writes it
    for s in r["scenarios"]:
        params = {"scenario": s["scenario"], "chunks": chunks, "per_request": per_request}
        for op, copy_key, threads_key in (
            ("put", "copy_to_host_gb_s", "copy_to_host_server_threads_gb_s"),
            ("get", "copy_from_host_gb_s", "copy_from_host_server_threads_gb_s"),
        ):
            rates = s[f"{op}_gb_s"]
            baseline = s.get(threads_key, s[copy_key])
            report.results.append(
                Result("server", op, "GB/s", tuple(rates["each"]), params, ratio=rates["median"] / baseline)
            )
        if not s["bytes_identical"]:
            raise RuntimeError(f"server path, {s['scenario']}: bytes differ: {json.dumps(s['check'])}")
    fresh = next(s for s in r["scenarios"] if s["scenario"] == "fresh")
    for op in ("put", "get"):
        ratio = fresh.get(f"{op}_vs_copy_server_threads", fresh[f"{op}_vs_copy"])
        goal = 0.9 if device == "cuda" else 0.8
        report.targets.append(
            SpeedTarget.at_least(
                f"server {op}", f"a fresh serve's {op} >= {goal:g}x copy_ of the same bytes", ratio, goal
            )
        )


def _host_line(host: dict[str, int]) -> str:
    """The server's chunk memory in a few words: prepared, taken on the request path, registered."""
    mib = 2**20
    prepared, slow = host["host_prepared_bytes"] / mib, host["host_slow_takes"]
    line = f"; host memory: {prepared:.0f} MiB prepared, {slow} slow takes"
    if host["host_registered_bytes"] or host["host_register_failures"]:
        line += (
            f", {host['host_registered_bytes'] / mib:.0f} MiB registered with the device"
            f" ({host['host_register_failures']} refused)"
        )
    return line


def format_report(r: dict[str, Any]) -> str:
    m = r["model"]
    mib = 2**20
    lines = [
        f"Server path on {r['device']} (torch {r['torch']}): a `serve` process and two engine processes",
        f"  vLLM {m['layout']} KV, {m['layers']} layers x {m['kv_heads']} heads x {m['head_size']}, "
        f"{m['dtype']}, block {m['block_size']}, {m['chunk_tokens']}-token chunks in the "
        f"{m['chunk_format']!r} format; {m['chunks']} chunks, "
        f"{m['chunks_per_request']} per request; GB/s from request to answer (median, min-max)",
    ]
    for s in r["scenarios"]:
        put, get = s["put_gb_s"], s["get_gb_s"]
        lines.append(
            f"  {s['scenario']:<9} cap {s['max_host_bytes'] / mib:.0f} MiB for "
            f"{s['working_set_bytes'] / mib:.0f} MiB: "
            f"put {put['median']:.2f} ({put['min']:.2f}-{put['max']:.2f}) = {s['put_vs_copy']:.2f}x copy_ "
            f"{s['copy_to_host_gb_s']:.1f}; get {get['median']:.2f} ({get['min']:.2f}-{get['max']:.2f}) = "
            f"{s['get_vs_copy']:.2f}x copy_ {s['copy_from_host_gb_s']:.1f}; "
            f"bytes {'identical' if s['bytes_identical'] else 'DIFFER: ' + json.dumps(s['check'])}"
            + (f"; memory prepared {s['prepare_s']:.1f} s after registering" if s.get("prepare_s") else "")
            + f"; engine memory mapped {s['engine_mapped_s']['A']:.1f} / {s['engine_mapped_s']['B']:.1f} s"
            " after registering (A / B)" + _host_line(s["host"])
        )
        if "put_vs_copy_server_threads" in s:
            lines.append(
                f"  {'':<9} against copy_ with the server's torch threads: put "
                f"{s['put_vs_copy_server_threads']:.2f}x {s['copy_to_host_server_threads_gb_s']:.1f}; get "
                f"{s['get_vs_copy_server_threads']:.2f}x {s['copy_from_host_server_threads_gb_s']:.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_platform._bench.serverpath", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--chunks", type=int, help="working set in chunks (default: 64 on cuda, 8 on cpu)")
    parser.add_argument(
        "--per-request", type=int, help="chunks per put or get (default: 8 on cuda, 4 on cpu)"
    )
    parser.add_argument(
        "--chunk-format",
        choices=("blocks", "tokens"),
        default="blocks",
        help="the contexts' chunk format: the engine's own blocks, as the vLLM connector registers "
        "(default), or token-major",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON to FILE")
    args = parser.parse_args(argv)
    chunks = args.chunks or (64 if args.device == "cuda" else 8)
    per_request = args.per_request or (8 if args.device == "cuda" else 4)
    if chunks < 1 or per_request < 1 or chunks % per_request:
        parser.error("--chunks must be a positive multiple of --per-request")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        report = run(args.device, chunks, per_request, args.chunk_format)
    except RuntimeError as exc:
        print(f"server path: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    return 0 if all(s["bytes_identical"] for s in report["scenarios"]) else 1


if __name__ == "__main__":
    sys.exit(main())

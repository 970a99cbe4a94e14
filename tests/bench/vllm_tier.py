"""vLLM's native offloading: ``LMCachePlatformTier`` beside vLLM's own ``fs`` tier, same chunks.

Run with the vLLM virtualenv's Python::

    PYTHONPATH=tests .venv-vllm/bin/python -m bench.vllm_tier [--chunks 256] [--chunk-mib 1] [--tier serve ...] [--json]

For each tier (through ``lmcache-platform serve``, straight to ``file://``, vLLM's ``fs``),
engine A (a process: vLLM's ``TieringOffloadingSpec(...).get_manager()`` with that tier,
``tests/support/vllm_tier_engine.py``) fills its primary rows and completes the store;
"store" is the time from vLLM's cascade to every job reported. Engine B, another process
with an empty primary tier, looks every chunk up until vLLM has promoted it; "load" is
that time, and its bytes are then checked against A's. Every call vLLM's scheduler thread
makes into the tier is timed (the longest and the p99 over A's and B's calls). The file
store and ``fs`` write under ``--dir`` (default: a temporary directory on /tmp, whose
file system is what the figures measure); the server keeps the chunks in its memory, run
as a host dedicated to it would run it (``--host-memory eager``: its memory mapped ahead,
``--settle-s`` to do so before the first engine starts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-m", "support.vllm_tier_engine", json.dumps(spec)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"engine failed ({proc.returncode}): {proc.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def run(name: str, tier: dict[str, Any], chunks: int, chunk_bytes: int) -> dict[str, Any]:
    base = {"model": f"bench-{uuid.uuid4().hex[:8]}", "chunks": chunks, "chunk_bytes": chunk_bytes,
            "tiers": [tier], "timeout_s": 600}  # fmt: skip
    a = engine({**base, "engine_id": uuid.uuid4().hex[:12], "phases": [{"mode": "store", "seed": 7}]})
    b = engine({**base, "engine_id": uuid.uuid4().hex[:12], "phases": [{"mode": "load", "seed": 7}]})
    store, load = a["phases"][0], b["phases"][0]
    nbytes = chunks * a["row_bytes"]
    calls = a["tier_calls"][0], b["tier_calls"][0]
    return {
        "tier": name,
        "store_gb_s": nbytes / store["store_s"] / 1e9,
        "load_gb_s": nbytes / load["load_s"] / 1e9,
        "identical": load["identical"],
        "wrong": load["wrong"],
        "max_call_ms": max(c["max_ms"] for c in calls),
        "p99_call_ms": max(c["p99_ms"] for c in calls),
        "worst_method": max(((m, v) for c in calls for m, v in c["worst_ms"].items()), key=lambda x: x[1])[0],
    }


#: The tiers compared, by the name ``--tier`` takes.
TIERS = ("serve", "serve-parallel", "file", "fs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--chunk-mib", type=float, default=1.0)
    parser.add_argument("--dir", default=None, help="where the file store and fs write (default: a temp dir)")
    parser.add_argument("--settle-s", type=float, default=5.0, help="wait after serve listens (default 5)")
    parser.add_argument(
        "--tier", action="append", choices=TIERS, help="repeatable (default: every one, in this order)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    work = Path(tempfile.mkdtemp(prefix="lmcache-bench-tier-", dir=args.dir))
    sock_dir = Path(tempfile.mkdtemp(prefix="lmcache-bench-tier-sock-"))
    sock_dir.chmod(0o700)
    sock = sock_dir / "kv.sock"
    mem = f"{2 * args.chunks * chunk_bytes + (64 << 20)}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", str(sock), "--max-host-bytes", mem,
         "--host-memory", "eager"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("serve did not start")
            time.sleep(0.05)
        time.sleep(args.settle_s)  # --host-memory eager maps the server's memory in the background
        (work / "store").mkdir()
        (work / "fs").mkdir()
        ours = {"type": "LMCachePlatformTier", "module_path": "lmcache_platform.vllm.tier"}
        tiers: dict[str, tuple[str, dict[str, Any]]] = {
            "serve": ("LMCachePlatformTier via serve", {**ours, "socket": str(sock)}),
            "serve-parallel": (
                "  the same, parallel_requests 2",
                {**ours, "socket": str(sock), "parallel_requests": 2},
            ),
            "file": ("LMCachePlatformTier file://", {**ours, "remote": f"file://{work / 'store'}"}),
            "fs": ("vLLM fs", {"type": "fs", "root_dir": str(work / "fs")}),
        }
        rows = [run(*tiers[key], args.chunks, chunk_bytes) for key in args.tier or TIERS]
    finally:
        serve.terminate()
        serve.wait(30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    if args.json:
        print(json.dumps({"chunks": args.chunks, "chunk_bytes": chunk_bytes, "rows": rows}, indent=2))
        return
    print(
        f"{args.chunks} chunks of {chunk_bytes / 2**20:g} MiB; engine A stores, engine B (another process) loads"
    )
    print(
        f"{'tier':32} {'store GB/s':>10} {'load GB/s':>10} {'max call ms':>12} {'p99 call ms':>12}  identical"
    )
    for r in rows:
        print(f"{r['tier']:32} {r['store_gb_s']:10.2f} {r['load_gb_s']:10.2f} {r['max_call_ms']:12.3f} "
              f"{r['p99_call_ms']:12.3f}  {r['identical']}/{args.chunks} (worst: {r['worst_method']})")  # fmt: skip


if __name__ == "__main__":
    main()

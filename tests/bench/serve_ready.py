"""How soon ``serve`` answers with its host memory prepared from its start, against ``ahead``.

Run with the project's venv::

    PYTHONPATH=tests .venv/bin/python -m bench.serve_ready [--max-host-bytes 4G] [--rounds 3] [--json]

Each round starts ``lmcache-platform serve`` twice, with default flags (``eager``: all of
``--max-host-bytes`` prepared in the background from the start) and with
``--host-memory ahead``, interleaved, and prints the seconds from starting the process to
its first answered ``status``; for the default also the seconds until all of its memory
was prepared and the server's CPU seconds by then. Prints figures; asserts nothing.
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
from typing import Any

from lmcache_platform.server import ServerClient


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def once(max_host_bytes: str, extra: list[str]) -> dict[str, Any]:
    """One start: ready seconds (and, eager, when its memory was prepared and serve's CPU by then)."""
    directory = tempfile.mkdtemp(prefix="serve-ready-")
    os.chmod(directory, 0o700)
    sock = os.path.join(directory, "kv.sock")
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_PLATFORM_HOST_MEMORY"}
    cmd = [sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", sock]
    t0 = time.monotonic()
    with open(os.path.join(directory, "serve.log"), "wb") as log:
        proc = subprocess.Popen([*cmd, "--max-host-bytes", max_host_bytes, *extra], stderr=log, env=env)
    try:
        while True:
            try:
                with ServerClient(sock, timeout=30) as client:
                    client.status()
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if proc.poll() is not None:
                    raise SystemExit(f"serve exited with {proc.returncode}") from None
                time.sleep(0.01)
        row: dict[str, Any] = {"ready_s": time.monotonic() - t0}
        if not extra:
            while True:
                with ServerClient(sock, timeout=30) as client:
                    server = client.status()["server"]
                if server["host_prepared_bytes"] >= server["host_prepare_target_bytes"]:
                    break
                if time.monotonic() - t0 > 300:
                    row["not_prepared_within_s"] = 300
                    break
                time.sleep(0.2)
            row["prepared_bytes"] = server["host_prepared_bytes"]
            row["prepared_s"] = time.monotonic() - t0
            row["serve_cpu_s"] = cpu_seconds(proc.pid)
        return row
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(directory, ignore_errors=True)


def describe(row: dict[str, Any]) -> str:
    line = f"ready {row['ready_s']:.2f} s"
    if "prepared_s" in row:
        late = " (not prepared within 300 s)" if "not_prepared_within_s" in row else ""
        line += (
            f"{late}, {row['prepared_bytes'] / 2**30:.2f} GiB prepared {row['prepared_s']:.1f} s "
            f"after the start, serve's CPU {row['serve_cpu_s']:.1f} s by then"
        )
    return line


MODES = {"default (eager)": [], "--host-memory ahead": ["--host-memory", "ahead"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-host-bytes", default="4G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = []
    for r in range(args.rounds):
        for name, extra in MODES.items():
            row = {"round": r + 1, "mode": name, **once(args.max_host_bytes, extra)}
            rows.append(row)
            if not args.json:
                print(f"{name}: {describe(row)}", flush=True)
    if args.json:
        print(json.dumps({"max_host_bytes": args.max_host_bytes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""How soon ``serve`` answers with its host memory prepared from its start, against ``ahead``.

Run with the project's venv::

    .venv/bin/python tests/bench/serve_ready.py [--max-host-bytes 4G] [--rounds 3]

Each round starts ``lmcache-platform serve`` twice, with default flags (``eager``: all of
``--max-host-bytes`` prepared in the background from the start) and with
``--host-memory ahead``, interleaved, and prints the seconds from starting the process to
its first answered ``status``; for the default also the seconds until all of its memory
was prepared and the server's CPU seconds by then. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from lmcache_platform.server import ServerClient


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def once(max_host_bytes: str, extra: list[str]) -> str:
    """One start: ready seconds (and, eager, when its memory was prepared)."""
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
                    return f"serve exited with {proc.returncode}"
                time.sleep(0.01)
        line = f"ready {time.monotonic() - t0:.2f} s"
        if not extra:
            while True:
                with ServerClient(sock, timeout=30) as client:
                    server = client.status()["server"]
                if server["host_prepared_bytes"] >= server["host_prepare_target_bytes"]:
                    break
                if time.monotonic() - t0 > 300:
                    line += " (not prepared within 300 s)"
                    break
                time.sleep(0.2)
            line += (
                f", {server['host_prepared_bytes'] / 2**30:.2f} GiB prepared {time.monotonic() - t0:.1f} s "
                f"after the start, serve's CPU {cpu_seconds(proc.pid):.1f} s by then"
            )
        return line
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-host-bytes", default="4G")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for name, extra in (("default (eager)", []), ("--host-memory ahead", ["--host-memory", "ahead"])):
            print(f"{name}: {once(args.max_host_bytes, extra)}", flush=True)


if __name__ == "__main__":
    main()

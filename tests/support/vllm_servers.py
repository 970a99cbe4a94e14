"""KV-cache servers for the real-vLLM tests: ``lmcache-platform serve`` and a test double.

:class:`Server` runs either the real ``lmcache-platform serve`` (``double=False``) or
:class:`DoubleServer` (``python -m support.vllm_servers``): the reference server with switchable
misbehaviour, for failures that a real server shows only by chance. Both run with the
vLLM virtualenv's Python (the server maps the engine's torch tensors), each in its own
private socket directory, and either can be stopped (SIGSTOP), continued or killed.
``args`` are more ``serve`` flags (``--remote URL``); :meth:`Server.restart` runs the
server again on the same socket (other flags allowed), so its engines reconnect to it.

The double reads ``mode.json`` in its directory at every ``get``:

``{"get": "normal"}``
    the reference server's own ``get``;
``{"get": "refuse"}``
    every ``get`` fails with an error reply (``TransferError``) and writes nothing;
``{"get": "drop"}``
    the requested chunks are dropped from the cache just before the ``get`` runs (what an
    eviction between the scheduler's ``lookup`` and the worker's ``get`` does), pins or not;
``{"get": "sleep", "sleep_s": S}``
    the ``get`` starts after ``S`` seconds (a server that answers after the caller's
    deadline, or one to kill mid-load); with ``"scramble": true`` the chunks it then
    writes are first overwritten with a byte pattern, so that a late write is seen;
``{"lookup": "miss"}``
    every ``lookup`` answers no hits (the engine computes everything itself).

It appends one JSON line per event to ``events.jsonl`` (``get`` begin and end, with the
chunks written) and serves ``control`` requests, ``support.commands``' requests and
answers in files: ``control-<n>.json`` holds ``clear`` (drop every shared chunk, or with
``namespace`` (hex) those of one namespace) or ``dump`` (per stored chunk: its namespace,
key, and whether its payload is all zero), answered in ``control-<n>.out.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_platform.client._link import socket_identity
from support import commands

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


# -- the pytest side -----------------------------------------------------------------------


class Server:
    """A server process on a socket in a fresh private directory under ``tmp``."""

    def __init__(
        self,
        python: Path,
        tmp: Path,
        *,
        double: bool = False,
        max_host_bytes: int | str | None = None,
        name: str = "srv",
        args: Sequence[str] = (),
    ) -> None:
        self.dir = tmp / name
        self.dir.mkdir(mode=0o700)
        self.socket = str(self.dir / "server.sock")
        self.log = self.dir / "server.log"
        self.double = double
        self._control = 0
        if double:
            self.set_mode(get="normal")
            cmd = [str(python), "-m", "support.vllm_servers", "--socket", self.socket, "--dir", str(self.dir)]
        else:
            cmd = [str(python), "-m", "lmcache_platform._cli", "serve", "--socket", self.socket]
        if max_host_bytes is not None:
            cmd += ["--max-host-bytes", str(max_host_bytes)]
        self._cmd = cmd
        # The double runs as a module of tests/support, as pytest imports it (``tests`` on the path).
        self._env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        }
        self._spawn(list(args))

    def _spawn(self, args: list[str]) -> None:
        """Start the process; return once it listens (a killed server's socket file may remain)."""
        self.args = args
        stale = socket_identity(self.socket)
        with self.log.open("a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [*self._cmd, *args], stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT, env=self._env
            )
        deadline = time.monotonic() + 60
        while socket_identity(self.socket) in (None, stale):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    # -- signals ---------------------------------------------------------------------------

    def sigstop(self) -> None:
        from support.procs import sigstop

        sigstop(self.proc.pid)

    def sigcont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies at once either way
            self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def restart(self, args: Sequence[str] | None = None) -> None:
        """Stop, then serve again on the same socket with ``args`` (default: the same flags)."""
        self.stop()
        self._spawn(list(self.args if args is None else args))

    # -- what it holds -----------------------------------------------------------------------

    def status(self, timeout: float = 10) -> dict[str, Any]:
        """The server's own counters (``ServerClient.status()['server']``)."""
        from lmcache_platform.server import ServerClient

        with ServerClient(self.socket, timeout=timeout) as client:
            return dict(client.status()["server"])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    # -- the double's switches ---------------------------------------------------------------

    def set_mode(self, **mode: Any) -> None:
        tmp = self.dir / "mode.json.tmp"
        tmp.write_text(json.dumps(mode))
        tmp.replace(self.dir / "mode.json")

    def events(self) -> list[dict[str, Any]]:
        path = self.dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_event(self, pred: Any, timeout: float, *, after: int = 0) -> dict[str, Any] | None:
        """The first event from the ``after``-th on for which ``pred`` holds; None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events()[after:]:
                if pred(ev):
                    return ev
            time.sleep(0.05)
        return None

    def control(self, action: str, timeout: float = 30, **fields: Any) -> Any:
        assert self.double, "control requests need the test double"
        self._control += 1
        req = self.dir / f"control-{self._control}.json"
        out = self.dir / f"control-{self._control}.out.json"
        tmp = req.with_suffix(".tmp")
        tmp.write_text(json.dumps(commands.message(action, fields)))
        tmp.replace(req)
        deadline = time.monotonic() + timeout
        while not out.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"the test double did not answer {action}: {self.log_text()[-2000:]}")
            time.sleep(0.05)
        return commands.result_of(action, json.loads(out.read_text()))


# -- the double (python -m support.vllm_servers, with the vLLM venv's Python) -------------


def _double_class() -> type:
    import torch

    from lmcache_platform._errors import TransferError
    from lmcache_platform.server import GetResult, LookupResult, ReferenceServer
    from lmcache_platform.server._index import ChunkIndex

    class DoubleServer(ReferenceServer):  # type: ignore[misc, valid-type]
        def __init__(self, socket_path: str, directory: Path, **kw: Any) -> None:
            super().__init__(socket_path, **kw)
            self.directory = directory
            self._events_lock = threading.Lock()

        def _lookup(self, req: Any, conn: Any) -> LookupResult:
            if self._mode().get("lookup") == "miss":
                return LookupResult(hits=0)
            result: LookupResult = super()._lookup(req, conn)
            return result

        def _get(self, req: Any, conn: Any) -> GetResult:
            mode = self._mode()
            what = mode.get("get", "normal")
            self._event(op="get", phase="begin", mode=what, chunks=len(req.chunks))
            if what == "refuse":
                self._event(op="get", phase="end", mode=what, refused=True)
                raise TransferError("the test double refuses every get")
            if what == "sleep":
                time.sleep(float(mode.get("sleep_s", 10)))
                if mode.get("scramble"):
                    namespace = self._entries[req.context].namespace
                    self._scramble(namespace, [c.chunk_id for c in req.chunks])
            if what == "drop":
                namespace = self._entries[req.context].namespace
                dropped = self._drop(namespace, [c.chunk_id for c in req.chunks])
                self._event(op="get", phase="dropped", dropped=dropped)
            try:
                out: GetResult = super()._get(req, conn)
            except Exception as exc:
                self._event(op="get", phase="end", mode=what, error=f"{type(exc).__name__}: {exc}")
                raise
            self._event(op="get", phase="end", mode=what, retrieved=out.retrieved)
            return out

        def _mode(self) -> dict[str, Any]:
            try:
                return dict(json.loads((self.directory / "mode.json").read_text()))
            except (OSError, ValueError):
                return {}

        def _event(self, **fields: Any) -> None:
            line = json.dumps({"t": time.monotonic(), **fields})
            with self._events_lock, (self.directory / "events.jsonl").open("a") as f:
                f.write(line + "\n")

        def _drop(self, namespace: bytes, keys: list[Any]) -> int:
            index: ChunkIndex = self._index
            with index._lock:
                doomed = [(namespace, k) for k in keys if (namespace, k) in index._lru]
                return int(index._evict(doomed))

        def _scramble(self, namespace: bytes, keys: list[Any]) -> None:
            index: ChunkIndex = self._index
            with index._lock:
                for k in keys:
                    stored = index._lru.get((namespace, k))
                    if stored is not None:
                        for t in stored.payload:
                            t.view(-1).view(torch.uint8).fill_(0x3C)

        def control_loop(self) -> None:
            done: set[str] = set()
            while not self._stop.is_set():
                for req in sorted(self.directory.glob("control-*.json")):
                    if req.name.endswith(".out.json") or req.name in done:
                        continue
                    done.add(req.name)
                    reply = commands.answer(
                        json.loads(req.read_text()), {"clear": self._clear, "dump": self._dump}
                    )
                    out = req.with_name(req.name.replace(".json", ".out.json"))
                    tmp = out.with_suffix(".tmp")
                    tmp.write_text(json.dumps(reply))
                    tmp.replace(out)
                time.sleep(0.05)

        def _shared(self, namespace: str | None) -> list[Any]:
            """The evictable chunks' keys (of one namespace, given as hex); the index's lock held."""
            shared: list[Any] = [fk for fk, c in self._index._lru.items() if c.evictable]
            return shared if namespace is None else [fk for fk in shared if bytes(fk[0]).hex() == namespace]

        def _clear(self, namespace: str | None = None) -> dict[str, int]:
            index: ChunkIndex = self._index
            with index._lock:
                return {"cleared": int(index._evict(self._shared(namespace)))}

        def _dump(self, namespace: str | None = None) -> list[dict[str, Any]]:
            index: ChunkIndex = self._index
            with index._lock:
                return [
                    {
                        "namespace": bytes(fk[0]).hex(),
                        "key": bytes(fk[1]).hex(),
                        "all_zero": all(not bool(t.any()) for t in index._lru[fk].payload),
                        "nbytes": index._lru[fk].nbytes,
                    }
                    for fk in self._shared(namespace)
                ]

    return DoubleServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the reference server with switchable misbehaviour")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--max-host-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    import torch  # noqa: F401 - before the first request, as serve does

    kw = {} if args.max_host_bytes is None else {"max_host_bytes": args.max_host_bytes}
    server = _double_class()(args.socket, args.dir, **kw)
    server.bind()
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    threading.Thread(target=server.control_loop, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()

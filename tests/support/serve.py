"""Shared pieces of the server tests: a real ``lmcache-platform serve`` process and a tiny engine.

:class:`Serve` runs the real command (``python -m lmcache_platform._cli serve``) as a
subprocess with its stderr in a file; :class:`TinyEngine` is an engine's side: real CPU
KV tensors wrapped by the installed cpu backend, and the calls a connector makes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import lmcache_platform
from lmcache_platform import KVFormat, LayoutHints
from lmcache_platform.server import ReferenceServer, Registration, ServerClient, cache_namespace

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 2, 32, 4, 2, 8
CHUNK = 8  # tokens: two blocks per chunk
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD * 4  # float32
START_TIMEOUT_S = 60.0


def namespace(model: str = "tiny", head: int = HEAD) -> bytes:
    return cache_namespace(
        model=model,
        kv_layout=f"flash_attn [2, *, {BLOCK}, {HEADS}, {head}] x {LAYERS}",
        dtype="float32",
        block_size=BLOCK,
        chunk_size=CHUNK,
    )


class Serve:
    """``lmcache-platform serve`` in a subprocess; stderr (the log) goes to ``log_path``."""

    def __init__(self, socket_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.socket_path = socket_path
        self.log_path = (
            socket_path.parent.parent / f"serve-{socket_path.parent.name}-{time.monotonic_ns()}.log"
        )
        cmd = [sys.executable, "-m", "lmcache_platform._cli", "serve", *args]
        if "--socket" not in args and not (env and "LMCACHE_PLATFORM_SOCKET" in env):
            cmd += ["--socket", str(socket_path)]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **(env or {})}
            )

    def wait_ready(self) -> Serve:
        """Until a status request is answered; fail if the process exits first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}: {self.log()}")
            try:
                with ServerClient(str(self.socket_path), timeout=30) as c:
                    c.status()
                return self
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline, f"serve did not listen: {self.log()}"
                time.sleep(0.05)

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit()

    def log(self) -> str:
        return self.log_path.read_text()

    def events(self) -> list[dict[str, Any]]:
        """Every log line as JSON (``--json-log``): fails on a line that is not one object."""
        return [json.loads(line) for line in self.log().splitlines()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def __enter__(self) -> Serve:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def private_dir(tmp: Path, name: str = "s") -> Path:
    d = tmp / name
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    return d


def stale_socket(path: Path) -> None:
    """Leave a socket file at ``path`` that nobody listens on, as a killed server does."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


class TinyEngine:
    """Paged KV caches of a tiny model in shared memory, wrapped, with a known pattern per chunk."""

    def __init__(self, head: int = HEAD) -> None:
        self.head = head
        shape = (2, BLOCKS, BLOCK, HEADS, head)
        self.tensors = [torch.zeros(shape, dtype=torch.float32) for _ in range(LAYERS)]
        self.wrappers = lmcache_platform.wrap_kv_caches(self.tensors)
        self.hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=BLOCK, num_kv_heads=HEADS)

    def register(self, client: ServerClient, ns: bytes | None = None) -> int:
        return self.registration(client, ns).context

    def registration(self, client: ServerClient, ns: bytes | None = None) -> Registration:
        return client.register(
            self.wrappers, namespace=ns, lmcache_tokens_per_chunk=CHUNK, layout_hints=self.hints
        )

    @staticmethod
    def blocks(i: int) -> list[int]:
        """The two blocks of slot ``i`` (0 <= i < BLOCKS // 2)."""
        return [2 * i, 2 * i + 1]

    def fill(self, i: int, seed: int) -> None:
        """Write a pattern unique to ``seed`` into the blocks of slot ``i``."""
        gen = torch.Generator().manual_seed(seed)
        for t in self.tensors:
            t[:, self.blocks(i)] = torch.rand(t[:, self.blocks(i)].shape, generator=gen)

    def holds(self, i: int, seed: int) -> bool:
        """Whether the blocks of slot ``i`` hold exactly the pattern of ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        return all(
            torch.equal(t[:, self.blocks(i)], torch.rand(t[:, self.blocks(i)].shape, generator=gen))
            for t in self.tensors
        )

    def is_zero(self, i: int) -> bool:
        return all(not t[:, self.blocks(i)].any() for t in self.tensors)

    def zero(self) -> None:
        for t in self.tensors:
            t.zero_()

    def close(self) -> None:
        for w in self.wrappers:
            w.close()


#: A bound for in-process waits, never a measured time.
IN_PROCESS_WAIT_S = 60


class Held:
    """Wraps a context method: the first call stops inside it until :meth:`release`."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.entered = threading.Event()
        self.go = threading.Event()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.go.wait(IN_PROCESS_WAIT_S), "the held transfer was never released"
        return self.method(*args, **kwargs)

    def release(self) -> None:
        self.go.set()


class InProcess:
    """A ReferenceServer on a thread of this process, so tests can reach its contexts."""

    def __init__(self, max_host_bytes: int) -> None:
        self.directory = tempfile.mkdtemp(prefix="lmcache-inproc-")
        self.server = ReferenceServer(os.path.join(self.directory, "kv.sock"), max_host_bytes=max_host_bytes)
        self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self) -> ServerClient:
        return ServerClient(self.server.socket_path, timeout=IN_PROCESS_WAIT_S)

    def ctx(self, context: int) -> Any:
        return self.server._entries[context].ctx

    def hold(self, context: int, method: str) -> Held:
        """Hold the next call of ``method`` on the server's cache context ``context``."""
        held = Held(getattr(self.ctx(context), method))
        setattr(self.ctx(context), method, held)  # an instance attribute: the server's next call lands here
        return held

    def counters(self) -> dict[str, Any]:
        return self.server.counters()

    def close(self) -> None:
        self.server.stop()
        self.thread.join(IN_PROCESS_WAIT_S)
        os.rmdir(self.directory)

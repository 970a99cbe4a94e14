"""The reference server in a process of its own: :class:`ServerProcess` (spawn), and what a
server process does once at start (``freeze_startup_objects``), which ``lmcache-platform
serve`` does too, as ``raise_fd_limit``).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from typing import Any

from .._errors import LMCachePlatformError
from ._server import DEFAULT_MAX_HOST_BYTES, DEFAULT_TORCH_THREADS, SOCKET_NAME, ReferenceServer

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Leave every object alive now (torch, the backends) out of later GC passes; how many.

    A full collection walks every tracked object: after ``import torch`` about 170,000 of
    them, 120 ms on the development VM, and a server holding chunks runs one every few
    seconds under load, inside whichever request allocated last (after a shared-prefix
    workload, 0.57 s of GC in 10 s of loads, more than their copies took). ``gc.freeze``
    moves them where the collector never looks. Call it once, after the imports.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; ``(before, after)``.

    A server holds an fd per engine connection and, while an engine registers, one per
    physical allocation it shares (vLLM 0.34 exports one per layer, 32 to 80 a worker);
    the soft limit is often 1,024 where the hard one is far higher. An unlimited hard
    limit stops at the kernel's ``fs.nr_open``. Not Linux, or not allowed: unchanged.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            return soft, soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            logger.debug("RLIMIT_NOFILE stays at %d: %s", soft, exc)
            return soft, soft
        return soft, target
    return soft, soft


def _child_main(
    socket_path: str, max_host_bytes: int, parallel_transfers: bool, torch_threads: int, ready: Any
) -> None:
    """Entry point of the spawned server process."""
    logging.basicConfig(level=logging.WARNING, format="lmcache server: %(message)s")
    server = ReferenceServer(
        socket_path, max_host_bytes=max_host_bytes, parallel_transfers=parallel_transfers
    )
    try:
        import torch  # pay the import before "ready", not in the first request

        torch.set_num_threads(torch_threads)
        freeze_startup_objects()
        server.bind()
    except BaseException as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    ready.send(("ready", os.getpid()))
    ready.close()
    server.serve_forever()


class ServerProcess:
    """A :class:`ReferenceServer` in a spawned process, with its private socket directory.

    Use as a context manager. :meth:`stop` asks for a clean shutdown, then
    terminates if needed, and always removes the socket directory. The process runs
    torch with ``torch_threads`` intra-op threads (see :data:`DEFAULT_TORCH_THREADS`).
    """

    def __init__(
        self,
        *,
        max_host_bytes: int = DEFAULT_MAX_HOST_BYTES,
        start_timeout: float = 60.0,
        parallel_transfers: bool = True,
        torch_threads: int = DEFAULT_TORCH_THREADS,
    ) -> None:
        self.max_host_bytes = max_host_bytes
        self.parallel_transfers = parallel_transfers
        self.torch_threads = torch_threads
        self.start_timeout = start_timeout
        self.directory: str | None = None
        self.socket_path = ""
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> ServerProcess:
        """Spawn the server and wait until it listens; raise :class:`~lmcache_platform.ServerError` if not."""
        from .._errors import ServerError

        self.directory = tempfile.mkdtemp(prefix="lmcache-platform-")  # mode 0700
        self.socket_path = os.path.join(self.directory, SOCKET_NAME)
        mp = multiprocessing.get_context("spawn")
        parent_end, child_end = mp.Pipe(duplex=False)
        self._process = mp.Process(
            target=_child_main,
            args=(
                self.socket_path,
                self.max_host_bytes,
                self.parallel_transfers,
                self.torch_threads,
                child_end,
            ),
            name="lmcache-platform-server",
            daemon=True,
        )
        try:
            self._process.start()
            child_end.close()
            if not parent_end.poll(self.start_timeout):
                raise ServerError(f"the server did not start within {self.start_timeout:.0f} s")
            try:
                kind, detail = parent_end.recv()
            except EOFError:
                self._process.join(5)
                raise ServerError(
                    f"the server process exited during start-up (exit code {self._process.exitcode})"
                ) from None
            if kind != "ready":
                raise ServerError(f"the server failed to start: {detail}")
        except BaseException:
            self.stop()
            raise
        finally:
            parent_end.close()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down and remove its directory. Idempotent."""
        proc, self._process = self._process, None
        try:
            if proc is not None and proc.is_alive():
                self._request_shutdown(timeout)
                proc.join(timeout)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            if proc is not None:
                proc.close()
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = None

    def _request_shutdown(self, timeout: float) -> None:
        from ..client._client import ServerClient

        try:
            with ServerClient(self.socket_path, timeout=timeout) as client:
                client.shutdown()
        except (OSError, LMCachePlatformError) as exc:
            logger.debug("clean shutdown request failed (%s); terminating", exc)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

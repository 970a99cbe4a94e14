"""Shared helpers of the reliability matrix: resource probes, figures, forged segment names.

Everything here reads the kernel's own view of this process (``/proc/self``,
``/dev/shm``) rather than the backend's bookkeeping, so a leak the backend does not
know about is still seen. Only documented facts of the CPU backend are used: segment
names are ``lmcache_platform_<pidns>_<pid>_<32 hex digits>`` in ``/dev/shm``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any

SHM_DIR = "/dev/shm"
PREFIX = "lmcache_platform_"
NAME_RE = re.compile(rf"{PREFIX}(\d+)_(\d+)_[0-9a-f]{{32}}")
PAGE = os.sysconf("SC_PAGE_SIZE")

#: Set to 1 for the long soak sizes (``scripts/soak``); CI runs the short ones.
SOAK = os.environ.get("LMCACHE_SOAK", "") not in ("", "0")
#: When set, every figure line is appended to this file as JSON (``scripts/soak`` uses it).
FIGURES_FILE_ENV = "LMCACHE_REL_FIGURES"


def sized(ci: int, soak: int) -> int:
    """The CI size, or the soak size under ``LMCACHE_SOAK=1``."""
    return soak if SOAK else ci


SPAWN = multiprocessing.get_context("spawn")


class Workers:
    """Spawned processes, each on a pipe, started with its own ``args`` after its end of the pipe.

    Their pids go into ``pids`` (the ``child_pids`` fixture), so the session's leak
    check also looks for their segments. On leaving the ``with`` block, any still alive
    is killed: a failed test leaves no process behind.
    """

    def __init__(self, target: Callable[..., None], args: Iterable[tuple[Any, ...]], pids: set[int]) -> None:
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        try:
            for extra in args:
                conn, child = SPAWN.Pipe()
                p = SPAWN.Process(target=target, args=(child, *extra), daemon=True)
                p.start()
                child.close()
                assert p.pid is not None
                pids.add(p.pid)
                self.procs.append(p)
                self.conns.append(conn)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.kill()

    def gather(self, timeout: float = 600) -> list[Any]:
        """One JSON message from each worker, in order."""
        out = []
        for conn in self.conns:
            assert conn.poll(timeout), f"a worker did not answer within {timeout:g} s"
            out.append(json.loads(conn.recv_bytes()))
        return out

    def go(self, command: Any = "go") -> float:
        """Send ``command`` to every worker; return the time it was sent."""
        for conn in self.conns:
            conn.send_bytes(json.dumps(command).encode())
        return time.perf_counter()

    def release(self, timeout: float = 600) -> tuple[list[Any], float]:
        """Wait until every worker is ready, start them together, collect their reports and
        their exits; return the reports and the wall time."""
        assert all(r == {"ready": True} for r in self.gather(timeout))
        started = self.go()
        reports = self.gather(timeout)
        wall = time.perf_counter() - started
        self.join()
        return reports, wall

    def join(self) -> None:
        """Wait for every worker to exit; each must exit with 0."""
        for p in self.procs:
            p.join(60)
            assert p.exitcode == 0

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()


def pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def forge_name(pid: int | None = None) -> str:
    """A well-formed segment name nobody created (for hostile descriptors)."""
    return f"{PREFIX}{pid_namespace()}_{os.getpid() if pid is None else pid}_{secrets.token_hex(16)}"


def segments_of(pids: set[int] | None = None) -> list[str]:
    """Our segments in /dev/shm made in this pid namespace (by ``pids``, or by anyone)."""
    ns = pid_namespace()
    found = []
    for name in sorted(os.listdir(SHM_DIR)):
        m = NAME_RE.fullmatch(name)
        if m and int(m.group(1)) == ns and (pids is None or int(m.group(2)) in pids):
            found.append(name)
    return found


def shm_mappings(pid: int | str = "self") -> int:
    """Mappings of /dev/shm files in a process (one line of ``/proc/<pid>/maps`` each)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if f" {SHM_DIR}/" in line)


def mapped_shm(pid: int | str = "self") -> Counter[str]:
    """/dev/shm files mapped in a process, with their mapping counts."""
    with open(f"/proc/{pid}/maps") as f:
        return Counter(line.split(None, 5)[-1].strip() for line in f if f" {SHM_DIR}/" in line)


def fd_targets(pid: int | str = "self") -> Counter[str]:
    """What each open fd of a process refers to, counted."""
    out: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[os.readlink(f"/proc/{pid}/fd/{fd}")] += 1
        except FileNotFoundError:  # the fd listing itself, closed meanwhile
            continue
    return out


def mappings_of(name: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("/" + name))


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


@dataclass(frozen=True)
class Resources:
    """What a leak would grow: fds, our /dev/shm entries, /dev/shm mappings, RSS."""

    fds: int
    shm_entries: int
    shm_maps: int
    rss: int

    @classmethod
    def of(cls, pid: int | str = "self") -> Resources:
        real = os.getpid() if pid == "self" else int(pid)
        return cls(open_fds(pid), len(segments_of({real})), shm_mappings(pid), rss_bytes(pid))

    def delta(self, after: Resources) -> dict[str, int]:
        return {k: getattr(after, k) - getattr(self, k) for k in ("fds", "shm_entries", "shm_maps", "rss")}


def describe(before: Resources, after: Resources) -> str:
    d = before.delta(after)
    return (
        f"fds {before.fds}->{after.fds} ({d['fds']:+d}), "
        f"/dev/shm entries {before.shm_entries}->{after.shm_entries} ({d['shm_entries']:+d}), "
        f"shm maps {before.shm_maps}->{after.shm_maps} ({d['shm_maps']:+d}), "
        f"RSS {before.rss / 2**20:.1f}->{after.rss / 2**20:.1f} MiB ({d['rss'] / 2**20:+.1f} MiB)"
    )


def emit(request: Any, case: str, text: str, **figures: Any) -> None:
    """Print one line of figures past pytest's capture, and record it for reports.

    ``request`` is the test's ``request`` fixture. The line goes to the terminal
    (lost only under xdist, whose workers have no terminal), into the test's
    ``user_properties`` (junit XML) and, when ``LMCACHE_REL_FIGURES`` names a file,
    into that file as one JSON object.
    """
    line = f"[reliability {case}] {text}"
    request.node.user_properties.append((case, text))
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print("\n" + line, flush=True)
    else:  # pragma: no cover - capture disabled by -p no:capture
        print(line, flush=True)
    path = os.environ.get(FIGURES_FILE_ENV)
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps({"case": case, "text": text, **figures}) + "\n")

"""Reclaiming segments of dead producers: the function, the hook and ``lmcache-platform gc``."""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from lmcache_platform_cpu import _gc, _plugin, _shm, reclaim_stale_segments
from support import cpu_workers as workers

SPAWN = multiprocessing.get_context("spawn")


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(_shm.SHM_DIR, name))


def dead_pid() -> int:
    """A pid that existed a moment ago and has been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def craft(name: str) -> None:
    """Make a segment under an arbitrary (well-formed) name, as another producer would."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)


def gc_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "gc", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_gc_reclaims_a_sigkilled_producers_segments_but_not_live_ones(child_pids: set[int]) -> None:
    mine, mm = _shm.create(4096)  # a live producer's segment: this process
    conn, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=workers.producer_main, args=(child, 3), daemon=True)
    proc.start()
    child.close()
    assert proc.pid is not None
    child_pids.add(proc.pid)
    try:
        names = json.loads(conn.recv_bytes())
        assert len(names) == 3 and all(exists(n) for n in names)
        assert not set(reclaim_stale_segments()) & {*names, mine}  # the producer lives
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        assert all(exists(n) for n in names)  # a killed process cleans nothing up

        stale = reclaim_stale_segments(dry_run=True)
        assert set(names) <= set(stale) and mine not in stale
        assert all(exists(n) for n in names)  # a dry run deletes nothing
        assert {f"/dev/shm/{n}" for n in names} <= set(_plugin.lmcache_platform_gc(dry_run=True))

        dry = gc_cli()
        assert dry.returncode == 0, dry.stdout + dry.stderr
        for n in names:
            assert f"cpu: would remove /dev/shm/{n}" in dry.stdout
        assert "--yes" in dry.stdout and all(exists(n) for n in names)

        real = gc_cli("--yes")
        assert real.returncode == 0, real.stdout + real.stderr
        for n in names:
            assert f"cpu: removed /dev/shm/{n}" in real.stdout
            assert not exists(n)
        assert exists(mine) and mine not in real.stdout
        assert not set(reclaim_stale_segments(dry_run=True)) & set(names)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()
        mm.close()
        _shm.unlink(mine)


def test_gc_leaves_other_users_and_other_pid_namespaces_alone() -> None:
    pid = dead_pid()
    token = "0" * 31 + "1"
    foreign_ns = f"{_shm.PREFIX}{_shm.pid_namespace() + 1}_{pid}_{token}"
    here = f"{_shm.PREFIX}{_shm.pid_namespace()}_{pid}_{token}"
    craft(foreign_ns)
    craft(here)
    try:
        stale = reclaim_stale_segments(dry_run=True)
        assert here in stale  # the control: same pid, our namespace and user
        assert foreign_ns not in stale
        if os.geteuid() == 0:  # only root can hand a segment to another user
            os.chown(os.path.join(_shm.SHM_DIR, here), 54321, -1)
            assert here not in reclaim_stale_segments(dry_run=True)  # a real run would reap others' too
            assert exists(here)
        assert exists(foreign_ns)
    finally:
        for name in (foreign_ns, here):
            _shm.unlink_any(name)


def test_gc_ignores_names_that_only_share_the_prefix() -> None:
    odd = f"{_shm.PREFIX}not_ours"
    fd = os.open(os.path.join(_shm.SHM_DIR, odd), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    try:
        # A dry run lists what a real one removes; a real one would reap other tests' segments too.
        assert odd not in reclaim_stale_segments(dry_run=True)
        assert exists(odd)
    finally:
        os.unlink(os.path.join(_shm.SHM_DIR, odd))


def test_a_reused_pid_counts_as_dead_and_a_zombie_too() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        # A segment changed before the process with that pid started: the pid was reused.
        assert _gc._producer_alive(sleeper.pid, segment_ctime=time.time() - 3600) is False
        # Changed after it started: it may be the producer, so it counts as alive.
        assert _gc._producer_alive(sleeper.pid, segment_ctime=time.time() + 1) is True
    finally:
        sleeper.kill()
        sleeper.wait()
    zombie = subprocess.Popen(["true"])
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert _gc._producer_alive(zombie.pid, segment_ctime=time.time()) is False
    finally:
        zombie.wait()
    assert _gc._producer_alive(dead_pid(), segment_ctime=time.time()) is False
    assert _gc._producer_alive(os.getpid(), segment_ctime=0.0) is True


@pytest.mark.parametrize("dry_run", [True, False])
def test_gc_without_dev_shm_finds_nothing(monkeypatch: pytest.MonkeyPatch, dry_run: bool) -> None:
    monkeypatch.setattr(_shm, "SHM_DIR", "/nonexistent-shm-dir")
    assert reclaim_stale_segments(dry_run=dry_run) == []

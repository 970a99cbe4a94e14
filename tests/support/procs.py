"""Stopping processes: the way a hung server looks, without racing the signal; or for good.

``kill(pid, SIGSTOP)`` returns before the target's threads have stopped: the kernel
stops a thread group only once one of its threads takes the signal, and on a loaded
machine a thread already running may answer one more request first. A test that sends
a request "to a hung server" right after the signal could then be answered, and wait for
a hang that never shows. :func:`sigstop` returns only when every thread is stopped.
:func:`stop_worker` ends a spawned worker at the end of a test, whether it answers or not.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

STOP_WAIT_S = 10.0


def _states(pid: int) -> dict[str, str]:
    """Thread id -> scheduler state letter (``/proc/PID/task/TID/stat``, field 3)."""
    out: dict[str, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[task.name] = stat[stat.rindex(")") + 2]  # the name in parentheses may hold spaces
    return out


def sigstop(pid: int, bound: float = STOP_WAIT_S) -> None:
    """SIGSTOP ``pid`` and wait until each of its threads is stopped (state ``T``)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + bound
    while True:
        states = _states(pid)
        if all(state in "Tt" for state in states.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {bound} s: thread states {states}")
        time.sleep(0.001)


def sigcont(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def stop_worker(process: BaseProcess, ask_exit: Callable[[], object], timeout: float) -> None:
    """Ask a spawned worker to exit (``ask_exit``), then wait ``timeout`` s for it; kill it if it lives on.

    A worker that hangs or fails to answer must still not outlive its test (nor keep the
    memory it maps): the kill happens whatever ``ask_exit`` raised, and that error stays.
    """
    try:
        ask_exit()
    finally:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()

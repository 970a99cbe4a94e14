"""The remote conformance suite: the Valkey store passes it (one server, a cluster), and it has teeth.

Each run is the documented command, ``pytest --pyargs lmcache_platform.remote.conformance
--lmcache-remote URL``, in a subprocess with a configuration of its own. Injected faults
(a store that leaks client exceptions, one that ignores its timeouts, one that loses a
byte) each fail their checks.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_platform.remote._registry import ENTRY_POINT_GROUP
from lmcache_platform.testing import make_distribution
from support.valkey import ValkeyCluster, ValkeyNode

FAULTY = '''
import time
from lmcache_platform.remote import RemoteURL, hookimpl, open_remote

class Faulty:
    """The Valkey store with one fault."""
    def __init__(self, inner, fault):
        self.inner, self.fault = inner, fault
    def get_many(self, keys, *, timeout):
        self._maybe(timeout)
        values = self.inner.get_many(keys, timeout=timeout)
        if self.fault == "lossy":
            values = [v[:-1] if v else v for v in values]
        return values
    def exists_many(self, keys, *, timeout):
        self._maybe(timeout)
        return self.inner.exists_many(keys, timeout=timeout)
    def put_many(self, items, *, ttl, timeout):
        self._maybe(timeout)
        return self.inner.put_many(items, ttl=ttl, timeout=timeout)
    def ping(self, *, timeout):
        self._maybe(timeout)
        return self.inner.ping(timeout=timeout)
    def close(self):
        self.inner.close()
    def _maybe(self, timeout):
        if self.fault == "untyped" and timeout < 1:
            raise ConnectionError("a client exception that escaped")
        if self.fault == "slow" and timeout < 1:
            time.sleep(timeout + 4)

@hookimpl
def lmcache_remote_api_version():
    return 1

@hookimpl
def lmcache_remote_open(url, options):
    fault = url.scheme.partition("+")[2]
    inner = RemoteURL.parse(url.text.replace(url.scheme, "valkey", 1))
    return Faulty(open_remote(inner, options), fault)
'''


def run_suite(url: str, workdir: Path, env: dict[str, str] | None = None) -> tuple[int, str, set[str]]:
    workdir.mkdir(parents=True, exist_ok=True)
    ini = workdir / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [
        sys.executable, "-m", "pytest", "--pyargs", "lmcache_platform.remote.conformance", "--lmcache-remote", url,
        "-c", str(ini), "--rootdir", str(workdir), "-p", "no:cacheprovider", "-W", "error", "-q", "-s", "-rfE",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=workdir, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )
    failed = set(re.findall(r"^(?:FAILED|ERROR) \S*::(\w+)", proc.stdout, flags=re.M))
    return proc.returncode, proc.stdout + proc.stderr, failed


def test_the_valkey_store_passes_on_one_server(valkey_node: ValkeyNode, tmp_path: Path) -> None:
    code, out, failed = run_suite(valkey_node.url, tmp_path / "run")
    print("\n" + "\n".join(ln for ln in out.splitlines() if "MiB" in ln or "keys:" in ln or "passed" in ln))
    assert code == 0 and not failed, out[-3000:]


def test_the_valkey_store_passes_on_a_cluster(valkey_cluster: ValkeyCluster, tmp_path: Path) -> None:
    code, out, failed = run_suite(valkey_cluster.url, tmp_path / "run")
    print("\n" + "\n".join(ln for ln in out.splitlines() if "MiB" in ln or "keys:" in ln or "passed" in ln))
    assert code == 0 and not failed, out[-3000:]


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("untyped", {"test_timeouts_honoured", "test_tiny_timeout_is_typed"}),
        ("slow", {"test_timeouts_honoured"}),
        ("lossy", {"test_round_trip", "test_binary_safety", "test_buffer_kinds", "test_missing_keys",
                   "test_pipelined_batch", "test_replace", "test_large_value", "test_concurrent_use"}),
    ],
)  # fmt: skip
def test_each_injected_fault_fails_its_checks(
    fault: str, expected: set[str], valkey_node: ValkeyNode, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    make_distribution(
        site,
        "faulty-store",
        "0.1",
        entry_points={f"faulty+{fault}": "faulty_store"},
        files={"faulty_store.py": FAULTY},
        group=ENTRY_POINT_GROUP,
    )
    url = valkey_node.url.replace("valkey://", f"faulty+{fault}://")
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    code, out, failed = run_suite(url, tmp_path / "run", env={"PYTHONPATH": pythonpath})
    assert code == 1 and failed == expected, out[-3000:]


def test_check_remote_runs_the_suite_and_summarizes(valkey_node: ValkeyNode) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "check", "--remote", valkey_node.url, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["verdict"] == "pass", proc.stderr[-3000:]
    assert summary["backend"] == {"name": valkey_node.url, "kind": "remote store"}
    assert summary["counts"]["passed"] >= 15 and summary["counts"]["failed"] == 0
    both = subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "check", "cpu", "--remote", valkey_node.url],
        capture_output=True,
        text=True,
    )
    assert both.returncode == 2 and "NAME or --remote URL" in both.stderr


def test_check_remote_says_when_timeouts_are_not_checked_and_takes_the_broken_urls(tmp_path: Path) -> None:
    """A store without hosts (the file store): PASS names what it did not check, and the
    flags its hint names are accepted and used (here pointing at broken Valkey servers)."""
    from lmcache_platform.remote.conformance.plugin import Blackhole

    store = f"file://{tmp_path / 'kv'}"
    check = [sys.executable, "-m", "lmcache_platform._cli", "check", "--remote", store]
    proc = subprocess.run(check, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    verdict = lines.index(f"lmcache-platform check {store}: PASS (timeouts not checked)")
    skips = sorted(lines[verdict + 3 : verdict + 5])
    assert skips == [
        f"  SKIP   1 check: {store} has no host to replace: pass --lmcache-remote-{kind} URL "
        f"(lmcache-platform check: --remote-{kind} URL)"
        for kind in ("refused", "stalled")
    ]
    assert lines[-1] == (
        "  the timeout checks need a stalled and a refusing instance of the store: "
        "--remote-stalled URL and --remote-refused URL (docs/remote-stores.md)"
    )

    hole = Blackhole()
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        refused = f"valkey://127.0.0.1:{closed.getsockname()[1]}"
        flags = ["--remote-stalled", f"valkey://127.0.0.1:{hole.port}", "--remote-refused", refused]
        try:
            proc = subprocess.run(
                [*check, *flags, "-k", "timeouts_honoured", "--json"],
                capture_output=True,
                text=True,
                timeout=600,
            )
        finally:
            hole.close()
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["verdict"] == "pass", proc.stderr[-3000:]
    assert "unchecked" not in summary and summary["counts"] == {
        "passed": 2,
        "failed": 0,
        "error": 0,
        "skipped": 0,
    }

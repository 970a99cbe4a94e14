"""Smoke tests of the benchmarks: they run end to end and report the documented shape.

Tiny sizes and few repeats keep them fast. Figures are checked for shape and
consistency only (min <= median <= max, ratios against the right baseline), never
against a speed: timing goals are reported by the benchmarks as pass/miss.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmcache_platform import KVFormat
from lmcache_platform._bench.peak import LABELS
from lmcache_platform._bench.stats import Report, Result, SpeedTarget
from lmcache_platform._bench.transfer import CASES, SERVER_CASES, case_name
from lmcache_platform._cli.bench import format_report, parse_sizes

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MiB = 1 << 20


def _segments_of(pid: int) -> list[str]:
    from lmcache_platform import DescriptorError
    from lmcache_platform_cpu import _shm

    found = []
    for name in os.listdir(_shm.SHM_DIR):
        try:
            if _shm.parse_name(name)[1] == pid:
                found.append(name)
        except DescriptorError:
            continue
    return found


def _check_result(row: dict[str, Any], runs: int) -> None:
    assert row["runs"] == runs, row
    assert row["min"] <= row["median"] <= row["max"], row
    # Times and rates are positive; an overhead or a memory increase may be 0.
    assert row["min"] > 0 or row["case"].endswith("overhead") or row["unit"] == "MiB added", row


def test_bench_quick_json(tmp_path: Path) -> None:
    """One real run (one test, so that parallel workers do not each start it)."""
    plot = tmp_path / "handoff.png"
    cmd = [
        sys.executable,
        "-m",
        "lmcache_platform._cli",
        "bench",
        "--quick",
        "--json",
        "--sizes",
        "1M,2M",
        "--runs",
        "1",
        "--plot",
        str(plot),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    data = json.loads(out)
    _check_sections(data)
    _check_handoff(data)
    _check_other_sections(data)
    _check_targets(data)
    assert data["meta"]["plot"] == str(plot)
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert _segments_of(proc.pid) == []


def _check_sections(data: dict[str, Any]) -> None:
    assert data["schema"] == 1
    assert data["meta"]["device"] == "cpu"
    assert data["meta"]["quick"] is True
    assert data["meta"]["sizes"] == [MiB, 2 * MiB]
    assert data["meta"]["backend"]["name"] == "cpu"
    assert data["skipped"] == []
    assert data["errors"] == []
    sections = {r["section"] for r in data["results"]}
    assert sections == {
        "import",
        "dispatch",
        "handoff",
        "handoff stages",
        "migration",
        "migration memory",
        "transfer",
    }
    for row in data["results"]:
        if row["section"] != "dispatch":  # timeit repeats are fixed per row, checked below
            _check_result(row, runs=1)


def _check_handoff(data: dict[str, Any]) -> None:
    """Every method at every size, with ratios against ours."""
    rows = [r for r in data["results"] if r["section"] == "handoff"]
    methods = {"ours (wire + shm)", "torch file_system", "torch file_descriptor", "pickle"}
    assert {(r["case"], r["params"]["size_bytes"]) for r in rows} == {
        (m, s) for m in methods for s in (MiB, 2 * MiB)
    }
    for r in rows:
        assert r["ratio_of"] == "ours (wire + shm)"
        if r["case"] == "ours (wire + shm)":
            assert r["ratio"] == pytest.approx(1.0)
            # The descriptor message does not grow with the data: a few KiB for 32 layers.
            assert 0 < r["params"]["message_bytes"] < 64 << 10
    stages = {r["case"] for r in data["results"] if r["section"] == "handoff stages"}
    assert stages == {
        "ours: wrap",
        "ours: encode",
        "ours: decode",
        "ours: to_tensor",
        "ours: pipe and acknowledgement",
    }


def _check_other_sections(data: dict[str, Any]) -> None:
    by_section: dict[str, list[dict[str, Any]]] = {}
    for r in data["results"]:
        by_section.setdefault(r["section"], []).append(r)
    assert {r["case"] for r in by_section["migration"]} == {
        "ours: first wrap",
        "share_memory_ (file_system)",
        "share_memory_ (file_descriptor)",
    }
    memory = by_section["migration memory"]  # one fresh process per method and size
    assert {(r["case"], r["params"]["size_bytes"]) for r in memory} == {
        (c, s) for c in LABELS.values() for s in (MiB, 2 * MiB)
    }
    for r in memory:
        assert r["unit"] == "MiB added" and r["min"] >= 0 and r["params"]["peak_mib"] > 0
    transfer = by_section["transfer"]
    assert {r["params"]["format"] for r in transfer} == {f.value for f in KVFormat}
    # Current vLLM's layout in its layer-compact and block-outermost physical orders.
    assert {r["params"]["engine_layout"] for r in transfer if r["params"]["format"] == "vllm"} == {
        "LBHNC",
        "LBNHC",
        "BLHNC",
    }
    for r in transfer:
        assert r["unit"] == "GB/s"
        assert r["params"]["layers"] == 32 and r["params"]["tokens"] == 256
        if r["case"].startswith(("store_chunk", "retrieve_chunk", "server")):
            assert r["ratio_of"].startswith("copy_")
    # Both chunk formats for every layout; the server path for current vLLM's layouts.
    by_case = {(r["params"]["format"], r["params"]["engine_layout"], r["case"]) for r in transfer}
    for fmt, layout in CASES:
        for case in ("store_chunk", "retrieve_chunk", "store_chunk (blocks)", "retrieve_chunk (blocks)"):
            assert (fmt.value, layout, case) in by_case
    for fmt, layout in SERVER_CASES:
        for case in ("server put", "server get", "server put (blocks)", "server get (blocks)"):
            assert (fmt.value, layout, case) in by_case
    dispatch = {r["case"]: r for r in by_section["dispatch"]}
    for case in (
        "dict lookup",
        "get_kv_wrapper_factory (cached)",
        "pluggy hook call (1 impl)",
        "create_cache_context dispatch overhead",
    ):
        assert case in dispatch
    assert dispatch["get_kv_wrapper_factory (cached)"]["ratio_of"] == "dict lookup"
    imports = {r["case"] for r in by_section["import"]}
    assert "import lmcache_platform" in imports
    assert "first resolution of 'cpu' (torch loaded)" in imports


def _check_targets(data: dict[str, Any]) -> None:
    targets = {t["name"]: t for t in data["targets"]}
    expected = {
        "import.no_torch",
        "dispatch.cached_lookup",
        "handoff.vs_torch_file_system",
        "handoff.flat",
        "migration.peak_memory",
        *(f"transfer.{case_name(*c)}" for c in CASES),
        *(f"transfer.{case_name(*c)}.blocks" for c in CASES),
        *(f"transfer.server.{case_name(*c)}{tag}" for c in SERVER_CASES for tag in ("", ".blocks")),
    }
    assert set(targets) == expected
    for t in targets.values():
        assert t["passed"] in (True, False, None)
        assert (t["passed"] is None) == (t["value"] is None)
    # Not a timing: whether torch got imported is a fact about the import graph.
    assert targets["import.no_torch"]["passed"] is True
    # 1 GiB was not part of this run, so that target says so instead of guessing.
    assert targets["handoff.vs_torch_file_system"]["passed"] is None


def test_table_output_shows_figures_targets_and_skips() -> None:
    report = Report(
        meta={
            "device": "cpu",
            "quick": True,
            "lmcache_platform": "0",
            "python": "3",
            "torch": "2",
            "cpus": 2,
            "torch_threads": 2,
            "loadavg_start": None,
            "backend": {"name": "cpu", "distribution": "d", "version": "1"},
        }
    )
    base = Result("handoff", "ours (wire + shm)", "ms", (1.0, 2.0, 3.0), {"size": "1 MiB"})
    other = Result("handoff", "pickle", "ms", (8.0, 10.0), {"size": "1 MiB"}).relative_to(base)
    report.results += [base.relative_to(base), other]
    report.targets += [
        SpeedTarget.at_most("t1", "goal one", 2.0, 1.0),
        SpeedTarget.at_least("t2", "goal two", None, 1),
    ]
    text = format_report(report)
    assert "ours (wire + shm)" in text and "pickle" in text
    assert "4.50" in text  # pickle median 9.0 over ours 2.0
    assert "[MISS] goal one: 2" in text
    assert "[ n/a] goal two: not measured" in text


@pytest.mark.parametrize(
    ("text", "sizes"),
    [("64M,1G", (64 * MiB, 1 << 30)), ("1GiB, 4MB", (4 * MiB, 1 << 30)), ("2097152", (2 * MiB,))],
)
def test_parse_sizes(text: str, sizes: tuple[int, ...]) -> None:
    assert parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["lots", "12Q", "4K", ""])
def test_parse_sizes_refuses_bad_input(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_sizes(text)


def _args(**overrides: Any) -> Any:
    """The command's own parse of ``--quick --json --runs 1``, with ``overrides`` set on top."""
    import argparse

    from lmcache_platform._cli.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return argparse.Namespace(
        **{**vars(parser.parse_args(["--quick", "--json", "--runs", "1"])), **overrides}
    )


def test_a_failing_section_is_an_error_and_the_rest_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmcache_platform._bench import dispatch as _bench_dispatch
    from lmcache_platform._cli import bench as _bench

    def broken(report: Report, settings: object) -> None:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(_bench_dispatch, "bench_dispatch", broken)  # a stand-in failure
    before = set(_segments_of(os.getpid()))
    assert _bench.run(_args(sections=["dispatch", "transfer"])) == 1
    gc.collect()
    assert set(_segments_of(os.getpid())) <= before  # the transfer section released its memory
    data = json.loads(capsys.readouterr().out)
    assert data["errors"] == [
        {"section": "dispatch", "case": "all", "params": {}, "reason": "RuntimeError: injected failure"}
    ]
    assert {r["section"] for r in data["results"]} == {"transfer"}


def test_bench_cuda_without_a_gpu_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from lmcache_platform._cli import bench as _bench

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    assert _bench.run(_args(device="cuda")) == 2
    assert "--device cuda needs" in capsys.readouterr().err


def test_sigterm_releases_shared_memory() -> None:
    """A benchmark stopped with SIGTERM unlinks its segments on the way out (named segments:
    the default memfd exports leave nothing behind by construction)."""
    import signal
    import time

    cmd = [
        sys.executable,
        "-m",
        "lmcache_platform._cli",
        "bench",
        "--section",
        "handoff",
        "--sizes",
        "4M",
        "--runs",
        "1000",
    ]
    env = {**os.environ, "LMCACHE_PLATFORM_CPU_IPC": "shm"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not _segments_of(proc.pid):  # wait until it holds shared memory
            assert proc.poll() is None and time.monotonic() < deadline, "no segment appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _segments_of(proc.pid) == []

"""The conformance suite, run as a vendor runs it: in a subprocess, against installed backends.

``cpu`` and ``cpu.file`` must pass it. A deliberately broken backend, installed as
a real distribution in a temporary site dir, must fail exactly the checks its
faults break (and pass all the others), so no check of the suite is one that
cannot fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree

import pytest

from lmcache_platform._cli.check import format_summary, summarize
from support.conformance import check, clean_env, one_module_backend, pytest_suite

pytestmark = pytest.mark.slow

CHECK_MODULES = (
    "test_context.py",
    "test_errors.py",
    "test_hooks.py",
    "test_hostmem.py",
    "test_ipc.py",
    "test_variant.py",
)


def test_cpu_passes_the_whole_suite_through_pytest_pyargs(tmp_path: Path) -> None:
    """The documented pytest entry point, with the JUnit report a vendor's CI reads."""
    junit = tmp_path / "junit.xml"
    proc = pytest_suite("cpu", junit, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    suite = ElementTree.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("0", "0", "0")
    files = {case.get("classname", "").rsplit(".", 1)[-1] + ".py" for case in suite.iter("testcase")}
    assert files == set(CHECK_MODULES), files
    assert int(suite.get("tests", "0")) >= 30


def test_cpu_file_passes_the_whole_suite_through_check(tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"  # does not exist yet: the backend creates it, mode 0700
    env = clean_env(LMCACHE_PLATFORM_CPU_FILE_DIR=str(kv_dir))
    code, summary, output = check("cpu.file", env=env, cwd=tmp_path)
    assert code == 0, output
    assert summary["verdict"] == "pass" and summary["ok"]
    assert summary["backend"]["name"] == "cpu.file" and summary["backend"]["device_type"] == "cpu"
    assert summary["backend"]["distribution"] == "lmcache-platform-cpu-file"
    counts = summary["counts"]
    assert counts["failed"] == counts["error"] == counts["skipped"] == 0, summary
    modules = {r["test"].split("::")[0].rsplit("/", 1)[-1] for r in summary["results"]}
    assert modules == set(CHECK_MODULES), modules
    assert all(r["outcome"] == "passed" for r in summary["results"])
    assert os.listdir(kv_dir) == [], "the suite left KV files behind"


def test_check_refuses_an_unknown_backend_and_flags_an_unusable_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "check", "cpu.nonexistent"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2 and "no installed backend is named 'cpu.nonexistent'" in proc.stderr

    # cpu.file without its directory cannot serve: only device-free checks run.
    code, summary, output = check("cpu.file", "-k", "hooks or ipc", env=clean_env(), cwd=tmp_path)
    assert code == 1 and summary["verdict"] == "not verified"
    assert "LMCACHE_PLATFORM_CPU_FILE_DIR is not set" in summary["backend"]["unavailable"]
    assert summary["counts"]["failed"] == 0 and summary["counts"]["skipped"] > 1
    # One reason for every skipped check: said once, with the count, and not once per test.
    (reason,) = summary["skips"]
    assert summary["skip_counts"] == {reason: summary["counts"]["skipped"]}
    assert "SKIPPED [" not in output
    text = format_summary(summary)
    assert text.count(reason) == 1 and f"SKIP   {summary['counts']['skipped']} checks: {reason}" in text
    accepted = summarize(
        "cpu.file",
        0,
        {"backend": summary["backend"], "results": summary["results"]},
        1.0,
        allow_unavailable=True,
    )  # what --allow-unavailable changes
    assert accepted["ok"] and accepted["verdict"] == "not verified"


# -- a broken backend: each fault must be caught by the check written for it ----------------

BROKEN = textwrap.dedent('''
    """cpu.broken: the CPU backend with faults chosen by BROKEN_FAULTS (comma-separated)."""
    import os
    from lmcache_platform import API_VERSION, WireField, hookimpl
    from lmcache_platform_cpu import CPUCacheContext, CpuShmIPCWrapper

    FAULTS = set(os.environ.get("BROKEN_FAULTS", "").split(","))

    class Wrapper(CpuShmIPCWrapper):
        wire_tag = "cpu.broken/1"
        if "steals_tag" in FAULTS:  # a tag of the primary's, whose fields differ from these
            import lmcache_platform_cpu._plugin as _cpu
            wire_tag = next(c.wire_tag for c in _cpu.lmcache_platform_wire_classes("cpu")
                            if c.wire_fields != CpuShmIPCWrapper.wire_fields)
        if "unbounded_field" in FAULTS:  # a host-memory wrapper's fields are its store's handle
            class UnboundedStore(type(CpuShmIPCWrapper.store)):
                handle_fields = {"shm_name": WireField(str)}
            store = UnboundedStore()

        def to_tensor(self):
            t = super().to_tensor()
            return t.clone() if "copying_reopen" in FAULTS else t

    class Context(CPUCacheContext):
        def store(self, plan):
            super().store(plan)
            if "lossy_store" in FAULTS:
                plan.groups[0].buffer.view(-1)[:1].view(torch_uint8()).bitwise_xor_(1)

        def read_chunks(self, chunks):
            out = super().read_chunks(chunks)
            return out[::-1] if "reorders_batch" in FAULTS else out

        def retrieve_chunk(self, block_ids_per_group, *, slot=0, num_tokens=None):
            if "clamps_block_ids" in FAULTS:
                n = self.num_blocks
                block_ids_per_group = [[max(0, min(b, n - 1)) for b in g] for g in block_ids_per_group]
            return super().retrieve_chunk(block_ids_per_group, slot=slot, num_tokens=num_tokens)

    def torch_uint8():
        import torch
        return torch.uint8

    @hookimpl
    def lmcache_platform_api_version():
        return API_VERSION

    @hookimpl
    def lmcache_platform_cache_context_class(device_type):
        return Context if device_type == "cpu" or "greedy" in FAULTS else None

    @hookimpl
    def lmcache_platform_ipc_wrapper_class(device_type):
        return Wrapper if device_type == "cpu" else None

    if "unmarked_hook" in FAULTS:
        def lmcache_platform_gc(dry_run):
            return []
''')


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return one_module_backend(tmp_path_factory.mktemp("broken-site"), "cpu.broken", BROKEN)


def failing_checks(broken_site: Path, tmp_path: Path, faults: str) -> set[str]:
    env = clean_env(PYTHONPATH=str(broken_site), BROKEN_FAULTS=faults)
    code, summary, output = check("cpu.broken", env=env, cwd=tmp_path)
    assert summary, output
    assert summary["counts"]["passed"] > 0, output  # the rest of the suite still ran and passed
    failed = {r["test"].split("::", 1)[1] for r in summary["failures"]}
    assert (code == 0) == (not failed)
    return failed


def test_each_fault_fails_exactly_the_checks_written_for_it(broken_site: Path, tmp_path: Path) -> None:
    faults = "unbounded_field,unmarked_hook,greedy,lossy_store,clamps_block_ids,copying_reopen"
    failed = failing_checks(broken_site, tmp_path, faults)
    formats = (
        "vllm-LBHNC",
        "vllm-BLHNC",
        "vllm_mla-LBNHC",  # current vLLM views of one allocation
        "flash_attn",
        "flash_attn_hnd",
        "flashinfer",
        "flashinfer_hnd",
        "mla",
    )
    cases = (
        "bfloat16-interior-strided",
        "float16-contiguous",
        "float32-transposed",
        "int8-offset",
        "uint8-layer-of-a-stack",
    )
    assert failed == {
        "test_every_wire_field_is_a_bounded_primitive",  # unbounded_field
        "test_every_hook_function_is_a_marked_implementation_of_a_known_spec",  # unmarked_hook
        "test_it_declines_device_types_it_does_not_serve",  # greedy
        "test_bad_transfer_requests_raise_transfer_error_and_write_nothing",  # clamps_block_ids
        # lossy_store (and copying_reopen: the engine never sees a retrieve)
        *(f"test_store_and_retrieve_are_bit_exact_and_touch_nothing_else[{fmt}]" for fmt in formats),
        *(
            f"{test}[{fmt}-{chunk_format}]"
            for test in (
                "test_chunks_move_through_host_tensors_bit_exact_in_either_format",
                "test_a_batch_of_chunks_moves_as_the_single_chunk_calls_do",
            )
            for fmt in formats
            for chunk_format in ("tokens", "blocks")
        ),
        # copying_reopen
        *(f"test_a_spawned_process_aliases_the_engine_tensor_both_ways[{case}]" for case in cases),
        "test_a_large_allocation_is_shared_in_place_or_copied_whole",  # copying_reopen
        "test_separate_exports_reopen_side_by_side_or_one_by_one",  # copying_reopen
    }


def test_a_batch_that_differs_from_the_single_chunk_calls_fails_only_the_batch_check(
    broken_site: Path, tmp_path: Path
) -> None:
    failed = failing_checks(broken_site, tmp_path, "reorders_batch")
    assert failed and all(
        f.startswith("test_a_batch_of_chunks_moves_as_the_single_chunk_calls_do[") for f in failed
    )
    assert len(failed) == 16, failed  # 8 layouts x 2 chunk formats


def test_a_variant_reusing_a_primary_tag_for_other_fields_fails_the_coexistence_check(
    broken_site: Path, tmp_path: Path
) -> None:
    env = clean_env(PYTHONPATH=str(broken_site), BROKEN_FAULTS="steals_tag")
    code, summary, output = check("cpu.broken", "-k", "primary_stays_selected", env=env, cwd=tmp_path)
    assert code == 1, output
    (failure,) = summary["failures"]
    assert failure["test"].endswith(
        "::test_next_to_each_other_the_primary_stays_selected_and_shared_tags_agree"
    )
    assert "both use wire tag 'cpu.memfd/1' with different fields" in failure["detail"]

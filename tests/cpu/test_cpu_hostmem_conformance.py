"""The conformance suite against the ``cpu`` backend's second kind, and its host-memory checks.

``tests/conformance`` runs the whole suite on the default (memfd) export; here it runs
on named segments (``LMCACHE_PLATFORM_CPU_IPC=shm``), so both kinds conform.

The host-memory checks (``test_hostmem``) catch the faults they are for.

``cpu.leaky`` is the ``cpu`` backend's named-segment wrapper over a store with faults
chosen by ``LEAKY_FAULTS``, installed as a real distribution in a temporary site dir.
Without faults it passes every host-memory check; with each fault, exactly the check
written for it fails, so none of them is a check that cannot fail.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from support.conformance import check, clean_env, junit_outcomes, one_module_backend, pytest_suite

pytestmark = pytest.mark.slow

LEAKY = textwrap.dedent('''
    """cpu.leaky: named segments with the faults LEAKY_FAULTS lists (comma-separated)."""
    import os
    from lmcache_platform import hookimpl
    from lmcache_platform_cpu import CPUCacheContext, CpuShmIPCWrapper, _shm

    FAULTS = set(os.environ.get("LEAKY_FAULTS", "").split(","))
    KEPT = []

    class LeakyStore(_shm.ShmStore):
        def create(self, nbytes):
            if "leaks_on_refusal" in FAULTS:
                KEPT.append(os.open(os.devnull, os.O_RDONLY))  # opened before the capacity check
            return super().create(nbytes)

        def create_in_place(self, nbytes):
            handle, fd = super().create_in_place(nbytes)
            if "in_place_elsewhere" in FAULTS:  # the pages go to memory the handle does not name
                os.close(fd)
                fd = os.memfd_create("elsewhere")
                os.ftruncate(fd, nbytes)
            return handle, fd

        def open_fd(self, handle, nbytes):
            fd = super().open_fd(handle, nbytes)
            if "open_fd_leaks" in FAULTS:
                KEPT.append(os.dup(fd))
            return fd

        def release(self, handle):
            if "child_releases" in FAULTS:  # forgets that only the creator may unlink
                _shm.unlink_any(handle["shm_name"])
                return True
            return super().release(handle)

    class Wrapper(CpuShmIPCWrapper):
        wire_tag = "cpu.leaky/1"
        store = LeakyStore()

        @classmethod
        def wrap(cls, tensor):
            if "empty_allocates" in FAULTS and tensor.numel() == 0:
                KEPT.append(cls.store.create(4096))
            if "copies_views" in FAULTS and tensor.numel():
                tensor = tensor.clone()  # each view exported on its own
            return super().wrap(tensor)

    @hookimpl
    def lmcache_platform_api_version():
        return 1

    @hookimpl
    def lmcache_platform_cache_context_class(device_type):
        return CPUCacheContext if device_type == "cpu" else None

    @hookimpl
    def lmcache_platform_ipc_wrapper_class(device_type):
        return Wrapper if device_type == "cpu" else None
''')

#: fault -> the checks it must fail (an exported copy dies with the copy, so every check that
#: reopens such an export later fails too).
FAULT_CHECKS = {
    "child_releases": {"test_a_forked_child_never_releases_its_parents_memory"},
    "empty_allocates": {"test_an_empty_tensor_needs_no_memory"},
    "copies_views": {
        "test_views_of_one_allocation_share_one_export",
        "test_a_forked_child_never_releases_its_parents_memory",
        "test_closing_every_export_keeps_the_engine_tensor_and_a_new_export_works",
        "test_a_large_allocation_is_shared_in_place_or_copied_whole",
        "test_separate_exports_reopen_side_by_side_or_one_by_one",
    },
    "leaks_on_refusal": {"test_a_capacity_error_creates_nothing"},
    "in_place_elsewhere": {"test_a_large_allocation_is_shared_in_place_or_copied_whole"},
    "open_fd_leaks": {"test_separate_exports_reopen_side_by_side_or_one_by_one"},
}
CHECKS = set().union(*FAULT_CHECKS.values())


@pytest.fixture(scope="module")
def leaky_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return one_module_backend(tmp_path_factory.mktemp("leaky-site"), "cpu.leaky", LEAKY)


def outcomes(site: Path, tmp_path: Path, faults: str) -> dict[str, str]:
    """Run the host-memory checks against ``cpu.leaky``: check name -> outcome."""
    junit = tmp_path / f"junit-{faults or 'none'}.xml"
    env = clean_env(PYTHONPATH=str(site), LEAKY_FAULTS=faults)
    proc = pytest_suite("cpu.leaky", junit, env=env, cwd=tmp_path, extra=("-k", "test_hostmem"))
    assert junit.exists(), proc.stdout + proc.stderr
    return junit_outcomes(junit)


def test_without_faults_every_host_memory_check_passes(leaky_site: Path, tmp_path: Path) -> None:
    result = outcomes(leaky_site, tmp_path, "")
    assert set(result) == CHECKS and set(result.values()) == {"passed"}, result


def test_each_fault_fails_exactly_the_host_memory_check_written_for_it(
    leaky_site: Path, tmp_path: Path
) -> None:
    result = outcomes(leaky_site, tmp_path, ",".join(FAULT_CHECKS))
    failed = {name for name, kind in result.items() if kind != "passed"}
    assert failed == CHECKS, result
    for fault in ("child_releases", "copies_views", "in_place_elsewhere", "open_fd_leaks"):  # one at a time
        alone = outcomes(leaky_site, tmp_path, fault)
        assert {name for name, kind in alone.items() if kind != "passed"} == FAULT_CHECKS[fault], alone


def test_the_named_segment_kind_passes_the_whole_suite(tmp_path: Path) -> None:
    code, summary, stderr = check("cpu", env=clean_env(LMCACHE_PLATFORM_CPU_IPC="shm"), cwd=tmp_path)
    assert code == 0 and summary["verdict"] == "pass", stderr[-3000:]
    counts = summary["counts"]
    assert counts["failed"] == counts["error"] == counts["skipped"] == 0 and counts["passed"] >= 40, counts
    assert any("test_hostmem.py" in r["test"] for r in summary["results"])

"""Discovery from real installed metadata: distributions written into temporary site dirs."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import lmcache_platform as lp
from lmcache_platform import Status
from lmcache_platform._plugins.discovery import collect
from lmcache_platform.testing import make_distribution
from support.plugins import IMPORT_LOG_ENV, env_with_tests_on_path, imported, module_of, plugin_source


@pytest.fixture
def import_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "imports.log"
    monkeypatch.setenv(IMPORT_LOG_ENV, str(log))
    return log


def install(site: Path, dist: str, backends: dict[str, str], variant: str | None = None) -> None:
    """One distribution advertising ``backend name -> module``; modules are generated."""
    files = {
        f"{module}.py": plugin_source(module, name.partition(".")[0], variant=variant)
        for name, module in backends.items()
    }
    make_distribution(site, dist, "1.0", entry_points=backends, files=files)


def test_resolving_a_device_type_imports_only_its_backends(lmcache_registry, tmp_path, import_log):
    site = tmp_path / "site"
    install(site, "vendor-cpu", {"cpu": "lazy_cpu_a"})
    install(site, "vendor-cuda", {"cuda": "lazy_cuda_a", "cuda.rocm": "lazy_rocm_a"})
    install(site, "vendor-xpu", {"xpu": "lazy_xpu_a"})
    lmcache_registry.add_site_dir(site)

    assert imported(import_log) == []  # scanning reads metadata only
    infos = {i.name: i for i in lmcache_registry.registry.backends()}
    assert set(infos) == {"cpu", "cuda", "cuda.rocm", "xpu"}
    assert all(i.status is Status.NOT_LOADED for i in infos.values())
    assert imported(import_log) == []

    factory = lp.get_kv_wrapper_factory("cpu")
    assert module_of(factory) == "lazy_cpu_a"
    assert imported(import_log) == ["lazy_cpu_a"]
    lp.get_kv_wrapper_factory("cpu")
    assert imported(import_log) == ["lazy_cpu_a"]  # once per process


def test_variant_names_belong_to_their_device_type(lmcache_registry, tmp_path, import_log):
    site = tmp_path / "site"
    install(site, "vendor-cuda", {"cuda": "var_cuda_b", "cuda.rocm": "var_rocm_b"})
    install(site, "vendor-cudax", {"cudax": "var_cudax_b"})
    lmcache_registry.add_site_dir(site)
    assert module_of(lp.get_kv_wrapper_factory("cuda")) == "var_cuda_b"
    # "cudax" is another device type, not a variant of "cuda" (and the usable primary
    # "cuda" wins without importing its variant "cuda.rocm").
    assert imported(import_log) == ["var_cuda_b"]


def test_metadata_is_read_once(lmcache_registry, tmp_path, import_log, monkeypatch):
    import importlib_metadata

    calls = []
    real = importlib_metadata.distributions

    def counted(**kw: Any) -> Any:
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(importlib_metadata, "distributions", counted)
    site = tmp_path / "site"
    install(site, "vendor-cpu", {"cpu": "once_cpu_c"})
    lmcache_registry.add_site_dir(site)
    lp.get_kv_wrapper_factory("cpu")
    lp.get_kv_wrapper_factory("cpu")
    with pytest.raises(lp.BackendNotFoundError):
        lp.get_kv_wrapper_factory("xpu")
    lmcache_registry.registry.backends()
    assert len(calls) == 1
    lp.refresh()
    lp.get_kv_wrapper_factory("cpu")
    assert len(calls) == 2


def test_same_distribution_twice_on_sys_path_is_deduplicated(lmcache_registry, tmp_path, import_log):
    first, second = tmp_path / "editable", tmp_path / "regular"
    install(first, "vendor-cpu", {"cpu": "dup_cpu_d"})
    install(second, "Vendor_CPU", {"cpu": "dup_cpu_d"})  # same project, other spelling
    lmcache_registry.add_site_dir(second)
    lmcache_registry.add_site_dir(first)
    infos = lmcache_registry.registry.backends()
    assert [i.name for i in infos] == ["cpu"]
    assert module_of(lp.get_kv_wrapper_factory("cpu")) == "dup_cpu_d"


def test_collect_is_sorted_and_flags_clashes_and_bad_names():
    import importlib_metadata as md

    class Dist:
        def __init__(self, name: str) -> None:
            self.name, self.version = name, "1"

    def ep(name: str, dist: str) -> md.EntryPoint:
        e = md.EntryPoint(name=name, value=f"{dist.replace('-', '_')}:plugin", group="g")
        return e._for(Dist(dist))  # type: ignore[attr-defined]

    specs = collect(
        [
            ep("xpu", "b-dist"),
            ep("cpu", "a-dist"),
            ep("xpu", "c-dist"),
            ep("Bad Name", "d-dist"),
            ep("cpu", "a-dist"),
        ]
    )
    assert [s.name for s in specs] == ["Bad Name", "cpu", "xpu"]
    by = {s.name: s for s in specs}
    assert by["cpu"].problem is None
    assert "b-dist" in str(by["xpu"].problem) and "c-dist" in str(by["xpu"].problem)
    assert "invalid backend name" in str(by["Bad Name"].problem)


@pytest.mark.parametrize(
    "variant",
    [
        "import_error",
        "bad_api",
        "no_api",
        "hook_raises",
        "wrong_type",
        "wrong_device",
        "unknown_arg",
        "unknown_hook",
        "probe_raises",
    ],
)
def test_a_broken_backend_is_isolated(lmcache_registry, tmp_path, import_log, caplog, variant):
    site = tmp_path / "site"
    install(site, "good-vendor", {"cpu.good": f"good_{variant}"})  # equals: both are loaded
    install(site, "broken-vendor", {"cpu.broken": f"broken_{variant}"}, variant=variant)
    lmcache_registry.add_site_dir(site)
    caplog.set_level(logging.WARNING, logger="lmcache_platform")

    # The good backend keeps working: the broken one is not a candidate.
    assert module_of(lp.get_kv_wrapper_factory("cpu")) == f"good_{variant}"
    info = {i.name: i for i in lmcache_registry.registry.backends()}["cpu.broken"]
    assert info.status is Status.FAILED
    assert info.distribution == "broken-vendor" and info.version == "1.0"
    assert info.traceback and "Traceback" in info.traceback
    assert "cpu.broken" in info.reason
    assert "\n" not in info.reason  # one line for listings...
    if variant == "unknown_arg":
        assert "bogus" in info.reason  # ...that still names the culprit from pluggy's later lines
    warnings = [r for r in caplog.records if "cpu.broken" in r.getMessage()]
    assert len(warnings) == 1
    # Nothing half-registered: the plugin manager does not hold the failed backend.
    assert "cpu.broken" not in dict(lmcache_registry.registry.plugins())
    # Asking for it explicitly raises a typed error carrying the failure.
    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.broken")
    lp.refresh()
    with pytest.raises(lp.BackendUnavailableError) as excinfo:
        lp.get_kv_wrapper_factory("cpu")
    assert "cpu.broken" in str(excinfo.value)
    (error,) = excinfo.value.errors
    assert error.backend == "cpu.broken" and error.distribution == "broken-vendor"
    assert error.traceback


def test_api_version_error_names_both_versions_and_distribution(lmcache_registry, tmp_path, import_log):
    site = tmp_path / "site"
    install(site, "old-vendor", {"npu": "api_npu_e"}, variant="bad_api")
    lmcache_registry.add_site_dir(site)
    with pytest.raises(lp.BackendUnavailableError) as excinfo:
        lp.get_kv_wrapper_factory("npu")
    (error,) = excinfo.value.errors
    assert isinstance(error, lp.ApiVersionError)
    message = str(error)
    assert f"API {lp.API_VERSION + 1}" in message and f"API {lp.API_VERSION}" in message
    assert "old-vendor" in message


def test_racing_first_lookups_scan_once_and_warn_once(
    lmcache_registry, tmp_path, import_log, monkeypatch, caplog
):
    import importlib_metadata

    scans = []
    real = importlib_metadata.distributions

    def counted(**kw: Any) -> Any:
        scans.append(1)
        return real(**kw)

    monkeypatch.setattr(importlib_metadata, "distributions", counted)
    site = tmp_path / "site"
    install(site, "vendor-cpu", {"cpu.good": "race_cpu_f"})  # an equal of cpu.broken: both load
    install(site, "broken-vendor", {"cpu.broken": "race_broken_f"}, variant="import_error")
    lmcache_registry.add_site_dir(site)
    caplog.set_level(logging.WARNING, logger="lmcache_platform")
    barrier = threading.Barrier(32)
    results, errors = [], []

    def worker() -> None:
        barrier.wait()
        try:
            results.append(lp.get_kv_wrapper_factory("cpu"))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 32 and len(set(results)) == 1
    assert len(scans) == 1
    assert imported(import_log).count("race_cpu_f") == 1
    assert len([r for r in caplog.records if "cpu.broken" in r.getMessage()]) == 1


def test_disabled_backends_are_never_imported(lmcache_registry, tmp_path, import_log):
    site = tmp_path / "site"
    install(site, "vendor-a", {"cpu": "dis_cpu_g"})
    install(site, "vendor-b", {"cpu.fast": "dis_fast_g"})
    lmcache_registry.setenv("LMCACHE_PLATFORM_DISABLE", "cpu.fast, other")
    lmcache_registry.add_site_dir(site)
    assert module_of(lp.get_kv_wrapper_factory("cpu")) == "dis_cpu_g"
    assert imported(import_log) == ["dis_cpu_g"]
    info = {i.name: i for i in lmcache_registry.registry.backends()}
    assert info["cpu.fast"].status is Status.DISABLED


def test_autoload_off_reads_no_entry_points(lmcache_registry, tmp_path, import_log, monkeypatch):
    import importlib_metadata

    monkeypatch.setattr(
        importlib_metadata, "distributions", lambda **kw: pytest.fail("entry points read with autoload off")
    )
    site = tmp_path / "site"
    install(site, "vendor-a", {"cpu": "auto_cpu_h"})
    lmcache_registry.setenv("LMCACHE_PLATFORM_AUTOLOAD", "0")
    lmcache_registry.add_site_dir(site)
    with pytest.raises(lp.BackendNotFoundError):
        lp.get_kv_wrapper_factory("cpu")
    assert lmcache_registry.registry.backends() == []


def test_discovery_in_a_fresh_process(tmp_path):
    """End to end in a subprocess: real metadata, lazy import, probe reasons."""
    site = tmp_path / "site"
    install(site, "proc-vendor", {"xpu": "proc_xpu_i", "npu": "proc_npu_i"})
    log = tmp_path / "imports.log"
    script = textwrap.dedent("""
        import sys, lmcache_platform as lp
        assert "torch" not in sys.modules
        f = lp.get_kv_wrapper_factory("xpu")
        print(f.__self__.__name__)
        try:
            lp.get_kv_wrapper_factory("npu")
        except lp.BackendUnavailableError as e:
            print("npu:", e.reasons["npu"])
    """)
    env = env_with_tests_on_path({IMPORT_LOG_ENV: str(log), "FAKE_UNAVAILABLE_PROC_NPU_I": "no NPU"})
    env["PYTHONPATH"] = str(site) + ":" + env["PYTHONPATH"]
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == "FakeWrapper_xpu"
    assert out[1] == "npu: no NPU"
    assert imported(log) == ["proc_xpu_i", "proc_npu_i"]

"""The variant rule: ``<device_type>`` wins over ``<device_type>.<variant>`` unless one is selected.

Installing a variant must not break the users of its device type (issue 14, item 2),
an explicit choice must not import or probe the unselected siblings (item 11), and a
server that selected another backend than the engine says so and what to do (item 10).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lmcache_platform as lp
from lmcache_platform import Availability
from lmcache_platform.testing import fake_backend, make_distribution
from support.fakes import context_class, wrapper_class
from support.plugins import IMPORT_LOG_ENV, env_with_tests_on_path, imported, plugin_source


def backend(tag: str, **kw):
    return fake_backend(
        "cpu", context_class=context_class("cpu"), wrapper_class=wrapper_class("cpu", tag), **kw
    )


def serving_tag() -> str:
    return lp.get_kv_wrapper_factory("cpu").__self__.wire_tag  # type: ignore[attr-defined]


def choice_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "uses backend" in r.getMessage()
    ]


def test_the_primary_wins_over_its_variants_and_the_choice_is_logged_once(lmcache_registry, caplog):
    caplog.set_level(logging.INFO, logger="lmcache_platform")
    lmcache_registry.install("cpu", backend("cpu.shm/1"), distribution="lmcache-platform-cpu", version="0.1")
    lmcache_registry.install("cpu.file", backend("cpu.file/1"))
    lmcache_registry.install("cpu.memfd", backend("cpu.memfd/1"))
    assert serving_tag() == "cpu.shm/1"
    info = lp.selected_backend("cpu")
    assert (info.name, info.selected_by, info.selected) == ("cpu", "primary", True)
    assert info.why_selected == (
        "the primary backend; to use one of cpu.file, cpu.memfd instead, set LMCACHE_PLATFORM_BACKEND=<name>"
    )
    lp.get_kv_wrapper_factory("cpu")
    (line,) = choice_logs(caplog)
    assert line.startswith(
        "lmcache-platform: device type 'cpu' uses backend 'cpu' (lmcache-platform-cpu 0.1)"
    )


def test_a_selected_variant_wins(lmcache_registry):
    lmcache_registry.install("cpu", backend("cpu.shm/1"))
    lmcache_registry.install("cpu.memfd", backend("cpu.memfd/1"))
    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.memfd")
    assert serving_tag() == "cpu.memfd/1"
    info = lp.selected_backend("cpu")
    assert (info.selected_by, info.why_selected) == ("explicit", "chosen by LMCACHE_PLATFORM_BACKEND")


def test_a_variant_serves_when_the_primary_cannot(lmcache_registry):
    lmcache_registry.install("cpu", backend("cpu.shm/1", probe=Availability.no("/dev/shm is missing")))
    lmcache_registry.install("cpu.file", backend("cpu.file/1"))
    assert serving_tag() == "cpu.file/1"
    info = lp.selected_backend("cpu")
    assert info.selected_by == "only"
    assert info.why_selected == "the only usable backend; the primary cpu cannot serve: /dev/shm is missing"


def test_ambiguity_is_only_between_equals(lmcache_registry):
    lmcache_registry.install("cpu", backend("cpu.shm/1", probe=Availability.no("/dev/shm is missing")))
    lmcache_registry.install("cpu.file", backend("cpu.file/1"))
    lmcache_registry.install("cpu.memfd", backend("cpu.memfd/1"))
    with pytest.raises(lp.AmbiguousBackendError) as excinfo:
        lp.get_kv_wrapper_factory("cpu")
    assert excinfo.value.candidates == ("cpu.file", "cpu.memfd")
    message = str(excinfo.value)
    assert "none of them is the primary backend 'cpu'" in message
    assert "LMCACHE_PLATFORM_BACKEND=cpu.file" in message


@pytest.fixture
def import_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "imports.log"
    monkeypatch.setenv(IMPORT_LOG_ENV, str(log))
    return log


def install_site(site: Path, backends: dict[str, str]) -> None:
    """One distribution per backend; each module logs its own import."""
    for name, module in backends.items():
        make_distribution(
            site,
            f"vendor-{module}",
            "1.0",
            entry_points={name: module},
            files={f"{module}.py": plugin_source(module, "cpu")},
        )


def test_explicit_selection_never_imports_the_siblings(lmcache_registry, tmp_path, import_log):
    site = tmp_path / "site"
    install_site(site, {"cpu": "sib_cpu_a", "cpu.file": "sib_file_a", "cpu.memfd": "sib_memfd_a"})
    lmcache_registry.add_site_dir(site)
    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.memfd")
    assert serving_tag() == "sib_memfd_a/1"
    assert imported(import_log) == ["sib_memfd_a"]
    statuses = {i.name: i.status.value for i in lp.list_backends(load=False)}
    assert statuses == {"cpu": "not loaded", "cpu.file": "not loaded", "cpu.memfd": "ok"}


def test_an_unusable_explicit_choice_names_the_siblings_without_loading_them(
    lmcache_registry, tmp_path, import_log, monkeypatch
):
    site = tmp_path / "site"
    install_site(site, {"cpu": "sib_cpu_b", "cpu.memfd": "sib_memfd_b"})
    monkeypatch.setenv("FAKE_UNAVAILABLE_SIB_MEMFD_B", "no memfd_create here")
    lmcache_registry.add_site_dir(site)
    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.memfd")
    with pytest.raises(lp.BackendUnavailableError) as excinfo:
        lp.get_kv_wrapper_factory("cpu")
    assert excinfo.value.reasons == {"cpu.memfd": "no memfd_create here"}
    assert "other installed backends of this type: cpu" in str(excinfo.value)
    assert imported(import_log) == ["sib_memfd_b"]


def test_a_usable_primary_leaves_its_variants_unimported(lmcache_registry, tmp_path, import_log):
    site = tmp_path / "site"
    install_site(site, {"cpu": "sib_cpu_c", "cpu.file": "sib_file_c"})
    lmcache_registry.add_site_dir(site)
    assert serving_tag() == "sib_cpu_c/1"
    assert imported(import_log) == ["sib_cpu_c"]
    # Listing loads every backend, so an operator still sees a broken variant.
    assert {i.name: i.selected for i in lp.list_backends()} == {"cpu": True, "cpu.file": False}
    assert imported(import_log) == ["sib_cpu_c", "sib_file_c"]


def test_an_explicit_choice_in_a_fresh_process_skips_the_real_cpu_backend(tmp_path):
    """As an operator sets it: the installed ``cpu`` (and its /dev/shm probe) is never imported."""
    site = tmp_path / "site"
    install_site(site, {"cpu.memfd": "fresh_memfd_d"})
    log = tmp_path / "imports.log"
    code = textwrap.dedent("""
        import sys, lmcache_platform as lp
        print(lp.get_kv_wrapper_factory("cpu").__self__.wire_tag)
        names = [b.name for b in lp.list_backends(load=False)]
        print("cpu" in names, "cpu.file" in names)
        print(sorted(m for m in ("lmcache_platform_cpu", "lmcache_platform_cpu_file") if m in sys.modules))
    """)
    env = env_with_tests_on_path({IMPORT_LOG_ENV: str(log), "LMCACHE_PLATFORM_BACKEND": "cpu.memfd"})
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == ["fresh_memfd_d/1", "True True", "[]"]
    assert imported(log) == ["fresh_memfd_d"]


ENGINE = textwrap.dedent("""
    import sys, torch, lmcache_platform as lp
    from lmcache_platform import wire
    t = torch.zeros(64)
    print(wire.encode([lp.get_kv_wrapper_factory("cpu")(t)]).hex(), flush=True)
    sys.stdin.read()  # keep the export alive until the server has answered
""")
SERVER = textwrap.dedent("""
    import sys, lmcache_platform as lp
    from lmcache_platform import wire
    try:
        wire.decode(bytes.fromhex(sys.stdin.read()))
    except lp.WireFormatError as exc:
        print(exc)
""")


def test_a_server_that_selected_another_backend_says_so_and_what_to_do(tmp_path):
    """Engine on ``cpu.file`` (selected), server on ``cpu`` (the default): real processes, real bytes."""
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    base = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_PLATFORM_")}
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**base, "LMCACHE_PLATFORM_CPU_FILE_DIR": str(kv), "LMCACHE_PLATFORM_BACKEND": "cpu.file"},
    )
    try:
        assert engine.stdout is not None
        data = engine.stdout.readline()
        server = subprocess.run(
            [sys.executable, "-c", SERVER],
            input=data,
            capture_output=True,
            env={**base, "LMCACHE_PLATFORM_CPU_FILE_DIR": str(kv)},
            check=True,
        )
    finally:
        engine.communicate(b"")
    message = server.stdout.decode()
    assert "wire tag 'cpu.file/1' is not accepted for device type 'cpu'" in message
    assert "this process selected backend 'cpu' (lmcache-platform-cpu " in message
    assert "set the same LMCACHE_PLATFORM_BACKEND for both" in message
    assert "install here the backend whose wire tag is 'cpu.file/1'" in message

"""The ``cpu.file`` backend as installed: probe, selection next to ``cpu``, wrapping, gc, independence.

Cross-process behaviour (spawned reopening, transfers, hostile descriptors) is the
conformance suite's job; ``tests/conformance`` runs it against ``cpu.file``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lmcache_platform as lp
import lmcache_platform_cpu_file
from lmcache_platform import Availability
from lmcache_platform.testing import RegistryFixture
from lmcache_platform_cpu_file import CpuFileIPCWrapper, _plugin, _store
from support.imports import non_stdlib_imports

PACKAGE = Path(lmcache_platform_cpu_file.__file__).parent


def test_probe_says_why_it_cannot_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(_store.ENV_DIR, raising=False)
    answer = _plugin.lmcache_platform_probe("cpu")
    assert answer is not None and not answer.ok
    assert answer.reason.startswith("LMCACHE_PLATFORM_CPU_FILE_DIR is not set")
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    monkeypatch.setenv(_store.ENV_DIR, str(loose))
    answer = _plugin.lmcache_platform_probe("cpu")
    assert answer is not None and "has mode 0755; it must be 0700" in answer.reason
    assert _plugin.lmcache_platform_probe("cuda") is None


def test_probe_is_yes_with_a_private_directory(kv_dir: Path) -> None:
    assert _plugin.lmcache_platform_probe("cpu") == Availability.yes()
    assert kv_dir.is_dir()


def test_without_its_directory_cpu_stays_unambiguous(
    lmcache_registry: RegistryFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_store.ENV_DIR, raising=False)
    lmcache_registry.rescan()  # the real installed entry points
    assert lp.selected_backend("cpu").name == "cpu"
    (info,) = [b for b in lp.list_backends() if b.name == "cpu.file"]
    assert info.status.value == "unavailable" and info.distribution == "lmcache-platform-cpu-file"


def test_with_its_directory_cpu_stays_the_default_until_cpu_file_is_chosen(
    lmcache_registry: RegistryFixture, kv_dir: Path
) -> None:
    lmcache_registry.rescan()
    assert lp.get_kv_wrapper_factory("cpu") != CpuFileIPCWrapper.wrap
    assert lp.selected_backend("cpu").selected_by == "primary"
    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.file")
    lmcache_registry.rescan()
    assert lp.get_kv_wrapper_factory("cpu") == CpuFileIPCWrapper.wrap
    assert lp.selected_backend("cpu").distribution == "lmcache-platform-cpu-file"


def test_wrap_moves_the_engine_tensor_into_a_file_and_reopens_it_zero_copy(kv_dir: Path) -> None:
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    v = t[2:, ::2]  # the engine's tensor: a strided view at an offset
    old_address = v.data_ptr()
    w = CpuFileIPCWrapper.wrap(v)
    assert v.data_ptr() != old_address and torch.equal(v, t[2:, ::2]), "moved, contents kept"
    (name,) = os.listdir(kv_dir)
    assert w.file_name == name and w.file_nbytes == 256 and type(w).wire_tag == "cpu.file/1"
    assert w.fields()["file_name"] == name
    view = CpuFileIPCWrapper.from_fields(w.fields()).to_tensor()
    assert (view.shape, view.stride(), view.storage_offset()) == ((6, 4), (8, 2), 16)
    view[0, 0] = -1.0
    assert v[0, 0].item() == -1.0
    w.close()
    assert os.listdir(kv_dir) == [], "closing the last exporting wrapper removes the file"
    assert v[0, 0].item() == -1.0, "the engine's tensor keeps working"
    del view, v


def test_the_file_goes_when_the_engine_tensor_dies(kv_dir: Path) -> None:
    t = torch.ones(1024, dtype=torch.bfloat16)
    CpuFileIPCWrapper.wrap(t)  # no wrapper kept: only the tensor holds the file
    assert len(os.listdir(kv_dir)) == 1
    del t
    assert os.listdir(kv_dir) == []


def test_an_empty_tensor_needs_no_file(kv_dir: Path) -> None:
    w = CpuFileIPCWrapper.wrap(torch.empty(0, 4))
    assert (w.file_name, w.file_nbytes) == ("", 0)
    assert w.to_tensor().shape == (0, 4)
    assert not kv_dir.exists() or os.listdir(kv_dir) == []


PRODUCER = textwrap.dedent("""
    import os, signal, sys
    from lmcache_platform_cpu_file import FileStore
    handle, mm = FileStore().create(4096)
    name = handle["file_name"]
    print(name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs
""")


def test_gc_reclaims_the_files_of_a_killed_producer_only(kv_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PRODUCER], capture_output=True, text=True, env={**os.environ}, check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    stale = proc.stdout.strip()
    handle, mm = _store.FileStore().create(4096)  # this process's: alive
    live = handle["file_name"]
    try:
        assert _plugin.lmcache_platform_gc(dry_run=True) == [str(kv_dir / stale)]
        assert (kv_dir / stale).exists()
        assert _plugin.lmcache_platform_gc(dry_run=False) == [str(kv_dir / stale)]
        assert sorted(os.listdir(kv_dir)) == [live]
    finally:
        mm.close()
        _store.FileStore().release(handle)


def test_gc_without_a_directory_finds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.ENV_DIR, raising=False)
    assert _plugin.lmcache_platform_gc(dry_run=False) == []


ALLOWED_IMPORTS = {"lmcache_platform", "lmcache_platform.hostmem", "lmcache_platform.wire", "torch"}


def test_it_uses_only_the_public_core_api() -> None:
    """As a vendor's backend would: no private core module, no other backend."""
    for path in sorted(PACKAGE.glob("*.py")):
        for module in non_stdlib_imports(path.read_text()):
            assert module in ALLOWED_IMPORTS, f"{path.name} imports {module}"


def test_the_entry_point_loads_neither_torch_nor_the_wrapper() -> None:
    code = (
        "import sys, lmcache_platform_cpu_file._plugin as p\n"
        "p.lmcache_platform_gc(dry_run=True)\n"
        "print(sorted(m for m in ('torch', 'lmcache_platform_cpu_file._wrapper', 'lmcache_platform_cpu')"
        " if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != _store.ENV_DIR}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"

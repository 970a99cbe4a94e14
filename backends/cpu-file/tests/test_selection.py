"""cpu.file's own tests run with ``pytest`` in this project: the test kit keeps them hermetic."""

from pathlib import Path

import pytest

import lmcache_platform as lp
from lmcache_platform.testing import RegistryFixture
from lmcache_platform_cpu_file import CpuFileIPCWrapper, _plugin


def test_my_backend_is_selected(
    lmcache_registry: RegistryFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMCACHE_PLATFORM_CPU_FILE_DIR", str(tmp_path / "kv"))
    lmcache_registry.install("cpu.file", _plugin, distribution="lmcache-platform-cpu-file")
    assert lp.get_kv_wrapper_factory("cpu") == CpuFileIPCWrapper.wrap
    info = lp.selected_backend("cpu")
    assert (info.name, info.distribution) == ("cpu.file", "lmcache-platform-cpu-file")
    assert info.selected_by == "only"  # no other cpu backend in this hermetic registry


def test_it_says_why_it_cannot_serve(
    lmcache_registry: RegistryFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LMCACHE_PLATFORM_CPU_FILE_DIR", raising=False)
    lmcache_registry.install("cpu.file", _plugin, distribution="lmcache-platform-cpu-file")
    with pytest.raises(lp.BackendUnavailableError, match="LMCACHE_PLATFORM_CPU_FILE_DIR is not set"):
        lp.selected_backend("cpu")

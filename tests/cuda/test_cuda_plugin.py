"""The ``cuda`` backend's hooks: probe reasons, wrapper-kind choice, classes, laziness.

Runs without a GPU. The probe tests on this host use the real torch (a CPU
build); the other probe answers fake ``torch.version``/``torch.cuda.is_available``,
which only a ROCm or CUDA install could answer for real.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import importlib_metadata
import pytest
import torch

from lmcache_platform import (
    BackendUnavailableError,
    BaseCacheContext,
    EnvironmentValueError,
    get_kv_wrapper_factory,
)
from lmcache_platform_cuda import (
    IPC_ENV,
    CudaAutoIPCWrapper,
    CudaIPCWrapper,
    CudaVmmIPCWrapper,
    GPUCacheContext,
    RawCudaIPCWrapper,
    _plugin,
    _probe,
)
from lmcache_platform_cuda._config import ipc_kind

HOOKS = (
    _plugin.lmcache_platform_probe,
    _plugin.lmcache_platform_cache_context_class,
    _plugin.lmcache_platform_ipc_wrapper_class,
    _plugin.lmcache_platform_wire_classes,
)


@pytest.mark.parametrize("device_type", ["cpu", "xpu", "cuda.rocm", ""])
def test_other_device_types_get_none(device_type: str) -> None:
    assert [hook(device_type=device_type) for hook in HOOKS] == [None] * len(HOOKS)


def test_classes_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IPC_ENV, raising=False)
    ctx = _plugin.lmcache_platform_cache_context_class(device_type="cuda")
    assert ctx is GPUCacheContext and issubclass(ctx, BaseCacheContext)
    assert ctx.device_type == "cuda"
    assert _plugin.lmcache_platform_ipc_wrapper_class(device_type="cuda") is CudaAutoIPCWrapper
    wire = _plugin.lmcache_platform_wire_classes(device_type="cuda")
    assert wire is not None and set(wire) == {CudaIPCWrapper, RawCudaIPCWrapper, CudaVmmIPCWrapper}
    assert {c.wire_tag for c in wire} == {"cuda.torch/1", "cuda.raw/1", "cuda.vmm/1"}
    assert {c.device_type for c in wire} == {"cuda"}


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", CudaAutoIPCWrapper),
        ("torch", CudaIPCWrapper),
        ("raw", RawCudaIPCWrapper),
        (" RAW ", RawCudaIPCWrapper),
    ],
)
def test_env_selects_the_wrapper_kind_at_call_time(
    value: str, expected: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(IPC_ENV, "torch")
    assert _plugin.lmcache_platform_ipc_wrapper_class(device_type="cuda") is CudaIPCWrapper
    monkeypatch.setenv(IPC_ENV, value)  # changed after import and after a first call
    assert _plugin.lmcache_platform_ipc_wrapper_class(device_type="cuda") is expected


def test_invalid_ipc_kind_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IPC_ENV, "cuda-ipc")
    with pytest.raises(EnvironmentValueError) as info:
        ipc_kind()
    assert (
        str(info.value) == f"{IPC_ENV}='cuda-ipc' is not a CUDA IPC kind; use one of: auto, torch, raw, vmm"
    )
    assert (info.value.variable, info.value.value, info.value.choices) == (
        IPC_ENV,
        "cuda-ipc",
        ("auto", "torch", "raw", "vmm"),
    )


def test_probe_on_this_cpu_build_of_torch() -> None:
    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("this torch is a GPU build")
    answer = _probe.probe()
    assert not answer.ok
    assert answer.reason.startswith("torch built without CUDA")


@pytest.mark.parametrize(
    "cuda, hip, available, visible, reason",
    [
        (None, "6.2.41133", False, None, "HIP build: install a ROCm backend"),
        ("12.4", "6.2", True, None, "HIP build: install a ROCm backend"),
        (None, None, False, None, "torch built without CUDA"),
        ("12.4", None, False, None, "no CUDA device visible"),
        ("12.4", None, False, "", "no CUDA device visible (CUDA_VISIBLE_DEVICES='')"),
        ("12.4", None, True, None, ""),
    ],
)
def test_probe_reasons(
    cuda: str | None,
    hip: str | None,
    available: bool,
    visible: str | None,
    reason: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    answer = _probe.probe()
    assert answer.ok is (reason == "")
    assert answer.reason.startswith(reason)


def test_probe_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    assert _probe.probe().reason == "torch is not installed"


def test_unavailable_reason_reaches_the_selection_error(lmcache_registry: Any) -> None:
    """Through core's registry, as an engine would meet it on a host without CUDA."""
    if torch.cuda.is_available():
        pytest.skip("this host has a usable GPU")
    lmcache_registry.install("cuda", _plugin, distribution="lmcache-platform-cuda")
    with pytest.raises(BackendUnavailableError) as info:
        get_kv_wrapper_factory("cuda")
    assert info.value.reasons["cuda"] == _probe.probe().reason
    assert _probe.probe().reason in str(info.value)


def test_registry_follows_the_env_and_reports_a_bad_value(
    lmcache_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe faked available (no GPU here); the rest is the real resolution path."""
    monkeypatch.setattr(_probe, "probe", lambda: _probe.Availability.yes())  # type: ignore[attr-defined]
    monkeypatch.setenv(IPC_ENV, "raw")
    lmcache_registry.install("cuda", _plugin, distribution="lmcache-platform-cuda")
    factory = get_kv_wrapper_factory("cuda")
    assert getattr(factory, "__self__", None) is RawCudaIPCWrapper

    lmcache_registry.registry.clear(scanned=True)  # a fresh process, as far as resolution goes
    lmcache_registry.install("cuda", _plugin, distribution="lmcache-platform-cuda")
    monkeypatch.setenv(IPC_ENV, "bogus")
    with pytest.raises(BackendUnavailableError, match=f"{IPC_ENV}='bogus' is not a CUDA IPC kind"):
        get_kv_wrapper_factory("cuda")


def test_installed_entry_point() -> None:
    (ep,) = [e for e in importlib_metadata.entry_points(group="lmcache.platform") if e.name == "cuda"]
    assert ep.value == "lmcache_platform_cuda._plugin"
    assert ep.dist is not None and ep.dist.name == "lmcache-platform-cuda"
    assert ep.load() is _plugin


def test_plugin_import_is_light() -> None:
    """Discovery imports the entry point; that must not import torch or the wrappers."""
    code = textwrap.dedent(
        """
        import sys
        import lmcache_platform_cuda._plugin
        heavy = [m for m in ("torch", "lmcache_platform_cuda._torch_ipc",
                             "lmcache_platform_cuda._raw_ipc", "lmcache_platform_cuda._driver",
                             "lmcache_platform_cuda._vmm_ipc", "lmcache_platform_cuda._auto",
                             "lmcache_platform_cuda._cache_context") if m in sys.modules]
        assert not heavy, heavy
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

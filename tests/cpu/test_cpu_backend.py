"""The ``cpu`` backend as installed: hooks, probe, laziness, and ``CPUCacheContext``."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

import lmcache_platform
from lmcache_platform import Availability, DescriptorError, EngineGroupInfo, EnvironmentValueError
from lmcache_platform._plugins.registry import selected_backend, wire_classes_for
from lmcache_platform.hostmem import FileMapIPCWrapper
from lmcache_platform_cpu import CPUCacheContext, CpuMemfdIPCWrapper, CpuShmIPCWrapper, _plugin, _shm


def mappings() -> int:
    """Mappings of our memory of either kind in this process, once pending garbage is freed.

    An earlier test's reference cycle (a tensor kept by a traceback, say) would
    otherwise be collected at any allocation, mid-test, and change the count.
    """
    gc.collect()
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm/" + _shm.PREFIX in line or "/memfd:" + _shm.PREFIX in line)


def test_hooks_serve_cpu_and_decline_other_device_types(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _plugin.lmcache_platform_api_version() == lmcache_platform.API_VERSION
    assert _plugin.lmcache_platform_cache_context_class("cpu") is CPUCacheContext
    assert _plugin.lmcache_platform_ipc_wrapper_class("cpu") is CpuMemfdIPCWrapper  # the default
    assert _plugin.lmcache_platform_wire_classes("cpu") == (
        CpuMemfdIPCWrapper,
        CpuShmIPCWrapper,
        FileMapIPCWrapper,
    )
    for other in ("cuda", "xpu", "meta"):
        assert _plugin.lmcache_platform_cache_context_class(other) is None
        assert _plugin.lmcache_platform_ipc_wrapper_class(other) is None
        assert _plugin.lmcache_platform_wire_classes(other) is None
        assert _plugin.lmcache_platform_probe(other) is None
    assert _plugin.lmcache_platform_probe("cpu") == Availability.yes()
    for value, cls in (("shm", CpuShmIPCWrapper), (" MEMFD ", CpuMemfdIPCWrapper), ("", CpuMemfdIPCWrapper)):
        monkeypatch.setenv("LMCACHE_PLATFORM_CPU_IPC", value)
        assert _plugin.lmcache_platform_ipc_wrapper_class("cpu") is cls
        assert _plugin.lmcache_platform_probe("cpu") == Availability.yes()
    monkeypatch.setenv("LMCACHE_PLATFORM_CPU_IPC", "posix")
    with pytest.raises(EnvironmentValueError, match="'posix' is not a CPU IPC kind; use one of: memfd, shm"):
        _plugin.lmcache_platform_ipc_wrapper_class("cpu")


def test_installed_entry_point_is_selected_for_cpu() -> None:
    info = selected_backend("cpu")
    assert (info.name, info.distribution) == ("cpu", "lmcache-platform-cpu")
    assert wire_classes_for("cpu") == {
        "cpu.memfd/1": CpuMemfdIPCWrapper,
        "cpu.shm/1": CpuShmIPCWrapper,
        "cpu.filemap/1": FileMapIPCWrapper,
    }
    assert lmcache_platform.get_kv_wrapper_factory("cpu") == CpuMemfdIPCWrapper.wrap


def test_probe_says_why_it_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr("os.memfd_create")
    answer = _plugin.lmcache_platform_probe("cpu")
    assert (
        answer is not None
        and not answer.ok
        and "no os.memfd_create; set LMCACHE_PLATFORM_CPU_IPC=shm" in answer.reason
    )
    monkeypatch.setenv("LMCACHE_PLATFORM_CPU_IPC", "shm")  # named segments need no memfds, but /dev/shm
    monkeypatch.setattr(_shm, "SHM_DIR", "/nonexistent-shm-dir")
    answer = _plugin.lmcache_platform_probe("cpu")
    assert answer is not None and not answer.ok and "/nonexistent-shm-dir does not exist" in answer.reason
    monkeypatch.setattr(sys, "platform", "darwin")
    answer = _plugin.lmcache_platform_probe("cpu")
    assert answer is not None and not answer.ok and "shm export needs Linux, not darwin" in answer.reason


def test_entry_point_module_and_probe_and_gc_do_not_import_torch() -> None:
    code = (
        "import sys, lmcache_platform_cpu, lmcache_platform_cpu._plugin as p\n"
        "assert p.lmcache_platform_probe('cpu').ok\n"
        "p.lmcache_platform_gc(dry_run=True)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def make_layers(n: int = 2) -> list[torch.Tensor]:
    return [torch.randn(2, 8, 16, 2, 4) for _ in range(n)]  # FLASH_ATTN, 8 blocks of 16


def test_cache_context_is_host_based_and_closes_its_wrappers() -> None:
    layers = make_layers()
    engine_side = lmcache_platform.wrap_kv_caches(layers)
    server_side = [CpuMemfdIPCWrapper.from_fields(w.fields()) for w in engine_side]
    base = mappings()
    with lmcache_platform.create_cache_context(
        server_side, 16, engine_group_infos=[EngineGroupInfo(layer_indices=[0, 1], block_size=16)]
    ) as ctx:
        assert type(ctx) is CPUCacheContext and ctx.device == torch.device("cpu")
        assert mappings() == base + 2
        ctx.stream.synchronize()  # the no-op stream
        assert ctx.stream.query() is True
        assert ctx.get_temp_kernel_group_buffer(0, 0).device.type == "cpu"
        ctx.store_chunk([[3]], slot=1)
        staged = ctx.get_temp_kernel_group_buffer(1, 0)  # [kv, layers, tokens, hidden]
        assert torch.equal(staged[:, 1], layers[1][:, 3].reshape(2, 16, 8))
        del staged
    assert ctx.closed and all(w.closed for w in server_side)
    assert mappings() == base  # closing released every mapping of the context
    assert not any(w.closed for w in engine_side)  # the engine's exports are its own
    for w in engine_side:
        w.close()


def test_failed_construction_closes_the_wrappers_it_opened() -> None:
    layers = make_layers(3)
    engine_side = lmcache_platform.wrap_kv_caches(layers)
    server_side = [CpuMemfdIPCWrapper.from_fields(w.fields()) for w in engine_side]
    engine_side[2].close()  # its memfd is closed: the third reopen fails
    base = mappings()
    # The fd number is free, or already reused by another file: refused either way.
    with pytest.raises(DescriptorError, match=r"fails the (fd|name|memfd) check"):
        lmcache_platform.create_cache_context(server_side, 16)
    assert all(w.closed for w in server_side[:2])
    assert mappings() == base
    for w in engine_side[:2]:
        w.close()

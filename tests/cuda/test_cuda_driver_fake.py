"""The ctypes driver binding, against a fake ``libcuda`` (no GPU or driver here).

``FakeLibCuda`` answers each driver entry point the way the CUDA documentation
says the real one does, writing results through the pointers it is given. What is
tested is ours: which calls are made, in which context, with which arguments, and
how failures are reported. The real driver is exercised by the ``cuda`` tests.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_platform import DescriptorError
from lmcache_platform_cuda import _driver
from lmcache_platform_cuda._driver import CudaDriver

CUDA_ERROR_INVALID_VALUE = 1
BASE, SIZE = 0x7F00_0000_0000, 64 << 20
HANDLE = bytes(range(64))


class FakeLibCuda:
    """Entry points of libcuda.so.1 as Python callables (``argtypes`` are accepted and ignored)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.stack: list[int] = []  # the thread's context stack
        self.legacy_ipc_capable = 1
        self.open_result = 0
        self._fns: dict[str, Callable[..., int]] = {}
        for name in (*_driver._SIGNATURES, *_driver._HOST_SIGNATURES):
            self._fns[name] = self._entry(name, getattr(self, "_" + name))
        self.registered: dict[int, tuple[int, int]] = {}  # page-locked host memory: address -> (size, flags)

    def _entry(self, name: str, impl: Callable[..., int]) -> Callable[..., int]:
        def call(*args: Any) -> int:
            if name not in (
                "cuGetErrorName",
                "cuInit",
                "cuDeviceGet",
                "cuDevicePrimaryCtxRetain",
                "cuCtxPushCurrent_v2",
                "cuCtxPopCurrent_v2",
            ):
                assert self.stack, f"{name} called with no context current"
                self.calls.append((name, self.stack[-1]))
            return impl(*args)

        return call

    def __getattr__(self, name: str) -> Callable[..., int]:
        try:
            return self._fns[name]
        except KeyError:  # as ctypes says of a symbol the library lacks (here: the VMM API)
            raise AttributeError(f"undefined symbol: {name}") from None

    @staticmethod
    def _out(arg: Any) -> Any:
        return arg._obj  # the object behind ctypes.byref()

    def _cuInit(self, flags: int) -> int:
        assert flags == 0
        return 0

    def _cuGetErrorName(self, rc: int, out: Any) -> int:
        self._out(out).value = {1: b"CUDA_ERROR_INVALID_VALUE"}.get(rc, b"CUDA_ERROR_UNKNOWN")
        return 0

    def _cuDeviceGet(self, out: Any, ordinal: int) -> int:
        self._out(out).value = 100 + ordinal
        return 0

    def _cuDevicePrimaryCtxRetain(self, out: Any, dev: int) -> int:
        self.calls.append(("retain", dev))
        self._out(out).value = 0x1000 + dev
        return 0

    def _cuCtxPushCurrent_v2(self, ctx: Any) -> int:
        self.stack.append(ctx.value)
        return 0

    def _cuCtxPopCurrent_v2(self, out: Any) -> int:
        self._out(out).value = self.stack.pop()
        return 0

    def _cuPointerGetAttribute(self, out: Any, attribute: int, ptr: int) -> int:
        assert attribute == 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
        self._out(out).value = self.legacy_ipc_capable
        return 0

    def _cuMemGetAddressRange_v2(self, base: Any, size: Any, ptr: int) -> int:
        self._out(base).value, self._out(size).value = BASE, SIZE
        return 0

    def _cuIpcGetMemHandle(self, out: Any, base: Any) -> int:
        assert base.value == BASE  # the handle is always of the allocation base
        ctypes.memmove(self._out(out).reserved, HANDLE, 64)
        return 0

    def _cuIpcOpenMemHandle_v2(self, out: Any, handle: Any, flags: int) -> int:
        assert bytes(handle.reserved) == HANDLE and flags == 1  # by value; lazy peer access
        if self.open_result:
            return self.open_result
        self._out(out).value = BASE
        return 0

    def _cuIpcCloseMemHandle(self, ptr: Any) -> int:
        return 0

    def _cuCtxSynchronize(self) -> int:
        return 0

    def _cuMemHostRegister_v2(self, address: int, nbytes: int, flags: int) -> int:
        if address in self.registered:
            return 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.registered[address] = (nbytes, flags)
        return 0

    def _cuMemHostUnregister(self, address: int) -> int:
        return 0 if self.registered.pop(address, None) else 713  # ..._NOT_REGISTERED


@pytest.fixture
def lib() -> FakeLibCuda:
    return FakeLibCuda()


def test_export_takes_the_handle_of_the_allocation_base(lib: FakeLibCuda) -> None:
    driver = CudaDriver(lib)  # type: ignore[arg-type]
    assert driver.export(BASE + 4096, ordinal=1) == (HANDLE, BASE, SIZE)
    ctx = 0x1000 + 101
    assert lib.calls == [
        ("retain", 101),
        ("cuPointerGetAttribute", ctx),
        ("cuMemGetAddressRange_v2", ctx),
        ("cuIpcGetMemHandle", ctx),
    ]
    assert lib.stack == []  # pushed and popped
    driver.export(BASE, ordinal=1)
    assert [c for c in lib.calls if c[0] == "retain"] == [("retain", 101)]  # retained once


def test_vmm_memory_is_refused_with_a_hint(lib: FakeLibCuda) -> None:
    lib.legacy_ipc_capable = 0
    with pytest.raises(DescriptorError, match="expandable_segments") as info:
        CudaDriver(lib).export(BASE, ordinal=0)  # type: ignore[arg-type]
    assert "cannot be exported" in str(info.value)
    assert lib.stack == []


def test_open_maps_and_reports_the_mapped_size(lib: FakeLibCuda) -> None:
    assert CudaDriver(lib).open(HANDLE, ordinal=0) == (BASE, SIZE)  # type: ignore[arg-type]


def test_a_failed_open_names_the_call_and_the_error(lib: FakeLibCuda) -> None:
    lib.open_result = CUDA_ERROR_INVALID_VALUE
    with pytest.raises(DescriptorError) as info:
        CudaDriver(lib).open(HANDLE, ordinal=0)  # type: ignore[arg-type]
    assert str(info.value).startswith("cuIpcOpenMemHandle_v2 failed: CUDA_ERROR_INVALID_VALUE (1)")
    assert "exporting process may have exited" in str(info.value)
    assert lib.stack == []


def test_open_refuses_a_short_handle(lib: FakeLibCuda) -> None:
    with pytest.raises(DescriptorError, match="has 64 bytes, got 63"):
        CudaDriver(lib).open(HANDLE[:63], ordinal=0)  # type: ignore[arg-type]


def test_close_synchronizes_then_unmaps(lib: FakeLibCuda) -> None:
    CudaDriver(lib).close(BASE, ordinal=0)  # type: ignore[arg-type]
    assert [name for name, _ in lib.calls if name != "retain"] == ["cuCtxSynchronize", "cuIpcCloseMemHandle"]


def test_missing_driver_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lib(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    with pytest.raises(DescriptorError, match=r"need the NVIDIA driver library libcuda\.so\.1"):
        CudaDriver.load()


def test_host_memory_is_registered_portable_on_the_contexts_device_and_unregistered(lib: FakeLibCuda) -> None:
    driver = CudaDriver(lib)  # type: ignore[arg-type]
    driver.host_register(0x7000_0000, 1 << 21, ordinal=1)
    assert lib.registered == {0x7000_0000: (1 << 21, _driver.MEMHOSTREGISTER_PORTABLE)}
    assert lib.calls[-1] == ("cuMemHostRegister_v2", 0x1000 + 101) and lib.stack == []
    with pytest.raises(DescriptorError, match=r"cuMemHostRegister_v2 failed: CUDA_ERROR_UNKNOWN.*pageable"):
        driver.host_register(0x7000_0000, 1 << 21, ordinal=1)  # twice: the driver refuses, we say so
    driver.host_unregister(0x7000_0000, ordinal=1)
    assert lib.registered == {}
    with pytest.raises(DescriptorError, match="cuMemHostUnregister failed"):
        driver.host_unregister(0x7000_0000, ordinal=1)


def test_the_cuda_context_registers_chunk_memory_through_the_driver(
    lib: FakeLibCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from lmcache_platform_cuda import GPUCacheContext

    monkeypatch.setattr(_driver, "_driver", CudaDriver(lib))  # type: ignore[arg-type]
    ctx = SimpleNamespace(ordinal=0)  # the method needs only the device's ordinal (no GPU here)
    undo = GPUCacheContext.register_host_memory(ctx, 0x7100_0000, 4 << 20)  # type: ignore[arg-type]
    assert lib.registered == {0x7100_0000: (4 << 20, 1)} and undo is not None
    with pytest.raises(DescriptorError):  # a refusal raises: the pool logs and counts it
        GPUCacheContext.register_host_memory(ctx, 0x7100_0000, 4 << 20)  # type: ignore[arg-type]
    undo()
    assert lib.registered == {}

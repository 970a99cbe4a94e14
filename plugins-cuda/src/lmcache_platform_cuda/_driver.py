"""The CUDA driver API (``libcuda.so.1``) through ctypes, for raw IPC handles.

Why the driver and not ``libcudart``: ``libcuda.so.1`` ships with the NVIDIA
driver, so it is on the loader path wherever a GPU is usable, whereas the runtime
library lives inside torch's wheel under a versioned name. Why not ``cuda-python``
or CuPy: ten entry points do not justify a dependency. Every call runs with the
device's *primary* context pushed (the context torch itself uses), so pointers are
interchangeable with torch's and the calls work on any thread, including a fresh
one on which the runtime never made a context current.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lmcache_platform import DescriptorError

if TYPE_CHECKING:
    import torch

IPC_HANDLE_SIZE = 64
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_VMM_HINT = (
    "memory from CUDA virtual memory management (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
    "vLLM sleep mode / CuMemAllocator) has no legacy IPC handle; disable expandable segments "
    "for the KV cache or use the torch IPC kind"
)

_CUresult = ctypes.c_int
_CUdeviceptr = ctypes.c_uint64
_CUcontext = ctypes.c_void_p


class _CUipcMemHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back as bytes cut at the first NUL.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_SIZE)]


# name -> argtypes; every function returns CUresult. ``_v2`` names are what cuda.h
# maps the unsuffixed ones to since CUDA 4/11.
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [_CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_CUcontext), ctypes.c_int],
    "cuCtxPushCurrent_v2": [_CUcontext],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(_CUcontext)],
    "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, _CUdeviceptr],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(_CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), _CUdeviceptr],
    "cuIpcGetMemHandle": [ctypes.POINTER(_CUipcMemHandle), _CUdeviceptr],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(_CUdeviceptr), _CUipcMemHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [_CUdeviceptr],
    "cuCtxSynchronize": [],
}


class _CudaBuffer:
    """A bare ``__cuda_array_interface__`` over device bytes, so torch can alias them.

    torch keeps this object alive as long as any tensor built on it, and it keeps
    ``owner`` (the mapping) alive in turn: that is what ties unmapping to tensor death.
    """

    def __init__(self, owner: object, ptr: int, nbytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


class CudaDriver:
    """Raw IPC operations on device memory, implementing ``_raw_ipc.IpcRuntime``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = _CUresult
            self._fns[name] = fn
        self._lock = threading.Lock()
        self._contexts: dict[int, int] = {}
        self._call("cuInit", 0)

    @classmethod
    def load(cls) -> CudaDriver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DescriptorError(
                f"raw CUDA IPC needs the NVIDIA driver library libcuda.so.1, which did not load: {exc}"
            ) from exc
        return cls(lib)

    # -- plumbing --------------------------------------------------------------------

    def _call(self, name: str, *args: Any, hint: str = "") -> None:
        rc = int(self._fns[name](*args))
        if rc:
            raise DescriptorError(f"{name} failed: {self._error_name(rc)}" + (f"; {hint}" if hint else ""))

    def _error_name(self, rc: int) -> str:
        text = ctypes.c_char_p()
        if int(self._fns["cuGetErrorName"](rc, ctypes.byref(text))) or text.value is None:
            return f"CUresult {rc}"
        return f"{text.value.decode()} ({rc})"

    @contextmanager
    def _on(self, ordinal: int) -> Iterator[None]:
        """Run with ``ordinal``'s primary context current on this thread."""
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int()
                self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
                handle = _CUcontext()
                # Retained for the process lifetime: it is the context torch uses anyway.
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), dev.value)
                ctx = self._contexts[ordinal] = int(handle.value or 0)
        self._call("cuCtxPushCurrent_v2", _CUcontext(ctx))
        try:
            yield
        finally:
            popped = _CUcontext()
            self._call("cuCtxPopCurrent_v2", ctypes.byref(popped))

    # -- IpcRuntime ------------------------------------------------------------------

    def address_range(self, ptr: int, ordinal: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation (or mapping) containing ``ptr``."""
        base, size = _CUdeviceptr(), ctypes.c_size_t()
        with self._on(ordinal):
            self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
        return int(base.value), int(size.value)

    def export(self, ptr: int, ordinal: int) -> tuple[bytes, int, int]:
        """IPC handle of the allocation holding ``ptr``, with its base and size."""
        capable = ctypes.c_int64(0)
        with self._on(ordinal):
            self._call(
                "cuPointerGetAttribute",
                ctypes.byref(capable),
                _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                ptr,
            )
            if not capable.value:
                raise DescriptorError(f"device pointer {ptr:#x} cannot be exported: {_VMM_HINT}")
            base, size = _CUdeviceptr(), ctypes.c_size_t()
            self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
            handle = _CUipcMemHandle()
            self._call("cuIpcGetMemHandle", ctypes.byref(handle), base, hint=_VMM_HINT)
        return bytes(handle.reserved), int(base.value), int(size.value)

    def open(self, handle: bytes, ordinal: int) -> tuple[int, int]:
        """Map a peer's allocation; returns ``(base, size)`` of the local mapping."""
        if len(handle) != IPC_HANDLE_SIZE:
            raise DescriptorError(f"a CUDA IPC handle has {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        raw = _CUipcMemHandle()
        ctypes.memmove(raw.reserved, handle, IPC_HANDLE_SIZE)
        ptr = _CUdeviceptr()
        with self._on(ordinal):
            self._call(
                "cuIpcOpenMemHandle_v2",
                ctypes.byref(ptr),
                raw,
                _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                hint="the exporting process may have exited or freed the memory",
            )
            try:
                base, size = _CUdeviceptr(), ctypes.c_size_t()
                self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
            except DescriptorError:
                self._call("cuIpcCloseMemHandle", ptr)
                raise
        return int(ptr.value), int(size.value)

    def close(self, ptr: int, ordinal: int) -> None:
        """Unmap what :meth:`open` mapped (frees a dead exporter's memory).

        The device is synchronised first: work still queued on any stream may touch
        the mapping. Unmapping happens once per allocation, so the wait is cheap.
        """
        with self._on(ordinal):
            self._call("cuCtxSynchronize")
            self._call("cuIpcCloseMemHandle", ptr)

    def as_tensor(self, owner: object, ptr: int, nbytes: int, ordinal: int) -> torch.Tensor:
        """A 1-D uint8 tensor aliasing ``nbytes`` at ``ptr``; it keeps ``owner`` alive."""
        import importlib.util

        import torch

        if importlib.util.find_spec("numpy") is None:  # torch parses the interface with numpy
            raise DescriptorError("raw CUDA IPC needs numpy installed to build tensors on mapped memory")

        return torch.as_tensor(_CudaBuffer(owner, ptr, nbytes), device=torch.device("cuda", ordinal))


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()


def driver() -> CudaDriver:
    """The process's driver binding, loaded on first use."""
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                _driver = CudaDriver.load()
    return _driver

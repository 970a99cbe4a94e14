"""The CUDA driver API (``libcuda.so.1``) through ctypes: raw IPC handles and VMM imports.

Why the driver and not ``libcudart``: ``libcuda.so.1`` ships with the NVIDIA
driver, so it is on the loader path wherever a GPU is usable, whereas the runtime
library lives inside torch's wheel under a versioned name. Why not ``cuda-python``
or CuPy: two dozen entry points do not justify a dependency. Every call runs with the
device's *primary* context pushed (the context torch itself uses), so pointers are
interchangeable with torch's and the calls work on any thread, including a fresh
one on which the runtime never made a context current.

The virtual-memory (VMM) entry points are bound on first use, so a driver too old to
have them still serves raw IPC, and refuses only the VMM kind, saying why.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lmcache_platform import DescriptorError

from ._errors import EXPORT_HINT, VMM_HINT, VmmMemoryError, VmmNotExportableError, VmmUnsupportedError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IPC_HANDLE_SIZE = 64
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_CUDA_ERROR_INVALID_VALUE = 1
#: What ``cuMemRetainAllocationHandle`` answers for an address no ``cuMemMap`` mapped
#: (documented: INVALID_VALUE; NOT_PERMITTED and NOT_SUPPORTED taken the same way).
_NOT_VMM = frozenset({_CUDA_ERROR_INVALID_VALUE, 800, 801})
#: The CUresults after which a context is unusable for the process's life (cuda.h: "the
#: process must be terminated and relaunched"): ILLEGAL_ADDRESS, LAUNCH_TIMEOUT,
#: HARDWARE_STACK_ERROR, ILLEGAL_INSTRUCTION, MISALIGNED_ADDRESS, INVALID_ADDRESS_SPACE,
#: INVALID_PC, LAUNCH_FAILED.
STICKY_ERRORS = frozenset({700, 702, 714, 715, 716, 717, 718, 719})
#: ``CUmemAllocationHandleType``: a POSIX file descriptor.
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103

_CUresult = ctypes.c_int
_CUdeviceptr = ctypes.c_uint64
_CUcontext = ctypes.c_void_p
_CUmemHandle = ctypes.c_uint64  # CUmemGenericAllocationHandle


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


def device_allocation_prop(ordinal: int, handle_types: int = 0) -> CUmemAllocationProp:
    """``CUmemAllocationProp`` of pinned memory on device ``ordinal`` (as vLLM creates it)."""
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = handle_types
    prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
    return prop


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
#: Page-locking host memory (every driver since CUDA 6.5), bound on first use.
_HOST_SIGNATURES: dict[str, list[Any]] = {
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
}
#: ``CU_MEMHOSTREGISTER_PORTABLE``: pinned for every context, so one registration serves all devices.
MEMHOSTREGISTER_PORTABLE = 0x01
#: The VMM entry points (CUDA 10.2+), bound on first use; same conventions.
_VMM_SIGNATURES: dict[str, list[Any]] = {
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuMemGetAllocationGranularity": [
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(CUmemAllocationProp),
        ctypes.c_int,
    ],
    "cuMemRetainAllocationHandle": [ctypes.POINTER(_CUmemHandle), ctypes.c_void_p],
    "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(CUmemAllocationProp), _CUmemHandle],
    "cuMemExportToShareableHandle": [
        ctypes.POINTER(ctypes.c_int),
        _CUmemHandle,
        ctypes.c_int,
        ctypes.c_ulonglong,
    ],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_CUmemHandle), ctypes.c_void_p, ctypes.c_int],
    "cuMemRelease": [_CUmemHandle],
    "cuMemAddressReserve": [
        ctypes.POINTER(_CUdeviceptr),
        ctypes.c_size_t,
        ctypes.c_size_t,
        _CUdeviceptr,
        ctypes.c_ulonglong,
    ],
    "cuMemAddressFree": [_CUdeviceptr, ctypes.c_size_t],
    "cuMemMap": [_CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, _CUmemHandle, ctypes.c_ulonglong],
    "cuMemUnmap": [_CUdeviceptr, ctypes.c_size_t],
    "cuMemSetAccess": [_CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(CUmemAccessDesc), ctypes.c_size_t],
}


def byte_interface(ptr: int, nbytes: int, *, version: int) -> dict[str, Any]:
    """An array interface over ``nbytes`` writable bytes at ``ptr``, one ``uint8`` each.

    ``version`` is the protocol's: 2 for ``__cuda_array_interface__``, 3 for numpy's
    ``__array_interface__`` (the host twin the tests' fake driver builds).
    """
    return {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": version}


class _CudaBuffer:
    """A bare ``__cuda_array_interface__`` over device bytes, so torch can alias them.

    torch keeps this object alive as long as any tensor built on it, and it keeps
    ``owner`` (the mapping) alive in turn: that is what ties unmapping to tensor death.
    """

    def __init__(self, owner: object, ptr: int, nbytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = byte_interface(ptr, nbytes, version=2)


class CudaDriver:
    """IPC operations on device memory: ``_raw_ipc.IpcRuntime`` and ``_vmm_ipc.VmmRuntime``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._fns: dict[str, Any] = {}
        self._bind(_SIGNATURES)
        self._vmm_bound = False
        # Re-entrant: a finalizer (a mapping's unmap) may run on this thread while it holds the
        # lock, binding entry points or retaining a context on first use.
        self._lock = threading.RLock()
        self._contexts: dict[int, int] = {}
        self._call("cuInit", 0)

    def _bind(self, signatures: dict[str, list[Any]]) -> None:
        for name, argtypes in signatures.items():
            fn = getattr(self._lib, name)
            fn.argtypes = argtypes
            fn.restype = _CUresult
            self._fns[name] = fn

    @classmethod
    def load(cls) -> CudaDriver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DescriptorError(
                f"raw and VMM CUDA IPC need the NVIDIA driver library libcuda.so.1, which did not load: {exc}"
            ) from exc
        return cls(lib)

    # -- plumbing --------------------------------------------------------------------

    def _call(self, name: str, *args: Any, hint: str = "") -> None:
        rc = int(self._fns[name](*args))
        if rc:
            raise DescriptorError(f"{name} failed: {self._error_name(rc)}" + (f"; {hint}" if hint else ""))

    def _undo(self, name: str, *args: Any) -> None:
        """A call on a failure path: a second failure is logged, the first one is raised."""
        rc = int(self._fns[name](*args))
        if rc:
            log.warning("%s failed while undoing a failed import: %s", name, self._error_name(rc))

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
            # Logged, not raised: the call inside succeeded or raised already, and what it
            # did (a registration, a mapping) must not be reported as not done.
            popped = _CUcontext()
            rc = int(self._fns["cuCtxPopCurrent_v2"](ctypes.byref(popped)))
            if rc:
                log.error("cuCtxPopCurrent failed: %s", self._error_name(rc))

    # -- IpcRuntime ------------------------------------------------------------------

    def address_range(self, ptr: int, ordinal: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation (or mapping) containing ``ptr``."""
        base, size = _CUdeviceptr(), ctypes.c_size_t()
        with self._on(ordinal):
            self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
        return int(base.value), int(size.value)

    def export(self, ptr: int, ordinal: int) -> tuple[bytes, int, int]:
        """IPC handle of the allocation holding ``ptr``, with its base and size.

        Virtual memory has no legacy handle: that refusal is a :class:`VmmMemoryError`
        naming the VMM kind, however the driver words it.
        """
        capable = ctypes.c_int64(0)
        try:
            with self._on(ordinal):
                self._call(
                    "cuPointerGetAttribute",
                    ctypes.byref(capable),
                    _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                    ptr,
                )
                if not capable.value:
                    raise DescriptorError(f"device pointer {ptr:#x} has no legacy IPC handle")
                base, size = _CUdeviceptr(), ctypes.c_size_t()
                self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
                handle = _CUipcMemHandle()
                self._call("cuIpcGetMemHandle", ctypes.byref(handle), base, hint=VMM_HINT)
        except DescriptorError as exc:
            vmm = self._is_vmm(ptr, ordinal)
            if not (vmm or capable.value == 0):
                raise
            error = VmmMemoryError if vmm else DescriptorError  # no legacy handle, VMM or not
            why = f"device pointer {ptr:#x} cannot be exported with legacy CUDA IPC ({exc})"
            raise error(f"{why}: {VMM_HINT}") from exc
        return bytes(handle.reserved), int(base.value), int(size.value)

    def _is_vmm(self, ptr: int, ordinal: int) -> bool:
        try:
            return self.vmm_range(ptr, ordinal) is not None
        except DescriptorError:  # no VMM API, or no answer: not known to be virtual memory
            return False

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

    def sticky_error(self, ordinal: int) -> str | None:
        """The error name if device ``ordinal``'s context is in a sticky error state, else None.

        After an illegal address (and the other errors of :data:`STICKY_ERRORS`) every later
        call of the process returns the same error: only a new process can use the device.
        """
        with self._on(ordinal):
            rc = int(self._fns["cuCtxSynchronize"]())
        return self._error_name(rc) if rc in STICKY_ERRORS else None

    # -- host memory -----------------------------------------------------------------

    def host_register(self, address: int, nbytes: int, ordinal: int) -> None:
        """Page-lock ``[address, address + nbytes)`` for every device (``cuMemHostRegister``).

        Through the driver rather than the runtime: a refusal here leaves no sticky
        "last error" on the thread for torch's next kernel launch to trip over.
        Raises :class:`DescriptorError` with the driver's error name.
        """
        self._bind_host()
        with self._on(ordinal):
            self._call(
                "cuMemHostRegister_v2",
                address,
                nbytes,
                MEMHOSTREGISTER_PORTABLE,
                hint="the memory stays pageable (RLIMIT_MEMLOCK or the driver's pinned-memory limit?)",
            )

    def host_unregister(self, address: int, ordinal: int) -> None:
        """End :meth:`host_register` of the mapping at ``address`` (before it is unmapped)."""
        self._bind_host()
        with self._on(ordinal):
            self._call("cuMemHostUnregister", address)

    def _bind_host(self) -> None:
        with self._lock:
            if "cuMemHostUnregister" not in self._fns:
                try:
                    self._bind(_HOST_SIGNATURES)
                except AttributeError as exc:
                    raise DescriptorError(f"this NVIDIA driver cannot page-lock host memory ({exc})") from exc

    # -- VmmRuntime ------------------------------------------------------------------

    def _vmm(self) -> None:
        """Bind the VMM entry points once; a driver without them is refused, saying so."""
        if self._vmm_bound:
            return
        with self._lock:
            if not self._vmm_bound:
                try:
                    self._bind(_VMM_SIGNATURES)
                except AttributeError as exc:
                    raise VmmUnsupportedError(
                        f"this NVIDIA driver has no virtual memory management API ({exc}); update the "
                        "driver (CUDA 10.2 or later), or share the memory with a legacy kind"
                    ) from exc
                self._vmm_bound = True

    def vmm_range(self, ptr: int, ordinal: int) -> tuple[int, int, int] | None:
        """``(base, size, handle)`` of the VMM mapping holding ``ptr``; None where ``cuMemMap``
        mapped nothing (the caching allocator's memory, an unmapped reservation)."""
        self._vmm()
        handle = _CUmemHandle()
        base, size = _CUdeviceptr(), ctypes.c_size_t()
        with self._on(ordinal):
            rc = int(self._fns["cuMemRetainAllocationHandle"](ctypes.byref(handle), ptr))
            if rc in _NOT_VMM:
                return None
            if rc:
                raise DescriptorError(f"cuMemRetainAllocationHandle failed: {self._error_name(rc)}")
            try:
                self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
            finally:
                self._call("cuMemRelease", handle)
        return int(base.value), int(size.value), int(handle.value)

    def vmm_export(self, ptr: int, ordinal: int) -> int:
        """A new POSIX fd of the physical allocation mapped at ``ptr``; the caller closes it."""
        self._vmm()
        handle, fd = _CUmemHandle(), ctypes.c_int(-1)
        with self._on(ordinal):
            self._call("cuMemRetainAllocationHandle", ctypes.byref(handle), ptr)
            try:
                prop = CUmemAllocationProp()
                self._call("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop), handle)
                if not prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
                    raise VmmNotExportableError(
                        f"the CUDA virtual memory at {ptr:#x} was created without a POSIX file-descriptor "
                        f"handle type (requested handle types {prop.requestedHandleTypes:#x}), so no other "
                        f"process can import it; {EXPORT_HINT}"
                    )
                self._call(
                    "cuMemExportToShareableHandle",
                    ctypes.byref(fd),
                    handle,
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                    hint=EXPORT_HINT,
                )
            finally:
                self._call("cuMemRelease", handle)
        return int(fd.value)

    def vmm_granularity(self, ordinal: int) -> int:
        """Check that device ``ordinal`` maps imported POSIX-fd memory; its minimum granularity."""
        self._vmm()
        dev, value, granularity = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
        with self._on(ordinal):
            self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
            for attribute, what in (
                (_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
                (
                    _CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                    "POSIX file-descriptor handles",
                ),
            ):
                self._call("cuDeviceGetAttribute", ctypes.byref(value), attribute, dev.value)
                if not value.value:
                    raise VmmUnsupportedError(
                        f"CUDA device {ordinal} does not support {what}, so it cannot import the engine's "
                        "virtual memory; run the server where it can, or share the KV cache with a legacy "
                        "kind (LMCACHE_PLATFORM_CUDA_IPC=torch or raw in the engine, with vLLM's extensible "
                        "KV cache off)"
                    )
            prop = device_allocation_prop(ordinal, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            self._call(
                "cuMemGetAllocationGranularity",
                ctypes.byref(granularity),
                ctypes.byref(prop),
                _CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        return int(granularity.value)

    def vmm_import(
        self, fds: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], ordinal: int
    ) -> int:
        """Map the allocations ``fds`` name at ``offsets`` of one new address range; its base.

        All or nothing: a failure unmaps and frees what this call made. Each imported
        handle is released once mapped (the mapping keeps the allocation); the fds stay
        open, they are the caller's.
        """
        self._vmm()
        span = offsets[-1] + sizes[-1]
        ptr = _CUdeviceptr()
        mapped: list[tuple[int, int]] = []
        with self._on(ordinal):
            self._call("cuMemAddressReserve", ctypes.byref(ptr), span, 0, 0, 0)
            base = int(ptr.value)
            try:
                for fd, offset, size in zip(fds, offsets, sizes, strict=True):
                    handle = _CUmemHandle()
                    self._call(
                        "cuMemImportFromShareableHandle",
                        ctypes.byref(handle),
                        fd,
                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        hint="the fd must be one the engine exported with cuMemExportToShareableHandle",
                    )
                    try:
                        self._call("cuMemMap", base + offset, size, 0, handle, 0)
                    except DescriptorError:
                        self._undo("cuMemRelease", handle)
                        raise
                    mapped.append((offset, size))
                    self._call("cuMemRelease", handle)
                access = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal))
                access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                self._call("cuMemSetAccess", base, span, ctypes.byref(access), 1)
            except BaseException:
                for offset, size in reversed(mapped):
                    self._undo("cuMemUnmap", base + offset, size)
                self._undo("cuMemAddressFree", base, span)
                raise
        return base

    def vmm_unmap(self, ptr: int, offsets: Sequence[int], sizes: Sequence[int], ordinal: int) -> None:
        """Undo :meth:`vmm_import`, after the device finished what it queued on the range.

        Every segment is unmapped even when one fails (each failure logged), and the range
        is freed only when all were, so what can be given back is; then the first failure
        is raised. A failed synchronization (a sticky error) still unmaps, then raises.
        """
        failures: list[str] = []
        with self._on(ordinal):
            rc = int(self._fns["cuCtxSynchronize"]())
            if rc:
                failures.append(f"cuCtxSynchronize failed: {self._error_name(rc)}")
            unmapped = True
            for offset, size in zip(offsets, sizes, strict=True):
                rc = int(self._fns["cuMemUnmap"](ptr + offset, size))
                if rc:
                    unmapped = False
                    failures.append(
                        f"cuMemUnmap of {size} bytes at {ptr + offset:#x} failed: {self._error_name(rc)}"
                    )
            if unmapped:
                rc = int(self._fns["cuMemAddressFree"](ptr, offsets[-1] + sizes[-1]))
                if rc:
                    failures.append(f"cuMemAddressFree failed: {self._error_name(rc)}")
        for failure in failures[1:]:
            log.warning("unmapping CUDA virtual memory at %#x: %s", ptr, failure)
        if failures:
            extra = f" (and {len(failures) - 1} more, logged)" if len(failures) > 1 else ""
            raise DescriptorError(failures[0] + extra)

    def as_tensor(self, owner: object, ptr: int, nbytes: int, ordinal: int) -> torch.Tensor:
        """A 1-D uint8 tensor aliasing ``nbytes`` at ``ptr``; it keeps ``owner`` alive.

        Both kinds that map memory themselves (raw, VMM) build their tensors here.
        """
        import importlib.util

        import torch

        if importlib.util.find_spec("numpy") is None:  # torch parses the interface with numpy
            raise DescriptorError(
                "raw and VMM CUDA IPC need numpy installed to build tensors on mapped memory"
            )

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

"""Fakes for the CUDA runtime, for the tests that run without a GPU.

Each stands in for one thing only the hardware can answer; everything they feed
(the UUID table, the mapping table, view replay) is the real code.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from lmcache_platform import DescriptorError, NullStream
from lmcache_platform.hostmem._remap import _libc as hostmem_libc
from lmcache_platform_cuda import GPUCacheContext, _devices, _driver, _raw_ipc

#: Device UUIDs as torch prints them (``str(get_device_properties(i).uuid)``).
UUIDS = [
    "6f1d6c3e-2a5b-4c1e-9d3f-0a1b2c3d4e5f",
    "0b9e8d7c-6b5a-4f3e-8d2c-1b0a9f8e7d6c",
    "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f",
]


class FakeDevices:
    """Stands in for CUDA device enumeration (no GPU here)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.uuids: list[str] = []
        self.calls = 0
        self._lock = threading.Lock()
        monkeypatch.setattr(_devices, "_enumerate", self._enumerate)
        _devices.DEVICES.reset()

    def _enumerate(self) -> list[str]:
        with self._lock:
            self.calls += 1
        return list(self.uuids)

    def set(self, uuids: list[str]) -> None:
        """Pretend this process sees ``uuids``, in this ordinal order."""
        self.uuids = list(uuids)
        _devices.DEVICES.reset()


_HANDLES = itertools.count()


class _HostBuffer:
    """``__array_interface__`` twin of the driver's ``__cuda_array_interface__`` object."""

    def __init__(self, owner: object, ptr: int, nbytes: int) -> None:
        self.owner = owner
        self.__array_interface__ = _driver.byte_interface(ptr, nbytes, version=3)


class FakeRuntime:
    """Stands in for the CUDA driver in raw IPC (no GPU here).

    "Device memory" is host memory; a handle names one allocation; ``open`` returns
    the allocation itself, as a second process's mapping of the same pages would.
    ``as_tensor`` builds the tensor the same way the real driver does (an array
    interface object that the tensor keeps alive), so lifetimes behave alike.
    """

    def __init__(self) -> None:
        self.allocations: dict[bytes, Any] = {}
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.mapped: dict[int, bytes] = {}

    def alloc(self, nbytes: int) -> tuple[bytes, Any]:
        # Unique across fakes: the mapping table is process-wide and outlives a test.
        handle = (b"H%08d" % next(_HANDLES)).ljust(_raw_ipc.IPC_HANDLE_SIZE, b"\0")
        buf = (ctypes.c_uint8 * nbytes)()
        self.allocations[handle] = buf
        return handle, buf

    def view(self, handle: bytes) -> np.ndarray[Any, Any]:
        return np.ctypeslib.as_array(self.allocations[handle])

    def export(self, ptr: int, ordinal: int) -> tuple[bytes, int, int]:
        for handle, buf in self.allocations.items():
            base = ctypes.addressof(buf)
            if base <= ptr < base + ctypes.sizeof(buf):
                return handle, base, ctypes.sizeof(buf)
        raise DescriptorError(f"fake: {ptr:#x} is not an allocation")

    def open(self, handle: bytes, ordinal: int) -> tuple[int, int]:
        buf = self.allocations.get(handle)
        if buf is None:
            raise DescriptorError("fake cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE")
        ptr = ctypes.addressof(buf)
        assert ptr not in self.mapped, "the table must open an allocation once per process"
        self.opened.append(handle)
        self.mapped[ptr] = handle
        return ptr, ctypes.sizeof(buf)

    def close(self, ptr: int, ordinal: int) -> None:
        del self.mapped[ptr]
        self.closed.append(ptr)

    def as_tensor(self, owner: object, ptr: int, nbytes: int, ordinal: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(_HostBuffer(owner, ptr, nbytes)))


# -- CUDA virtual memory (VMM) -----------------------------------------------------------

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
GRANULE = 2 << 20
_PROT_NONE, _PROT_RW = 0, 1 | 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_libc = hostmem_libc()  # mmap and munmap typed by core's host-memory kit
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap(addr: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    got = _libc.mmap(addr or None, size, prot, flags, fd, 0)
    if got == _MAP_FAILED:
        raise OSError(ctypes.get_errno(), f"mmap({addr:#x}, {size}) failed")
    return int(got)


def _value(arg: Any) -> int:
    """A by-value argument as an int, however ctypes or the caller passed it."""
    return int(getattr(arg, "value", arg) or 0)


_VMM_HANDLES = itertools.count(0x5000)


class _Allocation:
    """One physical allocation: a memfd of its own (an import dups the fd it was given)."""

    def __init__(self, fake: FakeVmmLib, fd: int, size: int, handle_types: int, ordinal: int) -> None:
        self.fake, self.fd, self.size = fake, fd, size
        self.handle_types, self.ordinal = handle_types, ordinal
        self.handle = next(_VMM_HANDLES)  # unique across fakes, as EXPORTS is process-wide
        self.refs, self.mapped = 1, 0
        fake.allocations[self.handle] = self

    def drop(self, refs: int = 0, mapped: int = 0) -> None:
        self.refs -= refs
        self.mapped -= mapped
        if self.refs == 0 and self.mapped == 0:  # the driver frees memory with its last handle and mapping
            del self.fake.allocations[self.handle]
            os.close(self.fd)


class FakeVmmLib:
    """Stands in for ``libcuda.so.1``'s context and VMM entry points (no GPU here).

    "Device memory" is host memory, as the real driver's is GPU memory: each physical
    allocation is a memfd, so an exported handle is a real fd that a real socket can
    carry to a real second process; an address reservation is a ``PROT_NONE``
    anonymous mapping; ``cuMemMap`` maps the memfd over it with ``MAP_FIXED`` and no
    access, and ``cuMemSetAccess`` grants read-write (``mprotect``), so touching memory
    the code forgot to map or grant crashes the test as it would fault on a GPU. The
    entry points answer as the CUDA documentation says: results through the pointers
    given, ``CUresult`` codes, handles refcounted, memory freed with its last handle
    and mapping. A real ``CudaDriver`` runs over this; what is tested is our binding
    and our wrapper.

    Leak counters: ``allocations`` (live handles' memory), ``reservations``,
    ``mappings``. ``fail(name, rc, after)`` makes one later call of an entry point
    fail; ``vmm=False`` is a driver without the VMM API.
    """

    def __init__(self, *, vmm: bool = True, granularity: int = GRANULE) -> None:
        self.vmm = vmm
        self.granularity = granularity
        self.vmm_supported = 1
        self.posix_fd_supported = 1
        self.stack: list[int] = []
        self.calls: list[str] = []
        self.allocations: dict[int, _Allocation] = {}
        self.reservations: dict[int, int] = {}  # base -> size
        self.mappings: dict[int, tuple[int, _Allocation]] = {}  # ptr -> (size, allocation)
        self.legacy: dict[int, Any] = {}  # allocator memory: ptr -> host buffer
        self._failures: dict[str, list[int]] = {}  # name -> [successes left, rc]

    # -- test controls ---------------------------------------------------------------

    def fail(self, name: str, rc: int = CUDA_ERROR_OUT_OF_MEMORY, after: int = 0) -> None:
        """Make the call of ``name`` after ``after`` more successful ones return ``rc``, once."""
        self._failures[name] = [after, rc]

    def create(self, size: int, handle_types: int = 1, ordinal: int = 0) -> int:
        """``cuMemCreate``: a physical allocation (the engine's side, as vLLM makes it)."""
        assert size % self.granularity == 0
        fd = os.memfd_create("fake-vmm", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return _Allocation(self, fd, size, handle_types, ordinal).handle

    def extensible(self, chunks: list[int], *, handle_types: int = 1, reserve: int = 0) -> int:
        """vLLM's extensible KV cache: reserve (at least ``reserve`` bytes), map physical
        chunks of these sizes side by side from the start, grant access; the base.

        The handles are released once mapped; the mappings keep the memory.
        """
        total = sum(chunks)
        base = self.reserve(max(total, reserve))
        offset = 0
        for size in chunks:
            handle = self.create(size, handle_types)
            self.map(base + offset, size, handle)
            self.release(handle)
            offset += size
        self.set_access(base, total)
        return base

    def reserve(self, size: int) -> int:
        out = ctypes.c_uint64()
        assert self._cuMemAddressReserve(ctypes.byref(out), size, 0, 0, 0) == 0
        return int(out.value)

    def map(self, ptr: int, size: int, handle: int) -> None:
        assert self._cuMemMap(ptr, size, 0, handle, 0) == 0

    def set_access(self, ptr: int, size: int, ordinal: int = 0) -> None:
        for mptr, (msize, _) in self.mappings.items():
            if ptr <= mptr and mptr + msize <= ptr + size:
                assert _libc.mprotect(mptr, msize, _PROT_RW) == 0

    def release(self, handle: int) -> None:
        assert self._cuMemRelease(handle) == 0

    def allocator_memory(self, nbytes: int) -> int:
        """Memory of the caching allocator (cudaMalloc): legacy IPC, no VMM mapping."""
        buf = (ctypes.c_uint8 * nbytes)()
        self.legacy[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def host_tensor(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over "device" bytes, standing in for the engine's CUDA tensor."""
        return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)))

    def free_all(self) -> None:
        """Tear down what tests made (after their wrappers and tensors are gone)."""
        for ptr, (size, alloc) in list(self.mappings.items()):
            _mmap(ptr, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE)
            del self.mappings[ptr]
            alloc.drop(mapped=1)
        for base, size in list(self.reservations.items()):
            _libc.munmap(base, size)
            del self.reservations[base]
        for alloc in list(self.allocations.values()):
            alloc.drop(refs=alloc.refs)

    # -- ctypes-facing entry points --------------------------------------------------

    _CONTEXT_FREE = ("cuInit", "cuGetErrorName", "cuDeviceGet", "cuDevicePrimaryCtxRetain")

    def __getattr__(self, name: str) -> Callable[..., int]:
        impl = getattr(type(self), "_" + name, None)
        if impl is None or (not self.vmm and name in _driver._VMM_SIGNATURES):
            raise AttributeError(f"fake libcuda.so.1: undefined symbol: {name}")
        bound = impl.__get__(self)

        def call(*args: Any) -> int:
            if name not in self._CONTEXT_FREE and not name.startswith("cuCtx"):
                assert self.stack, f"{name} called with no context current"
            self.calls.append(name)
            failure = self._failures.get(name)
            if failure is not None:
                if failure[0] == 0:
                    del self._failures[name]
                    return failure[1]
                failure[0] -= 1
            return int(bound(*args))

        return call

    @staticmethod
    def _out(arg: Any) -> Any:
        return arg._obj  # the object behind ctypes.byref()

    @property
    def _device(self) -> int:
        return self.stack[-1] - 0x1000 - 100

    def _cuInit(self, flags: int) -> int:
        return 0

    def _cuGetErrorName(self, rc: int, out: Any) -> int:
        names = {
            1: b"CUDA_ERROR_INVALID_VALUE",
            2: b"CUDA_ERROR_OUT_OF_MEMORY",
            700: b"CUDA_ERROR_ILLEGAL_ADDRESS",
            801: b"CUDA_ERROR_NOT_SUPPORTED",
        }
        self._out(out).value = names.get(rc, b"CUDA_ERROR_UNKNOWN")
        return 0

    def _cuDeviceGet(self, out: Any, ordinal: int) -> int:
        self._out(out).value = 100 + ordinal
        return 0

    def _cuDevicePrimaryCtxRetain(self, out: Any, dev: int) -> int:
        self._out(out).value = 0x1000 + dev
        return 0

    def _cuCtxPushCurrent_v2(self, ctx: Any) -> int:
        self.stack.append(_value(ctx))
        return 0

    def _cuCtxPopCurrent_v2(self, out: Any) -> int:
        self._out(out).value = self.stack.pop()
        return 0

    def _cuCtxSynchronize(self) -> int:
        return 0

    def _cuDeviceGetAttribute(self, out: Any, attribute: int, dev: int) -> int:
        answers = {102: self.vmm_supported, 103: self.posix_fd_supported}
        if attribute not in answers:
            return CUDA_ERROR_INVALID_VALUE
        self._out(out).value = answers[attribute]
        return 0

    def _mapping_at(self, ptr: int) -> tuple[int, int, _Allocation] | None:
        for mptr, (size, alloc) in self.mappings.items():
            if mptr <= ptr < mptr + size:
                return mptr, size, alloc
        return None

    def _cuMemGetAddressRange_v2(self, base: Any, size: Any, ptr: Any) -> int:
        ptr = _value(ptr)
        found = self._mapping_at(ptr)
        if found is not None:  # VMM: the extent of the one mapping holding ptr
            self._out(base).value, self._out(size).value = found[0], found[1]
            return 0
        for start, buf in self.legacy.items():
            if start <= ptr < start + ctypes.sizeof(buf):
                self._out(base).value, self._out(size).value = start, ctypes.sizeof(buf)
                return 0
        return CUDA_ERROR_INVALID_VALUE

    def _cuPointerGetAttribute(self, out: Any, attribute: int, ptr: Any) -> int:
        assert attribute == 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
        self._out(out).value = int(self._mapping_at(_value(ptr)) is None)
        return 0

    def _cuMemRetainAllocationHandle(self, out: Any, addr: Any) -> int:
        found = self._mapping_at(_value(addr))
        if found is None:
            return CUDA_ERROR_INVALID_VALUE
        alloc = found[2]
        alloc.refs += 1
        self._out(out).value = alloc.handle  # the handle value used to map it
        return 0

    def _cuMemRelease(self, handle: Any) -> int:
        alloc = self.allocations.get(_value(handle))
        if alloc is None or alloc.refs == 0:
            return CUDA_ERROR_INVALID_VALUE
        alloc.drop(refs=1)
        return 0

    def _cuMemGetAllocationPropertiesFromHandle(self, prop: Any, handle: Any) -> int:
        alloc = self.allocations.get(_value(handle))
        if alloc is None:
            return CUDA_ERROR_INVALID_VALUE
        out = self._out(prop)
        out.type, out.requestedHandleTypes = 1, alloc.handle_types
        out.location.type, out.location.id = 1, alloc.ordinal
        return 0

    def _cuMemExportToShareableHandle(self, out: Any, handle: Any, handle_type: int, flags: int) -> int:
        alloc = self.allocations.get(_value(handle))
        if alloc is None or handle_type != 1 or flags != 0 or not alloc.handle_types & 1:
            return CUDA_ERROR_INVALID_VALUE
        fd = os.dup(alloc.fd)
        os.set_inheritable(fd, True)  # as the driver makes it: a C library's fd, no O_CLOEXEC
        self._out(out).value = fd
        return 0

    def _cuMemImportFromShareableHandle(self, out: Any, os_handle: Any, handle_type: int) -> int:
        fd = _value(os_handle)  # POSIX fds travel as the fd value cast to a pointer
        if handle_type != 1:
            return CUDA_ERROR_INVALID_VALUE
        try:
            size = os.fstat(fd).st_size
        except OSError:
            return CUDA_ERROR_INVALID_VALUE
        if size <= 0 or size % self.granularity:
            return CUDA_ERROR_INVALID_VALUE
        self._out(out).value = _Allocation(self, os.dup(fd), size, 1, self._device).handle
        return 0

    def _cuMemGetAllocationGranularity(self, out: Any, prop: Any, option: int) -> int:
        p = self._out(prop)
        assert (p.type, p.location.type, option) == (1, 1, 0)
        self._out(out).value = self.granularity
        return 0

    def _cuMemAddressReserve(self, out: Any, size: int, alignment: int, addr: Any, flags: int) -> int:
        if size <= 0 or size % self.granularity or _value(addr) or flags:
            return CUDA_ERROR_INVALID_VALUE
        raw = _mmap(0, size + self.granularity, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        base = -(-raw // self.granularity) * self.granularity  # aligned, as the driver's are
        if base > raw:
            _libc.munmap(raw, base - raw)
        _libc.munmap(base + size, raw + size + self.granularity - base - size)
        self.reservations[base] = size
        self._out(out).value = base
        return 0

    def _cuMemAddressFree(self, ptr: Any, size: int) -> int:
        ptr = _value(ptr)
        if self.reservations.get(ptr) != size or any(ptr <= m < ptr + size for m in self.mappings):
            return CUDA_ERROR_INVALID_VALUE
        del self.reservations[ptr]
        _libc.munmap(ptr, size)
        return 0

    def _cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> int:
        ptr = _value(ptr)
        alloc = self.allocations.get(_value(handle))
        inside = any(b <= ptr and ptr + size <= b + s for b, s in self.reservations.items())
        overlaps = any(m < ptr + size and ptr < m + s for m, (s, _) in self.mappings.items())
        if alloc is None or not inside or overlaps or offset or flags or size > alloc.size:
            return CUDA_ERROR_INVALID_VALUE
        if size % self.granularity or ptr % self.granularity:
            return CUDA_ERROR_INVALID_VALUE
        _mmap(ptr, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, alloc.fd)
        self.mappings[ptr] = (size, alloc)
        alloc.mapped += 1
        return 0

    def _cuMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int) -> int:
        ptr, access = _value(ptr), self._out(desc)
        if count != 1 or access.flags != 3 or (access.location.type, access.location.id) != (1, self._device):
            return CUDA_ERROR_INVALID_VALUE
        covered = sorted((m, s) for m, (s, _) in self.mappings.items() if ptr <= m < ptr + size)
        edge = ptr
        for m, s in covered:
            if m != edge:
                return CUDA_ERROR_INVALID_VALUE  # a hole: the driver refuses unmapped ranges
            edge = m + s
        if edge != ptr + size:
            return CUDA_ERROR_INVALID_VALUE
        assert _libc.mprotect(ptr, size, _PROT_RW) == 0
        return 0

    def _cuMemUnmap(self, ptr: Any, size: int) -> int:
        ptr = _value(ptr)
        found = self.mappings.get(ptr)
        if found is None or found[0] != size:
            return CUDA_ERROR_INVALID_VALUE
        _mmap(ptr, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE)
        del self.mappings[ptr]
        found[1].drop(mapped=1)
        return 0

    # the legacy-IPC entry points the binding binds at start; the VMM kind never calls them
    def _cuIpcGetMemHandle(self, out: Any, base: Any) -> int:
        return CUDA_ERROR_INVALID_VALUE

    def _cuIpcOpenMemHandle_v2(self, out: Any, handle: Any, flags: int) -> int:
        return CUDA_ERROR_INVALID_VALUE

    def _cuIpcCloseMemHandle(self, ptr: Any) -> int:
        return CUDA_ERROR_INVALID_VALUE


class HostCudaDriver(_driver.CudaDriver):
    """The real binding over :class:`FakeVmmLib`; tensors over "device" memory are host
    tensors (built like the real ones: an array-interface object the tensor keeps alive)."""

    def as_tensor(self, owner: object, ptr: int, nbytes: int, ordinal: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(_HostBuffer(owner, ptr, nbytes)))


def open_fds() -> int:
    """How many fds this process has open (``/proc/self/fd``)."""
    return len(os.listdir("/proc/self/fd"))


class InterpretedContext(GPUCacheContext):
    """``GPUCacheContext``'s transfers on CPU tensors: the kernels run in Triton's interpreter
    (``TRITON_INTERPRET=1``), with no stream to order them."""

    device_type: ClassVar[str] = "cpu"

    def create_stream(self) -> Any:
        return NullStream()

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        yield

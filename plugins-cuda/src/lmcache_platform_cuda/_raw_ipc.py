"""``RawCudaIPCWrapper``: a driver IPC handle of the allocation base plus a byte offset.

For processes that do not share PyTorch's IPC machinery (separate containers with
no common ``/dev/shm`` for torch's ref-counter files) and for memory that did not
come from torch's caching allocator (a pool wrapped with ``from_blob``). The handle
is resolved by the driver, not through files both sides must see.

The driver maps an allocation once per process, and one unmap tears it down for
all its users, so imports go through a process-wide :class:`OpenTable` keyed by the
handle bytes. A mapping is unmapped (``cuIpcCloseMemHandle``, which also returns the
memory of an exporter that has died) when the last wrapper holding it is closed
*and* the last tensor built on it is gone.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from lmcache_platform import DescriptorError, DeviceIPCWrapper, WireField

from ._devices import DEVICES
from ._open_table import OpenTable
from ._view import MAX_BYTES, check_view_fits, empty_view, require_cuda, view_over

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

log = logging.getLogger(__name__)

IPC_HANDLE_SIZE = 64


class IpcRuntime(Protocol):
    """What raw IPC needs from CUDA; :class:`._driver.CudaDriver` in production."""

    def export(self, ptr: int, ordinal: int) -> tuple[bytes, int, int]: ...
    def open(self, handle: bytes, ordinal: int) -> tuple[int, int]: ...
    def close(self, ptr: int, ordinal: int) -> None: ...
    def as_tensor(self, owner: object, ptr: int, nbytes: int, ordinal: int) -> torch.Tensor: ...


def get_runtime() -> IpcRuntime:
    """The runtime raw IPC uses (tests substitute a fake here)."""
    from ._driver import driver

    return driver()


class _Mapping:
    """One imported allocation in this process; unmapped when garbage-collected."""

    def __init__(self, runtime: IpcRuntime, handle: bytes, ordinal: int) -> None:
        self.runtime = runtime
        self.ordinal = ordinal
        self.ptr, self.size = runtime.open(handle, ordinal)
        fin = weakref.finalize(self, _unmap, runtime, self.ptr, ordinal)
        fin.atexit = False  # the driver reclaims everything at exit; no teardown-order races


def _unmap(runtime: IpcRuntime, ptr: int, ordinal: int) -> None:
    try:
        runtime.close(ptr, ordinal)
    except Exception:  # runs from a finaliser: nowhere to raise to
        log.warning("cuIpcCloseMemHandle(%#x) on device %d failed", ptr, ordinal, exc_info=True)


#: Every raw import of this process, by handle bytes.
MAPPINGS: OpenTable[_Mapping] = OpenTable()


class RawCudaIPCWrapper(DeviceIPCWrapper):
    """A CUDA tensor shared through ``cuIpcGetMemHandle`` of its allocation base.

    ``alloc_offset`` is where the tensor's storage starts inside the allocation and
    ``storage_nbytes`` its size; the base fields replay the view on that storage.
    The receiver checks both against the size of the allocation it actually mapped.
    """

    device_type: ClassVar[str] = "cuda"
    wire_tag: ClassVar[str] = "cuda.raw/1"
    wire_fields = {
        "ipc_handle": WireField(bytes, max_len=IPC_HANDLE_SIZE),
        "alloc_offset": WireField(int, lo=0, hi=MAX_BYTES),
        "storage_nbytes": WireField(int, lo=0, hi=MAX_BYTES),
    }

    def __init__(
        self,
        *,
        ipc_handle: bytes,
        alloc_offset: int,
        storage_nbytes: int,
        **base: Any,
    ) -> None:
        super().__init__(**base)  # dtype, shape, stride, storage_offset, device_uuid
        name = type(self).__name__
        if storage_nbytes and len(ipc_handle) != IPC_HANDLE_SIZE:
            raise DescriptorError(
                f"{name}.ipc_handle: {len(ipc_handle)} bytes, a CUDA IPC handle has {IPC_HANDLE_SIZE}"
            )
        if not storage_nbytes and (ipc_handle or alloc_offset):
            raise DescriptorError(f"{name}: an empty storage carries no handle or offset")
        check_view_fits(self, storage_nbytes)
        self.ipc_handle = ipc_handle
        self.alloc_offset = alloc_offset
        self.storage_nbytes = storage_nbytes
        self._open_lock = threading.Lock()
        self._mapping: _Mapping | None = None

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        ordinal = require_cuda(cls, tensor)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        handle, offset = b"", 0
        if nbytes:
            ptr = storage.data_ptr()
            handle, base, size = get_runtime().export(ptr, ordinal)
            offset = ptr - base
            if offset < 0 or offset + nbytes > size:
                raise DescriptorError(
                    f"storage [{ptr:#x}, +{nbytes}) lies outside its allocation [{base:#x}, +{size})"
                )
        return cls.describe(
            tensor,
            device_uuid=DEVICES.uuid_of(ordinal),
            ipc_handle=handle,
            alloc_offset=offset,
            storage_nbytes=nbytes,
        )

    def to_tensor(self) -> torch.Tensor:
        ordinal = DEVICES.ordinal_of(self.device_uuid)
        if not self.storage_nbytes:
            return empty_view(self, ordinal)
        mapping = self._acquire(ordinal)
        flat = mapping.runtime.as_tensor(
            mapping, mapping.ptr + self.alloc_offset, self.storage_nbytes, ordinal
        )
        return view_over(self, flat)

    def _acquire(self, ordinal: int) -> _Mapping:
        """This wrapper's one reference to the process-wide mapping of its handle."""
        with self._open_lock:
            if self.closed:
                raise DescriptorError(f"{type(self).__name__} is closed; decode the descriptor again")
            if self._mapping is not None:
                return self._mapping
            runtime = get_runtime()
            mapping = MAPPINGS.acquire(self.ipc_handle, lambda: _Mapping(runtime, self.ipc_handle, ordinal))
            try:
                if mapping.ordinal != ordinal:
                    raise DescriptorError(
                        f"IPC handle is already mapped on device {mapping.ordinal}, "
                        f"but this descriptor names device {self.device_uuid} (ordinal {ordinal})"
                    )
                end = self.alloc_offset + self.storage_nbytes
                if end > mapping.size:
                    raise DescriptorError(
                        f"{type(self).__name__}: bytes [{self.alloc_offset}, {end}) exceed the "
                        f"{mapping.size}-byte allocation the handle maps"
                    )
            except DescriptorError:
                MAPPINGS.release(self.ipc_handle)
                raise
            self._mapping = mapping
            return mapping

    def release(self) -> None:
        with self._open_lock:
            mapping, self._mapping = self._mapping, None
        if mapping is not None:
            MAPPINGS.release(self.ipc_handle)

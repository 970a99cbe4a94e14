"""``CudaIPCWrapper``: PyTorch storage IPC, the handle torch's own multiprocessing uses.

``UntypedStorage._share_cuda_()`` returns eight values: the producer's device, the
caching allocator's handle of the block, the storage's size and offset in that
block, torch's cross-process ref counter (a ``/dev/shm`` file and a slot in it), and
an IPC event the consumer waits on. The descriptor carries all but the device as
primitives, plus the device UUID, which the receiver maps to its own ordinal.

Validation goes beyond types because ``_new_shared_cuda`` trusts its input: the
ref-counter slot is decremented in place when the storage dies, so an unchecked
offset would write outside torch's counter file. Slot and file name are checked
against torch's own format, and the view against the storage before anything is
opened; after opening, the storage is checked against the mapping the driver made.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any, ClassVar

from lmcache_platform import DescriptorError, DeviceIPCWrapper, WireField

from ._devices import DEVICES
from ._errors import VMM_HINT, VmmMemoryError
from ._open_table import OpenTable
from ._view import MAX_BYTES, check_view_fits, empty_view, require_cuda

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

#: Slots in one torch ref-counter file (``CUDA_IPC_REF_COUNTER_FILE_SIZE``).
REF_COUNTER_SLOTS = 10_000
#: Names torch gives its ref-counter files (``at::NewProcessWideShmHandle``).
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
EVENT_HANDLE_SIZE = 64
#: The allocator's handle: a legacy 64-byte ``cudaIpcMemHandle``, a 1-byte type tag
#: plus that, or (expandable segments) a tag plus a serialised segment list.
_MIN_HANDLE, _MAX_HANDLE = 64, 1 << 16

_ShareKey = tuple[bytes, int, bytes, int]
#: Storages opened in this process, by share (one share = one ``_share_cuda_`` call).
SHARES: OpenTable[torch.UntypedStorage] = OpenTable()
#: torch's ref-counter files named by this process's own wraps (torch makes them per
#: process). A descriptor naming one was exported here: CUDA IPC cannot open a handle in
#: the process that made it, so ``to_tensor`` refuses it before calling the driver.
EXPORTED_COUNTERS: set[bytes] = set()


def share_cuda(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """torch's share of a CUDA storage (``_share_cuda_``; tests without a GPU replace it)."""
    return storage._share_cuda_()  # type: ignore[no-untyped-call, no-any-return]


def _is_vmm(tensor: torch.Tensor) -> bool:
    """Whether a storage torch refused lies in CUDA virtual memory (then say what shares it)."""
    from ._vmm_ipc import is_vmm_memory

    try:
        return is_vmm_memory(tensor)
    except DescriptorError:  # no answer: the plain refusal stands
        return False


class CudaIPCWrapper(DeviceIPCWrapper):
    """A CUDA tensor shared through PyTorch's storage IPC (the default kind).

    Each :meth:`wrap` is one share with one slot in torch's ref counter, which the
    consumer's storage decrements when it dies: open a descriptor in one consumer
    process (wrap again to hand the tensor to another). Both sides must share
    ``/dev/shm``, where torch keeps the counters; see ``RawCudaIPCWrapper`` otherwise.
    """

    device_type: ClassVar[str] = "cuda"
    wire_tag: ClassVar[str] = "cuda.torch/1"
    wire_fields = {
        "handle": WireField(bytes, max_len=_MAX_HANDLE),
        "storage_nbytes": WireField(int, lo=0, hi=MAX_BYTES),
        "storage_offset_bytes": WireField(int, lo=0, hi=MAX_BYTES),
        "ref_counter_handle": WireField(bytes, max_len=64),
        "ref_counter_offset": WireField(int, lo=0, hi=REF_COUNTER_SLOTS - 1),
        "event_handle": WireField(bytes, max_len=EVENT_HANDLE_SIZE),
        "event_sync_required": WireField(int, lo=0, hi=1),
    }

    def __init__(
        self,
        *,
        handle: bytes,
        storage_nbytes: int,
        storage_offset_bytes: int,
        ref_counter_handle: bytes,
        ref_counter_offset: int,
        event_handle: bytes,
        event_sync_required: int,
        **base: Any,
    ) -> None:
        super().__init__(**base)  # dtype, shape, stride, storage_offset, device_uuid
        name = type(self).__name__
        if storage_nbytes:
            if not _MIN_HANDLE <= len(handle) <= _MAX_HANDLE:
                raise DescriptorError(f"{name}.handle: {len(handle)} bytes is not a CUDA IPC handle")
            if _REF_COUNTER_NAME.fullmatch(ref_counter_handle) is None:
                raise DescriptorError(
                    f"{name}.ref_counter_handle: {ref_counter_handle!r} is not a torch ref-counter name"
                )
            if len(event_handle) != EVENT_HANDLE_SIZE:
                raise DescriptorError(
                    f"{name}.event_handle: {len(event_handle)} bytes, expected {EVENT_HANDLE_SIZE}"
                )
        elif handle or ref_counter_handle or event_handle or storage_offset_bytes:
            raise DescriptorError(f"{name}: an empty storage carries no handles or offsets")
        check_view_fits(self, storage_nbytes)
        self.handle = handle
        self.storage_nbytes = storage_nbytes
        self.storage_offset_bytes = storage_offset_bytes
        self.ref_counter_handle = ref_counter_handle
        self.ref_counter_offset = ref_counter_offset
        self.event_handle = event_handle
        self.event_sync_required = event_sync_required
        self._open_lock = threading.Lock()
        self._share: _ShareKey | None = None
        self._storage: torch.UntypedStorage | None = None

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        ordinal = require_cuda(cls, tensor)
        storage = tensor.untyped_storage()
        share: tuple[Any, ...] = (ordinal, b"", 0, 0, b"", 0, b"", False)  # empty storage
        if storage.nbytes():
            try:
                share = share_cuda(storage)
            except RuntimeError as exc:  # e.g. a tensor that was itself received over IPC
                if _is_vmm(tensor):
                    raise VmmMemoryError(f"torch cannot share this CUDA storage ({exc}): {VMM_HINT}") from exc
                raise DescriptorError(f"torch cannot share this CUDA storage: {exc}") from exc
        _, handle, size, offset, counter, counter_offset, event, sync = share
        if counter:
            EXPORTED_COUNTERS.add(bytes(counter))
        return cls.describe(
            tensor,
            device_uuid=DEVICES.uuid_of(ordinal),
            handle=handle,
            storage_nbytes=size,
            storage_offset_bytes=offset,
            ref_counter_handle=counter,
            ref_counter_offset=counter_offset,
            event_handle=event,
            event_sync_required=int(sync),
        )

    def to_tensor(self) -> torch.Tensor:
        import torch

        ordinal = DEVICES.ordinal_of(self.device_uuid)
        if not self.storage_nbytes:
            return empty_view(self, ordinal)
        storage = self._acquire(ordinal)
        out = torch.empty(0, dtype=self.dtype, device=torch.device("cuda", ordinal))
        return out.set_(storage, self.storage_offset, self.shape, self.stride)

    def _acquire(self, ordinal: int) -> torch.UntypedStorage:
        with self._open_lock:
            if self.closed:
                raise DescriptorError(f"{type(self).__name__} is closed; decode the descriptor again")
            if self._storage is not None:
                return self._storage
            if self.ref_counter_handle in EXPORTED_COUNTERS:
                raise DescriptorError(
                    f"{type(self).__name__}: this process exported this share (torch ref counter "
                    f"{self.ref_counter_handle.decode(errors='replace')}), and CUDA IPC cannot open a "
                    "handle in the process that made it; use the tensor itself here, or decode the "
                    "descriptor in another process (the KV-cache server's)"
                )
            share: _ShareKey = (
                self.handle,
                self.storage_offset_bytes,
                self.ref_counter_handle,
                self.ref_counter_offset,
            )
            storage = SHARES.acquire(share, lambda: self._open(ordinal))
            if storage.device.index != ordinal:
                SHARES.release(share)
                raise DescriptorError(
                    f"this share is already open on cuda:{storage.device.index}, "
                    f"but the descriptor names {self.device_uuid} (cuda:{ordinal})"
                )
            self._share, self._storage = share, storage
            return storage

    def _open(self, ordinal: int) -> torch.UntypedStorage:
        import torch

        from ._driver import driver

        torch.cuda.init()  # type: ignore[no-untyped-call]
        with torch.cuda.device(ordinal):
            storage = torch.UntypedStorage._new_shared_cuda(
                ordinal,
                self.handle,
                self.storage_nbytes,
                self.storage_offset_bytes,
                self.ref_counter_handle,
                self.ref_counter_offset,
                self.event_handle,
                bool(self.event_sync_required),
            )
        start = storage.data_ptr()
        base, size = driver().address_range(start, ordinal)
        if start + self.storage_nbytes > base + size:
            raise DescriptorError(
                f"{type(self).__name__}: storage of {self.storage_nbytes} bytes at offset "
                f"{start - base} overruns the {size}-byte allocation the handle maps"
            )
        return storage

    def release(self) -> None:
        with self._open_lock:
            share, self._share, self._storage = self._share, None, None
        if share is not None:
            SHARES.release(share)

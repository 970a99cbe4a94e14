"""``CudaVmmIPCWrapper``: CUDA virtual memory shared through POSIX file descriptors.

vLLM 0.34 keeps its KV cache in CUDA virtual memory: physical allocations
(``cuMemCreate``) mapped side by side into one reserved address range. Legacy IPC
(``cuIpcGetMemHandle``, torch's storage sharing) cannot name such memory. Each
physical allocation created with the POSIX-fd handle type can be exported as a file
descriptor (``cuMemExportToShareableHandle``), which travels to the server beside the
message (``SCM_RIGHTS``); the server imports each one and maps them side by side into
a range of its own, at the same offsets.

Engine side, :meth:`CudaVmmIPCWrapper.wrap` walks the allocations from the view's
first byte: back to the start of its storage and on to the end of it, as far as
mapped allocations follow each other without a gap (a hole inside the view is an
error). That span is the export: one segment per allocation (offset in the span,
size, fd). Each allocation is exported once per process (``EXPORTS``, refcounted by
the wrappers naming it), so the per-layer views of one storage carry the same fds,
have equal export fields, and travel as one wire record.

Server side, the wrappers decoded from one record share one import (:meth:`from_views`),
so they stay views of one storage there too. Everything a descriptor says is checked
before any driver call; the import is all or nothing; the mapping lives until the
last wrapper is closed and the last tensor built on it is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from lmcache_platform import DescriptorError, DeviceIPCWrapper, WireField

from ._devices import DEVICES
from ._errors import NotVmmMemoryError, VmmUnsupportedError
from ._open_table import OpenTable
from ._view import MAX_BYTES, check_view_fits, empty_view, require_cuda, view_over

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

log = logging.getLogger(__name__)

#: Smallest VMM granularity of current NVIDIA GPUs: every segment is a multiple of it.
MIN_GRANULARITY = 2 << 20
#: Most physical allocations one export may have (one fd each).
MAX_SEGMENTS = 1024


class VmmRuntime(Protocol):
    """What the VMM kind needs from CUDA; :class:`._driver.CudaDriver` in production."""

    def vmm_range(self, ptr: int, ordinal: int) -> tuple[int, int, int] | None: ...
    def vmm_export(self, ptr: int, ordinal: int) -> int: ...
    def vmm_granularity(self, ordinal: int) -> int: ...
    def vmm_import(
        self, fds: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], ordinal: int
    ) -> int: ...
    def vmm_unmap(self, ptr: int, offsets: Sequence[int], sizes: Sequence[int], ordinal: int) -> None: ...
    def as_tensor(self, owner: object, ptr: int, nbytes: int, ordinal: int) -> torch.Tensor: ...


def get_runtime() -> VmmRuntime:
    """The runtime the VMM kind uses (tests substitute a fake here)."""
    from ._driver import driver

    return driver()


def cuda_ordinal(tensor: torch.Tensor) -> int | None:
    """``tensor``'s CUDA device ordinal, or None off CUDA (tests substitute a fake here)."""
    return tensor.device.index if tensor.device.type == "cuda" else None


def is_vmm_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s first byte lies in CUDA virtual memory (mapped with ``cuMemMap``).

    What ``LMCACHE_PLATFORM_CUDA_IPC=auto`` sends to the VMM kind: vLLM's extensible
    KV cache, torch's expandable segments. False for tensors that are not on a CUDA
    device or hold no elements, and where the driver has no VMM API.
    """
    ordinal = cuda_ordinal(tensor)
    if ordinal is None or tensor.numel() == 0:
        return False
    try:
        return get_runtime().vmm_range(tensor.data_ptr(), ordinal) is not None
    except VmmUnsupportedError:
        return False


# -- engine side ---------------------------------------------------------------------


class _ExportedFd:
    """One allocation's exported fd in this process; closed when no wrapper names it.

    Close-on-exec: the driver makes it inheritable, and a child the engine starts (a
    compiler, a tokenizer worker) would otherwise keep the allocation's memory alive.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        os.set_inheritable(fd, False)


def _export(runtime: VmmRuntime, base: int, ordinal: int) -> _ExportedFd:
    return _ExportedFd(runtime.vmm_export(base, ordinal))


#: This process's exports, by ``(ordinal, base, size, allocation handle)``.
EXPORTS: OpenTable[_ExportedFd] = OpenTable()

_Segment = tuple[int, int, int]  # base, size, allocation handle


def _walk(
    runtime: VmmRuntime, ordinal: int, view: tuple[int, int], storage: tuple[int, int]
) -> list[_Segment]:
    """The allocations mapped next to each other around ``view`` (``[first, end)``),
    as far as they overlap ``storage``; raises if the view itself has a hole."""
    first, end = view
    found = runtime.vmm_range(first, ordinal)
    if found is None:
        raise NotVmmMemoryError(
            f"device memory at {first:#x} is not CUDA virtual memory (no cuMemMap mapping; the "
            "caching allocator's memory, say), which the VMM kind cannot share; use "
            "LMCACHE_PLATFORM_CUDA_IPC=auto (the default) or torch in the engine"
        )
    before: list[_Segment] = []
    lowest = found[0]
    while lowest > storage[0] and len(before) < MAX_SEGMENTS - 1:
        prev = runtime.vmm_range(lowest - 1, ordinal)
        if prev is None or prev[0] + prev[1] != lowest:
            break  # unmapped memory before the view: the storage starts in a reservation
        before.append(prev)
        lowest = prev[0]
    segments = [*reversed(before), found]
    while (edge := segments[-1][0] + segments[-1][1]) < max(storage[1], end):
        full = len(segments) >= MAX_SEGMENTS
        nxt = None if full else runtime.vmm_range(edge, ordinal)
        if nxt is None or nxt[0] != edge:
            if edge < end:
                why = "more allocations than" if full else "unmapped memory before"
                raise DescriptorError(
                    f"the view [{first:#x}, {end:#x}) reaches {why} the VMM kind can export "
                    f"(mapped memory stops at {edge:#x}; at most {MAX_SEGMENTS} allocations)"
                )
            break
        segments.append(nxt)
    return segments


# -- server side ---------------------------------------------------------------------


class _Mapping:
    """One import of an export in this process: a reserved range with every allocation
    mapped at its offset. Unmapped (and the range freed) when garbage-collected."""

    def __init__(
        self,
        runtime: VmmRuntime,
        fds: Sequence[int],
        offsets: Sequence[int],
        sizes: Sequence[int],
        ordinal: int,
    ) -> None:
        self.runtime = runtime
        self.ordinal = ordinal
        self.span = offsets[-1] + sizes[-1]
        self.ptr = runtime.vmm_import(fds, offsets, sizes, ordinal)
        fin = weakref.finalize(self, _unmap, runtime, self.ptr, tuple(offsets), tuple(sizes), ordinal)
        fin.atexit = False  # the driver reclaims everything at exit; no teardown-order races


def _unmap(
    runtime: VmmRuntime, ptr: int, offsets: tuple[int, ...], sizes: tuple[int, ...], ordinal: int
) -> None:
    try:
        runtime.vmm_unmap(ptr, offsets, sizes, ordinal)
    except Exception:  # runs from a finaliser: nowhere to raise to
        log.warning("unmapping CUDA virtual memory at %#x on device %d failed", ptr, ordinal, exc_info=True)


def _close_fds(fds: tuple[int, ...]) -> None:
    for fd in fds:
        os.close(fd)


class _Import:
    """What the wrappers of one export share in this process: its fds and its mapping.

    ``owned`` fds (a decoded record's) are closed once mapped, or when the last holder
    lets go, or when this object is collected without either; an engine's own wrappers
    borrow the fds of ``EXPORTS`` instead.
    """

    def __init__(self, wrapper: CudaVmmIPCWrapper, *, owned: bool, holders: int) -> None:
        self.lock = threading.Lock()
        self.fds = tuple(wrapper.segment_fds)
        self.offsets = tuple(wrapper.segment_offsets)
        self.sizes = tuple(wrapper.segment_sizes)
        self.holders = holders
        self.mapping: _Mapping | None = None
        self.close_fds = weakref.finalize(self, _close_fds, self.fds if owned else ())

    def open(self, ordinal: int, where: str) -> _Mapping:
        with self.lock:
            if self.mapping is not None:
                if self.mapping.ordinal != ordinal:
                    raise DescriptorError(
                        f"{where}: already mapped on cuda:{self.mapping.ordinal}, not cuda:{ordinal}"
                    )
                return self.mapping
            for fd in self.fds:  # before any driver call: a closed or foreign number is ours to refuse
                try:
                    os.fstat(fd)
                except OSError as exc:
                    raise DescriptorError(
                        f"{where}: fd {fd} of the descriptor is not open here ({exc})"
                    ) from exc
            runtime = get_runtime()
            granularity = runtime.vmm_granularity(ordinal)
            if any(x % granularity for x in (*self.offsets, *self.sizes)):
                raise VmmUnsupportedError(
                    f"{where}: segments {list(zip(self.offsets, self.sizes, strict=True))} are not "
                    f"multiples of cuda:{ordinal}'s VMM granularity of {granularity} bytes, so this device "
                    "cannot map them; run the server on a GPU of the engine's kind"
                )
            self.mapping = _Mapping(runtime, self.fds, self.offsets, self.sizes, ordinal)
            # The mapping holds the memory now: received fds would only count against the
            # server's RLIMIT_NOFILE for the context's life (vLLM exports one per layer).
            self.close_fds()
            return self.mapping

    def drop(self) -> None:
        """One holder lets go; the last drops the mapping (tensors keep it) and closes owned fds."""
        with self.lock:
            self.holders -= 1
            if self.holders:
                return
            self.mapping = None
        self.close_fds()


class CudaVmmIPCWrapper(DeviceIPCWrapper):
    """A CUDA tensor in virtual memory, shared as one POSIX fd per physical allocation.

    ``segment_offsets``/``segment_sizes``/``segment_fds`` describe the exported span:
    the allocations mapped side by side, each at its offset from the span's start.
    ``storage_start`` is where the tensor's storage starts in that span (the base
    fields replay the view on it); when the storage starts in unmapped memory before
    the span, it is 0 and ``storage_offset`` counts from the span's start.
    """

    device_type: ClassVar[str] = "cuda"
    wire_tag: ClassVar[str] = "cuda.vmm/1"
    wire_fields = {
        "segment_offsets": WireField(list, lo=0, hi=MAX_BYTES, max_len=MAX_SEGMENTS),
        "segment_sizes": WireField(list, lo=0, hi=MAX_BYTES, max_len=MAX_SEGMENTS),
        "segment_fds": WireField(list, fds=True, max_len=MAX_SEGMENTS),
        "storage_start": WireField(int, lo=0, hi=MAX_BYTES),
    }

    def __init__(
        self,
        *,
        segment_offsets: Sequence[int],
        segment_sizes: Sequence[int],
        segment_fds: Sequence[int],
        storage_start: int,
        **base: Any,
    ) -> None:
        super().__init__(**base)  # dtype, shape, stride, storage_offset, device_uuid
        offsets, sizes, fds = tuple(segment_offsets), tuple(segment_sizes), tuple(segment_fds)
        span = _check_segments(type(self).__name__, offsets, sizes, fds)
        if storage_start > span or (not span and storage_start):
            raise DescriptorError(
                f"{type(self).__name__}: storage_start {storage_start} lies past the {span}-byte span"
            )
        check_view_fits(self, span - storage_start)
        self.segment_offsets = offsets
        self.segment_sizes = sizes
        self.segment_fds = fds
        self.storage_start = storage_start
        self._open_lock = threading.Lock()
        self._exports: tuple[Any, ...] = ()  # keys in EXPORTS: an engine's own wrapper
        self._import: _Import | None = None

    @classmethod
    def from_views(cls, export: Mapping[str, Any], views: Sequence[Mapping[str, Any]]) -> list[Self]:
        """Validate as the base does; the wrappers then own the fds and one mapping, together."""
        wrappers = super().from_views(export, views)
        if wrappers:
            shared = _Import(wrappers[0], owned=True, holders=len(wrappers))
            for wrapper in wrappers:
                wrapper._import = shared
        return wrappers

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        ordinal = cuda_ordinal(tensor)
        if ordinal is None:
            ordinal = require_cuda(cls, tensor)  # raises, naming the device
        uuid = DEVICES.uuid_of(ordinal)
        if tensor.numel() == 0:
            return cls.describe(
                tensor,
                device_uuid=uuid,
                segment_offsets=(),
                segment_sizes=(),
                segment_fds=(),
                storage_start=0,
            )
        itemsize, element = tensor.element_size(), int(tensor.storage_offset())
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        first = start + element * itemsize
        last = sum((int(n) - 1) * int(st) for n, st in zip(tensor.shape, tensor.stride(), strict=True))
        end = first + itemsize * (1 + last)
        runtime = get_runtime()
        segments = _walk(runtime, ordinal, (first, end), (start, start + int(storage.nbytes())))
        span_base = segments[0][0]
        if span_base <= start:
            storage_start, offset = start - span_base, element
        else:  # the storage starts in unmapped memory (a view of a reservation): count from the span
            storage_start, (offset, rest) = 0, divmod(first - span_base, itemsize)
            if rest:
                raise DescriptorError(
                    f"{cls.__name__}: the view starts {first - span_base} bytes into its span"
                )
        keys: list[Any] = []
        fds: list[int] = []
        try:
            for base, size, handle in segments:
                key = (ordinal, base, size, handle)
                exported = EXPORTS.acquire(key, partial(_export, runtime, base, ordinal))
                keys.append(key)
                fds.append(exported.fd)
            wrapper = cls(
                dtype=tensor.dtype,
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
                storage_offset=offset,
                device_uuid=uuid,
                segment_offsets=[base - span_base for base, _, _ in segments],
                segment_sizes=[size for _, size, _ in segments],
                segment_fds=fds,
                storage_start=storage_start,
            )
        except BaseException:
            for key in keys:
                EXPORTS.release(key)
            raise
        wrapper._exports = tuple(keys)
        return wrapper

    def to_tensor(self) -> torch.Tensor:
        ordinal = DEVICES.ordinal_of(self.device_uuid)
        if not self.nbytes:
            return empty_view(self, ordinal)
        with self._open_lock:
            if self.closed:
                raise DescriptorError(f"{type(self).__name__} is closed; decode the descriptor again")
            if self._import is None:  # made here (an engine opening its own export): borrows the fds
                self._import = _Import(self, owned=False, holders=1)
            shared = self._import
        mapping = shared.open(ordinal, type(self).__name__)
        flat = mapping.runtime.as_tensor(
            mapping, mapping.ptr + self.storage_start, mapping.span - self.storage_start, ordinal
        )
        return view_over(self, flat)

    def release(self) -> None:
        with self._open_lock:
            exports, self._exports = self._exports, ()
            shared, self._import = self._import, None
        for key in exports:
            EXPORTS.release(key)
        if shared is not None:
            shared.drop()


def _check_segments(name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], fds: tuple[int, ...]) -> int:
    """The span the segments tile, once they are sound; nothing here touches a driver."""
    if len(fds) > MAX_SEGMENTS:
        raise DescriptorError(f"{name}: {len(fds)} segments, more than {MAX_SEGMENTS}")
    if not len(offsets) == len(sizes) == len(fds):
        raise DescriptorError(
            f"{name}: {len(offsets)} segment offsets, {len(sizes)} sizes and {len(fds)} fds; "
            "one of each per segment"
        )
    if len(set(fds)) != len(fds):
        raise DescriptorError(f"{name}: segment_fds repeats an fd; each segment has its own")
    end = 0
    for i, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if offset != end:
            raise DescriptorError(
                f"{name}: segment {i} starts at {offset}, not at {end}: segments are sorted and "
                "contiguous from 0, without gaps or overlaps"
            )
        if size <= 0 or size % MIN_GRANULARITY:
            raise DescriptorError(
                f"{name}: segment {i} has {size} bytes, not a positive multiple of {MIN_GRANULARITY} "
                "(the VMM granularity of current GPUs)"
            )
        end += size
    if end > MAX_BYTES:
        raise DescriptorError(f"{name}: the segments span {end} bytes, more than {MAX_BYTES}")
    return end

"""``CudaEvent``: CUDA inter-process events, so a server's copies wait for an engine's kernels.

Engine side, :meth:`CudaEvent.record` records an event created with
``torch.cuda.Event(interprocess=True)`` on the device's current stream and returns its
64-byte ``cudaIpcEventHandle_t``. The events come from a small ring per device kept for
the process's life: CUDA leaves a wait on an imported event undefined once the exporter
destroyed it, and re-recording a ring's event only makes a late wait cover later work
(still ordered, never earlier). Recording reuses the same handles, so a server opens
each once.

Server side, :meth:`CudaEvent.open` imports a handle (``torch.cuda.Event.from_ipc_handle``)
and :meth:`CudaEvent.wait` makes the current stream (the context's, inside its
``stream_context()``) wait for it: ``cudaStreamWaitEvent``, no host synchronization.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, ClassVar

from lmcache_platform import DeviceEvent, TransferError

if TYPE_CHECKING:
    import torch

#: ``sizeof(cudaIpcEventHandle_t)``.
HANDLE_BYTES = 64
#: Events per device an engine records in turn.
RING = 8


class _Ring:
    """One device's events, recorded in turn."""

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events
        self.next = 0

    def take(self) -> torch.cuda.Event:
        event = self.events[self.next]
        self.next = (self.next + 1) % len(self.events)
        return event


class CudaEvent(DeviceEvent):
    """A CUDA inter-process event; see the module docstring."""

    device_type: ClassVar[str] = "cuda"
    _rings: ClassVar[dict[int, _Ring]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    @classmethod
    def record(cls, device: torch.device) -> bytes:
        import torch

        index = _index(device)
        with cls._lock:
            ring = cls._rings.get(index)
            if ring is None:
                events = [torch.cuda.Event(interprocess=True) for _ in range(RING)]  # type: ignore[no-untyped-call]
                ring = cls._rings[index] = _Ring(events)
            event = ring.take()
        event.record(torch.cuda.current_stream(index))
        return bytes(event.ipc_handle())  # type: ignore[no-untyped-call]

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> CudaEvent:
        import torch

        if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
            size = len(handle) if isinstance(handle, bytes) else type(handle).__name__
            raise TransferError(f"a CUDA event handle is {HANDLE_BYTES} bytes, got {size}")
        try:
            event = torch.cuda.Event.from_ipc_handle(_index(device), handle)  # type: ignore[no-untyped-call]
        except RuntimeError as exc:  # the driver's refusal: not an event of a live process
            raise TransferError(f"cannot open the CUDA event handle {handle[:8].hex()}...: {exc}") from exc
        return cls(event)

    def wait(self) -> None:
        self._event.wait()  # on the current stream: the context's, inside stream_context()


def _index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it names none)."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()

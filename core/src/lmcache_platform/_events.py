"""``DeviceEvent``: ordering a server's copies after an engine's kernels, across processes.

On a device with asynchronous streams, the server must not read a block before the
engine's kernels that write it have run, nor write one while a kernel still reads it.
Synchronizing the whole device every step would stall the engine; instead the engine
records an event on its stream and hands the server the event's inter-process *handle*
with the put or get, and the server's stream waits on it before its copies. Upstream
LMCache has ordered transfers this way since 0.5.5.

A backend provides the class through the ``lmcache_platform_device_event_class`` hook;
engines call :func:`lmcache_platform.record_event`, servers
:meth:`BaseCacheContext.wait_event <lmcache_platform.BaseCacheContext.wait_event>`.
Devices whose copies complete before they return (the host) have no event class:
``record_event`` returns ``None`` and nothing is sent.

Contract (stable within an API major):

* :meth:`DeviceEvent.record` runs in the engine: it records an event on ``device``'s
  current stream and returns its handle (at most :data:`MAX_HANDLE_BYTES` bytes). The
  class keeps what it recorded alive as long as a server may use the handle (the process's
  life, reusing a few events: a wait then covers the latest record of that event, which
  is later, so still ordered).
* :meth:`DeviceEvent.open` runs in the server: the event a handle names, opened in this
  process; a handle that names none raises :class:`~lmcache_platform.TransferError`.
  Contexts keep what they opened (a few, most recently used) until they close.
* :meth:`DeviceEvent.wait` makes work issued next on the *current* stream wait for the
  event; the context calls it inside its ``stream_context()``. It never blocks the host.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from typing import TYPE_CHECKING, ClassVar

from ._errors import LMCachePlatformError, TransferError

if TYPE_CHECKING:
    import torch

#: Longest event handle a request may carry (CUDA's are 64 bytes).
MAX_HANDLE_BYTES = 256


class DeviceEvent(abc.ABC):
    """A backend's inter-process device event; see the module docstring for the contract."""

    #: torch device type whose streams the events order; must match the backend's.
    device_type: ClassVar[str] = ""

    @classmethod
    @abc.abstractmethod
    def record(cls, device: torch.device) -> bytes:
        """Engine side: record an event on ``device``'s current stream; return its handle."""

    @classmethod
    @abc.abstractmethod
    def open(cls, handle: bytes, device: torch.device) -> DeviceEvent:
        """Server side: the event ``handle`` names, usable on ``device``; TransferError if none."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Make work issued next on the current stream wait for the event's latest record."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what :meth:`open` took; called when the context drops the event."""


class OpenEvents:
    """The events one context opened from handles: a few, most recently used, until it closes.

    Engines reuse a few events, so the same handles come back; opening one per request
    would cost a driver call each.
    """

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._events: OrderedDict[bytes, DeviceEvent] = OrderedDict()

    def get(self, handle: bytes, cls: type[DeviceEvent], device: torch.device) -> DeviceEvent:
        """The event ``handle`` names, opened now or before (:class:`TransferError` if none)."""
        event = self._events.get(handle)
        if event is None:
            try:
                event = cls.open(handle, device)
            except LMCachePlatformError:
                raise
            except Exception as exc:  # the backend's own failure: name the handle
                raise TransferError(
                    f"{cls.__name__} refused a device event handle of {len(handle)} bytes: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            self._events[handle] = event
            while len(self._events) > self._limit:
                self._events.popitem(last=False)[1].close()
        self._events.move_to_end(handle)
        return event

    def close(self) -> None:
        """Close every event (each close is the backend's; the first failure propagates)."""
        events, self._events = list(self._events.values()), OrderedDict()
        for event in events:
            event.close()

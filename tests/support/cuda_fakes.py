"""Fakes for the CUDA runtime, for the tests that run without a GPU.

Each stands in for one thing only the hardware can answer; everything they feed
(the UUID table, the mapping table, view replay) is the real code.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any

import numpy as np
import pytest
import torch

from lmcache_platform import DescriptorError
from lmcache_platform_cuda import _devices, _raw_ipc

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
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


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

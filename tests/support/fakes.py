"""Fake backend pieces for core tests: an in-process wrapper and a trivial cache context.

These are test doubles for the plugin *contract*; they do no IPC. Real shared memory
is exercised by the CPU-backend tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from lmcache_platform import (
    BaseCacheContext,
    CacheContextConfig,
    DeviceIPCWrapper,
    WireField,
)
from lmcache_platform.testing import fake_backend

_HELD: dict[int, Any] = {}


def wrapper_class(device_type: str, tag: str | None = None) -> type[DeviceIPCWrapper]:
    """A wrapper class for ``device_type`` that keeps tensors in this process."""

    class FakeWrapper(DeviceIPCWrapper):
        wire_tag = tag or f"{device_type}.fake/1"
        wire_fields: ClassVar = {"key": WireField(int, lo=0)}

        def __init__(self, *, key: int, **base: Any) -> None:
            super().__init__(**base)
            self.key = key

        @classmethod
        def wrap(cls, tensor: Any) -> FakeWrapper:
            _HELD[id(tensor)] = tensor
            return cls.describe(tensor, device_uuid=device_type, key=id(tensor))

        def to_tensor(self) -> Any:
            return _HELD[self.key]

    FakeWrapper.device_type = device_type
    FakeWrapper.__qualname__ = FakeWrapper.__name__ = f"FakeWrapper_{device_type}"
    return FakeWrapper


def context_class(device_type: str) -> type[BaseCacheContext]:
    """A cache-context class for ``device_type`` that only records what it was given."""

    class FakeContext(BaseCacheContext):
        def __init__(self, kv_caches: Sequence[DeviceIPCWrapper], config: CacheContextConfig):
            self.kv_caches = list(kv_caches)
            self.config = config

        def close(self) -> None:
            pass

    FakeContext.device_type = device_type
    FakeContext.__abstractmethods__ = frozenset()  # a stand-in: no layout work to do
    FakeContext.__qualname__ = FakeContext.__name__ = f"FakeContext_{device_type}"
    return FakeContext


def backend(device: str = "cpu", *, tag: str | None = None, **kw: Any) -> Any:
    """:func:`lmcache_platform.testing.fake_backend` with this module's wrapper and context classes.

    ``tag``: the wrapper's wire tag (default: one per device type); ``kw``: the rest of
    ``fake_backend``'s keywords (``probe``, ``name`` ...).
    """
    return fake_backend(
        device, context_class=context_class(device), wrapper_class=wrapper_class(device, tag), **kw
    )

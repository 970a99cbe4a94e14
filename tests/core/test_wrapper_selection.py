"""A backend that picks its wrapper class per tensor (``DeviceIPCWrapper.wrapper_class_for``).

One device type can hold memory of several kinds, each shared its own way (CUDA: the
caching allocator's blocks, virtual-memory reservations). The backend's wrapper class
names, per tensor, the wire class that exports it; ``wrap_kv_caches`` follows it,
preflights each class's own batch and the receiver accepts every listed class. The
fake backend here is in-process (``HeldWrapper``); what is tested is core's facade,
registry and wire format, and that a backend which does not pick sees no change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import DeviceIPCWrapper, wire
from lmcache_platform.conformance.test_hooks import picks_per_tensor
from lmcache_platform.testing import fake_backend
from support.cache import HeldWrapper, HostContext

PREFLIGHTS: list[tuple[str, int]] = []


class Plain(HeldWrapper):
    wire_tag = "test.plain/1"

    @classmethod
    def preflight(cls, tensors: Sequence[torch.Tensor]) -> None:
        PREFLIGHTS.append((cls.wire_tag, len(tensors)))


class Special(HeldWrapper):
    """The kind for "special" memory: here, integer tensors."""

    wire_tag = "test.special/1"

    @classmethod
    def preflight(cls, tensors: Sequence[torch.Tensor]) -> None:
        PREFLIGHTS.append((cls.wire_tag, len(tensors)))
        if any(t.numel() > 1000 for t in tensors):
            raise MemoryError("no room for the special batch")


class Picks(Plain):
    """What a backend's hook returns when it chooses per tensor (CUDA's ``auto``)."""

    @classmethod
    def wrapper_class_for(cls, tensor: torch.Tensor) -> type[DeviceIPCWrapper]:
        return Special if not tensor.dtype.is_floating_point else Plain


@pytest.fixture(autouse=True)
def _fresh() -> None:
    PREFLIGHTS.clear()


def install(registry: Any, wrapper_class: type[DeviceIPCWrapper]) -> None:
    registry.install(
        "cpu",
        fake_backend(
            "cpu", context_class=HostContext, wrapper_class=wrapper_class, wire_classes=[Plain, Special]
        ),
    )


def test_the_default_is_the_class_itself() -> None:
    assert HeldWrapper.wrapper_class_for(torch.zeros(1)) is HeldWrapper
    assert Special.wrapper_class_for(torch.zeros(1)) is Special
    assert not picks_per_tensor(Plain) and picks_per_tensor(Picks)


def test_each_tensor_is_wrapped_by_the_class_picked_for_it(lmcache_registry: Any) -> None:
    install(lmcache_registry, Picks)
    layers = [
        torch.zeros(4),
        torch.zeros(4, dtype=torch.int32),
        torch.ones(2),
        torch.zeros(3, dtype=torch.int8),
    ]
    wrapped = lp.wrap_kv_caches(layers)
    assert [type(w) for w in wrapped] == [Plain, Special, Plain, Special]
    assert sorted(PREFLIGHTS) == [("test.plain/1", 2), ("test.special/1", 2)]  # one batch per class
    # the receiver's allow-list holds what the backend lists; every picked class travels
    decoded = wire.decode(wire.encode(wrapped))
    assert [type(w) for w in decoded] == [Plain, Special, Plain, Special]


def test_a_class_that_does_not_pick_keeps_one_batch(lmcache_registry: Any) -> None:
    install(lmcache_registry, Plain)
    wrapped = lp.wrap_kv_caches([torch.zeros(4), torch.zeros(4, dtype=torch.int32)])
    assert [type(w) for w in wrapped] == [Plain, Plain]
    assert PREFLIGHTS == [("test.plain/1", 2)]


def test_a_picked_class_preflights_before_anything_is_wrapped(lmcache_registry: Any) -> None:
    install(lmcache_registry, Picks)
    made: list[DeviceIPCWrapper] = []
    original = Plain.wrap.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Plain], tensor: torch.Tensor) -> Plain:
        w: Plain = original(cls, tensor)
        made.append(w)
        return w

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Plain, "wrap", classmethod(counting))
        with pytest.raises(MemoryError, match="special batch"):
            lp.wrap_kv_caches([torch.zeros(4), torch.zeros(2000, dtype=torch.int32)])
    assert made == []


def test_a_failing_pick_names_the_layer(lmcache_registry: Any) -> None:
    class Broken(Plain):
        @classmethod
        def wrapper_class_for(cls, tensor: torch.Tensor) -> type[DeviceIPCWrapper]:
            if tensor.dim() == 2:
                raise RuntimeError("cannot tell what memory this is")
            return Plain

    install(lmcache_registry, Broken)
    with pytest.raises(lp.WrapError, match=r"layer 1 .*cannot tell what memory this is") as err:
        lp.wrap_kv_caches([torch.zeros(4), torch.zeros(2, 2)])
    assert err.value.layer == 1


def test_a_pick_that_is_not_a_wrapper_class_is_refused(lmcache_registry: Any) -> None:
    class Wrong(Plain):
        @classmethod
        def wrapper_class_for(cls, tensor: torch.Tensor) -> type[DeviceIPCWrapper]:
            return dict  # type: ignore[return-value]

    install(lmcache_registry, Wrong)
    with pytest.raises(lp.WrapError, match=r"Wrong\.wrapper_class_for returned <class 'dict'>"):
        lp.wrap_kv_caches([torch.zeros(4)])

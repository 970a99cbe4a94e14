"""The device-event hook: engines record, servers' contexts wait, hosts need none.

A fake event class stands in for a device's (it logs instead of touching a stream); the
CUDA one is tested on a GPU in ``tests/cuda``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import DeviceEvent, TransferError, hookspecs
from lmcache_platform.testing import fake_backend
from support.cache import HostContext, make_layers
from support.cache import context as make_context
from support.fakes import context_class, wrapper_class


class FakeEvent(DeviceEvent):
    """Logs what a device would do; handles are ``b"fake:<n>"``."""

    device_type: ClassVar[str] = "cpu"
    log: ClassVar[list[tuple[str, Any]]] = []
    recorded: ClassVar[int] = 0

    def __init__(self, handle: bytes) -> None:
        self.handle = handle

    @classmethod
    def record(cls, device: torch.device) -> bytes:
        cls.recorded += 1
        cls.log.append(("record", str(device)))
        return b"fake:%d" % cls.recorded

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> FakeEvent:
        if handle == b"fake:crash":
            raise RuntimeError("the driver crashed")
        if not handle.startswith(b"fake:"):
            raise TransferError(f"{handle!r} is not a fake event")
        cls.log.append(("open", handle))
        return cls(handle)

    def wait(self) -> None:
        FakeEvent.log.append(("wait", self.handle))

    def close(self) -> None:
        FakeEvent.log.append(("close", self.handle))


class Evented(HostContext):
    """A host context whose backend had events: it logs where its stream work runs."""

    def device_event_class(self) -> type[DeviceEvent] | None:
        return FakeEvent

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        FakeEvent.log.append(("stream", "enter"))
        yield
        FakeEvent.log.append(("stream", "exit"))


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    FakeEvent.log.clear()


def host_context(cls: type[HostContext] = HostContext) -> Any:
    layers = make_layers(lp.KVFormat.FLASH_ATTN, 2)
    return make_context(layers, cls=cls, layout_hints=lp.LayoutHints(kv_format=lp.KVFormat.FLASH_ATTN))


def backend(**kw: Any) -> Any:
    return fake_backend("cpu", context_class=context_class("cpu"), wrapper_class=wrapper_class("cpu"), **kw)


def test_the_hook_is_an_optional_spec_of_this_api() -> None:
    doc = hookspecs.lmcache_platform_device_event_class.__doc__ or ""
    assert "Required: no. Since backend API 1" in doc


def test_record_event_uses_the_selected_backends_class(lmcache_registry: Any) -> None:
    lmcache_registry.install("cpu", backend(event_class=FakeEvent))
    assert lp.device_event_class("cpu") is FakeEvent
    assert lp.record_event("cpu") == b"fake:%d" % FakeEvent.recorded
    assert lp.record_event(torch.device("cpu")) == b"fake:%d" % FakeEvent.recorded
    assert FakeEvent.log == [("record", "cpu"), ("record", "cpu")]


def test_without_an_event_class_there_is_nothing_to_record(lmcache_registry: Any) -> None:
    lmcache_registry.install("cpu", backend())
    assert lp.device_event_class("cpu") is None
    assert lp.record_event("cpu") is None


def test_the_installed_cpu_backend_has_no_events() -> None:
    assert lp.record_event("cpu") is None  # host copies complete before they return


@pytest.mark.parametrize(
    ("event_class", "match"),
    [
        (type("Foreign", (FakeEvent,), {"device_type": "cuda"}), "device_type is 'cuda'"),
        (int, "device-event class; expected a subclass of DeviceEvent"),
    ],
)
def test_a_wrong_event_class_fails_the_backend(lmcache_registry: Any, event_class: type, match: str) -> None:
    with pytest.raises(lp.BackendLoadError, match=match):
        lp.register_backend(backend(event_class=event_class), "cpu")


def test_wait_event_opens_a_handle_once_and_waits_on_the_stream() -> None:
    ctx = host_context(Evented)
    with ctx:
        ctx.wait_event(b"fake:1")
        ctx.wait_event(b"fake:1")
        ctx.wait_event(b"fake:2")
        assert FakeEvent.log == [
            ("open", b"fake:1"),
            ("stream", "enter"),
            ("wait", b"fake:1"),
            ("stream", "exit"),
            ("stream", "enter"),  # the second wait reuses the opened event
            ("wait", b"fake:1"),
            ("stream", "exit"),
            ("open", b"fake:2"),
            ("stream", "enter"),
            ("wait", b"fake:2"),
            ("stream", "exit"),
        ]
        FakeEvent.log.clear()
    assert sorted(FakeEvent.log) == [("close", b"fake:1"), ("close", b"fake:2")]  # closing the context


def test_a_bad_handle_is_refused_with_a_transfer_error() -> None:
    with host_context(Evented) as ctx:
        with pytest.raises(TransferError, match="b'nope' is not a fake event"):
            ctx.wait_event(b"nope")
        with pytest.raises(
            TransferError, match=r"FakeEvent refused a device event handle of 10 bytes: RuntimeError"
        ):
            ctx.wait_event(b"fake:crash")
        assert ("wait", b"nope") not in FakeEvent.log


def test_a_host_context_takes_no_events(lmcache_registry: Any) -> None:
    lmcache_registry.install("cpu", backend())
    with (
        host_context() as ctx,
        pytest.raises(TransferError, match="takes no device events: its copies complete before they"),
    ):
        ctx.wait_event(b"fake:1")
    with pytest.raises(TransferError, match="closed"):
        ctx.wait_event(b"fake:1")

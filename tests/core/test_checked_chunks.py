"""One call into a cache context per request: chunks checked once, then one batch call.

``check_chunks`` checks a request's chunks before any moves; ``read_chunks`` and
``write_chunks`` take what it passed without checking again, check raw ids (and a
write's host tensors) for the whole batch before moving any, and wait for the
engine's event themselves. Real host tensors throughout; the event class is
``test_device_events``'s kind of fake (a host has no device events).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from lmcache_platform import CheckedChunk, DeviceEvent, KVFormat, LayoutHints, TransferError
from support.cache import HostContext, make_layers
from support.cache import context as make_context

BS, NB = 4, 32  # 16-token chunks of 4 blocks; 8 chunks' worth of blocks


def ids(chunk: int) -> list[list[int]]:
    """Chunk ``chunk``'s block ids (one engine group)."""
    return [[4 * chunk + j for j in range(4)]]


class Evented(HostContext):
    """A host context whose backend had events: it logs each wait and each move."""

    log: ClassVar[list[str]] = []

    def device_event_class(self) -> type[DeviceEvent] | None:
        return LoggedEvent

    def store(self, plan: Any) -> None:
        Evented.log.append("store")
        super().store(plan)

    def retrieve(self, plan: Any) -> None:
        Evented.log.append("retrieve")
        super().retrieve(plan)


class LoggedEvent(DeviceEvent):
    device_type: ClassVar[str] = "cpu"

    @classmethod
    def record(cls, device: torch.device) -> bytes:
        raise NotImplementedError  # the engine's side: not used here

    @classmethod
    def open(cls, handle: bytes, device: torch.device) -> LoggedEvent:
        return cls()

    def wait(self) -> None:
        Evented.log.append("wait")

    def close(self) -> None:
        pass


@pytest.fixture
def layers() -> list[torch.Tensor]:
    return make_layers(KVFormat.FLASH_ATTN, 2, nb=NB, bs=BS)


@contextlib.contextmanager
def opened(layers: list[torch.Tensor], cls: type[HostContext] = HostContext) -> Iterator[Any]:
    Evented.log.clear()
    with make_context(layers, cls=cls, layout_hints=LayoutHints(block_size=BS)) as ctx:
        yield ctx


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def test_checked_chunks_move_unchecked_and_match_the_single_chunk_calls(
    layers: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    with opened(layers) as ctx:
        assert ctx.max_batch_size < 6  # two batches
        reads = ctx.check_chunks([ids(c) for c in range(6)])
        writes = ctx.check_chunks([ids(c) for c in (7, 6)], retrieve=True)
        assert all(isinstance(c, CheckedChunk) for c in [*reads, *writes])
        assert reads[1].ids == ((4, 5, 6, 7),) and reads[1].num_tokens == 16 and not reads[1].retrieve
        calls: list[Any] = []
        check = ctx._planner.check

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return check(*args, **kwargs)

        monkeypatch.setattr(ctx._planner, "check", counted)
        got = ctx.read_chunks(reads)
        ctx.write_chunks(list(zip(writes, got[:2], strict=True)))
        assert calls == []  # checked once, by check_chunks
        for c, tensors in enumerate(got):
            single = ctx.allocate_chunk()
            ctx.read_chunk(ids(c), single)
            assert same(tensors, single)
        calls.clear()
        back = ctx.read_chunks([ids(7), ids(6)])  # raw ids are checked here
        assert same(back[0], got[0]) and same(back[1], got[1])
        assert len(calls) == 2


@pytest.mark.parametrize(
    ("chunk", "kwargs", "match"),
    [
        ("store", {"retrieve": True}, "checked for a store, not a retrieve"),
        ("retrieve", {}, "checked for a retrieve, not a store"),
        ("other", {}, "checked by another cache context"),
    ],
)
def test_checked_ids_serve_only_their_context_and_direction(
    layers: list[torch.Tensor], chunk: str, kwargs: dict[str, Any], match: str
) -> None:
    with opened(layers) as ctx, opened(make_layers(KVFormat.FLASH_ATTN, 2, nb=NB, bs=BS)) as other:
        made = {
            "store": ctx.check_chunks([ids(0)])[0],
            "retrieve": ctx.check_chunks([ids(0)], retrieve=True)[0],
            "other": other.check_chunks([ids(0)])[0],
        }[chunk]
        with pytest.raises(TransferError, match=f"^chunk 0: these block ids were {match}"):
            ctx.check_chunks([made], **kwargs)
        with pytest.raises(TransferError, match=match):
            (ctx.retrieve_chunk if kwargs else ctx.store_chunk)(made)


def test_checked_ids_keep_their_token_count(layers: list[torch.Tensor]) -> None:
    with opened(layers) as ctx:
        (full,) = ctx.check_chunks([ids(0)])
        with pytest.raises(TransferError, match="num_tokens 8, but the ids were checked for 16"):
            ctx.store_chunk(full, num_tokens=8)
        ctx.store_chunk(full, num_tokens=16)


def test_a_refusal_names_the_chunk_and_its_key(layers: list[torch.Tensor]) -> None:
    with (
        opened(layers) as ctx,
        pytest.raises(
            TransferError,
            match=r"^chunk 2 \(key ab\): engine group 0: block id 99 at position 3 is out of range "
            r"0\.\.31; nothing was transferred$",
        ),
    ):
        ctx.check_chunks([ids(0), ids(1), [[8, 9, 10, 99]]], name=lambda i: "key ab")


@pytest.mark.parametrize("bad", ["ids", "tensors"])
def test_a_batch_with_a_bad_last_chunk_writes_nothing(layers: list[torch.Tensor], bad: str) -> None:
    with opened(layers) as ctx:
        payloads = ctx.read_chunks([ids(c) for c in range(6)])
        before = [t.clone() for t in layers]
        chunks: list[Any] = [(ids(7 - c), payloads[c]) for c in range(5)]
        if bad == "ids":
            chunks.append(([[0, 1, 2, 2]], payloads[5]))  # a retrieve writes each block once
            match = r"chunk 5: engine group 0: retrieve would write block ids \[0, 1, 2, 2\]"
        else:
            chunks.append((ids(2), [t[:-1] for t in payloads[5]]))
            match = r"chunk 5: object group 0: expected a contiguous 1-D uint8 host tensor"
        with pytest.raises(TransferError, match=match):
            ctx.write_chunks(chunks)
        assert same(layers, before)


@pytest.mark.parametrize("op", ["read", "write"])
def test_the_batch_calls_wait_for_the_engines_event_before_moving(
    layers: list[torch.Tensor], op: str
) -> None:
    with opened(layers, Evented) as ctx:
        if op == "read":
            ctx.read_chunks([ids(0), ids(1)], event=b"e1")
        else:
            ctx.write_chunks([(ids(0), ctx.allocate_chunk())], event=b"e1")
        assert Evented.log == ["wait", "store", "store"] if op == "read" else ["wait", "retrieve"]
        Evented.log.clear()
        ctx.write_chunks([], event=b"e1")  # no chunks: later transfers still wait for it
        assert Evented.log == ["wait"]


def test_an_event_for_a_host_context_is_refused_before_anything_moves(layers: list[torch.Tensor]) -> None:
    with opened(layers) as ctx:
        payload = ctx.read_chunks([ids(0)])[0]
        before = [t.clone() for t in layers]
        with pytest.raises(TransferError, match="takes no device events"):
            ctx.write_chunks([(ids(1), payload)], event=b"e1")
        assert same(layers, before)

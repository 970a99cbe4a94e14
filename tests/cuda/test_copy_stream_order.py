"""The order ``GPUCacheContext`` puts its streams and slot events in, checked without a GPU.

The context's gathers and scatters run on its stream, the host copies of ``read_chunk`` /
``write_chunk`` on a second one, and one event per staging slot orders each slot's reuse.
Here the streams and events are fakes that log what the context asks of them (CUDA's
semantics are not simulated), the tensors are host tensors and the moves take the torch
path, so what is checked is the protocol: every copy and every gather or scatter waits for
what it must, and nothing more, so that in a batch chunk i + 1's copy can overlap chunk
i's scatter. The bytes moved are checked too. A real GPU runs the same paths in the
conformance suite (``scripts/gpu-check``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from lmcache_platform import CacheContextConfig, KVFormat, LayoutHints
from lmcache_platform_cuda import GPUCacheContext
from support.cache import HeldWrapper

NB, BS, H, D, L = 16, 4, 2, 8, 2
CHUNK = 2 * BS


class FakeStream:
    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append((self.name, "waits for", event.name))

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append((self.name, "waits for", other.name))

    def synchronize(self) -> None:
        self.log.append((self.name, "synchronize"))

    def query(self) -> bool:
        return True


class FakeEvent:
    def __init__(self, slot: int, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = f"slot {slot}", log

    def record(self, stream: FakeStream) -> None:
        self.log.append((stream.name, "records", self.name))


class LoggedContext(GPUCacheContext):
    """``GPUCacheContext`` over host tensors, its streams and events logging fakes."""

    device_type: ClassVar[str] = "cpu"
    log: list[tuple[str, ...]]

    def create_stream(self) -> Any:
        self.log = []
        return FakeStream("main", self.log)

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        yield

    @property
    def _ordered_slots(self) -> bool:
        return True

    def _copy_stream(self) -> Any:
        if self._copies is None:
            self._copies = FakeStream("copy", self.log)  # type: ignore[assignment]
        return self._copies

    def _slot_free(self, slot: int) -> Any:
        return FakeEvent(slot, self.log)

    def transfer_kernels(self) -> Any:
        return Moves(self.log)


class Moves:
    """Stands in for the fused kernels: logs each gather or scatter, then the torch path moves it."""

    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.log = log

    def warm(self, ctx: Any) -> None:
        """Nothing to compile: the torch path moves every plan."""

    def run(self, plan: Any, *, store: bool) -> bool:
        self.log.append(("main", "gathers into" if store else "scatters from", f"slot {plan.slot}"))
        return False


def read_steps(slot: int) -> list[tuple[str, ...]]:
    s = f"slot {slot}"
    return [
        ("main", "waits for", s),  # the slot's last copy out (a fresh event: a no-op on a GPU)
        ("main", "gathers into", s),
        ("main", "records", s),
        ("copy", "waits for", "main"),  # its gather (and all before it)
        ("copy", "runs copies"),
        ("copy", "records", s),  # the slot is free once its bytes are out
    ]


def write_steps(slot: int) -> list[tuple[str, ...]]:
    s = f"slot {slot}"
    return [
        ("copy", "waits for", s),  # the slot's last scatter or copy out, nothing else
        ("copy", "runs copies"),
        ("main", "waits for", "copy"),  # the scatter waits for its copy
        ("main", "scatters from", s),
        ("main", "records", s),
    ]


@pytest.fixture
def ctx(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoggedContext]:
    monkeypatch.setenv("LMCACHE_PLATFORM_CUDA_KERNELS", "torch")
    layers = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=BS)
    context = LoggedContext(
        [HeldWrapper.wrap(t) for t in layers],
        CacheContextConfig(lmcache_tokens_per_chunk=CHUNK, layout_hints=hints),
    )

    @contextlib.contextmanager
    def on(stream: FakeStream) -> Iterator[None]:  # torch.cuda.stream: the copies run here
        context.log.append((stream.name, "runs copies"))
        yield

    monkeypatch.setattr(torch.cuda, "stream", on)
    with context:
        yield context


def unaligned_chunk(ctx: GPUCacheContext) -> list[torch.Tensor]:
    """Host tensors a host context cannot move in place: the staged path, as on a device."""
    return [torch.zeros(n + 1, dtype=torch.uint8)[1:] for n in ctx.chunk_nbytes]


def test_reads_copy_out_after_their_gather_and_gather_again_only_after_the_copy(ctx: LoggedContext) -> None:
    chunks = [[[0, 1]], [[2, 3]], [[4, 5]]]
    outs = [unaligned_chunk(ctx) for _ in chunks]
    for slot, (ids, out) in enumerate(zip(chunks, outs, strict=True)):
        ctx.read_chunk(ids, out, slot=slot)
    ctx.read_chunk(chunks[0], unaligned_chunk(ctx), slot=0)  # slot 0 again, no synchronize between
    # Gathering chunk 1 never waits for chunk 0's copy (on a device they overlap); the second
    # gather into slot 0 waits for slot 0's event, last recorded after its copy out.
    assert ctx.log == read_steps(0) + read_steps(1) + read_steps(2) + read_steps(0)
    ctx.synchronize()
    assert ctx.log[-2:] == [("main", "synchronize"), ("copy", "synchronize")]
    for ids, out in zip(chunks, outs, strict=True):
        reference = ctx.allocate_chunk()
        ctx.read_chunk(ids, reference)  # a host context moves these in place: the reference bytes
        assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))


def test_writes_scatter_after_their_copy_and_copy_in_only_after_the_slots_last_use(
    ctx: LoggedContext,
) -> None:
    src = [unaligned_chunk(ctx) for _ in range(3)]
    for i, chunk in enumerate(src):
        for t in chunk:
            t.fill_(i + 1)
    ctx.write_chunks([([[8 + 2 * i, 9 + 2 * i]], chunk) for i, chunk in enumerate(src)])
    # chunk 1's copy in never waits for chunk 0's scatter: on a device they overlap
    sync = [("main", "synchronize"), ("copy", "synchronize")]  # one per batch
    assert ctx.log == write_steps(0) + write_steps(1) + write_steps(2) + sync
    for i, layer in enumerate(ctx.kv_tensors):  # every byte landed where it was sent
        for k in range(3):
            blocks = layer[:, [8 + 2 * k, 9 + 2 * k]].contiguous().view(torch.uint8)
            assert bool((blocks == k + 1).all()), f"layer {i}, chunk {k}"


def test_the_seed_views_of_a_slot_wait_for_its_copies(ctx: LoggedContext) -> None:
    ctx.read_chunk([[0, 1]], unaligned_chunk(ctx), slot=2)
    ctx.get_temp_object_group_buffer(2, 0)  # a caller about to fill slot 2 on the stream
    assert ctx.log == [*read_steps(2), ("main", "waits for", "slot 2")]
    ctx.get_temp_kernel_group_buffer(1, 0)
    assert ctx.log[-1] == ("main", "waits for", "slot 1")
    ctx.store_chunk([[2, 3]], slot=1)  # the seed API's gather marks its slot too
    ctx.write_chunk([[6, 7]], unaligned_chunk(ctx), slot=1)
    assert ctx.log[-8:] == [*read_steps(1)[:3], *write_steps(1)]

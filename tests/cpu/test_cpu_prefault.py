"""Prefaulting: a server maps every page of an engine's memory before its transfers touch them.

Checked on this process's page tables (``Rss`` of the consumer's mappings in
``/proc/self/smaps``), for both kinds of export and both ways an engine allocates (one
buffer viewed per layer; one allocation per layer, reopened side by side), and through a
real ``lmcache-platform serve``, whose mapping of the engine fills without a transfer.
"""

from __future__ import annotations

import errno
import mmap
import threading
import time
from pathlib import Path

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import KVFormat, LayoutHints, create_cache_context, wire
from lmcache_platform import _libc as _populate
from lmcache_platform.hostmem import HostMemoryCacheContext, PopulateUnsupported
from lmcache_platform.server import ServerClient
from lmcache_platform.server._registration import prefault
from lmcache_platform.server._transfers import Entry
from support.cache import engine_views
from support.serve import Serve, TinyEngine, private_dir

BLOCKS, BLOCK, HEADS, HEAD, LAYERS = 160, 16, 4, 64, 4  # 20 MiB of float32: two 16 MiB pieces


def resident(start: int, nbytes: int, pid: int | str = "self") -> int:
    """Bytes of ``[start, start + nbytes)`` mapped in ``pid``'s page tables (``Rss`` of the mappings)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < start + nbytes and hi > start
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def engine(layout: str) -> list[torch.Tensor]:
    """vLLM's views of one buffer, or one flash-attention allocation per layer; random bytes."""
    if layout == "views":
        tensors = engine_views(LAYERS, BLOCKS, BLOCK, HEADS, HEAD, torch.float32)
        tensors[0].untyped_storage()  # one storage under every view
        for t in tensors:
            t.normal_()
        return tensors
    return [torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD) for _ in range(LAYERS)]


def hints(layout: str) -> LayoutHints:
    if layout == "views":
        return LayoutHints(
            kv_format=KVFormat.VLLM, block_size=BLOCK, engine_layout="LBHNC", num_kv_heads=HEADS
        )
    return LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=BLOCK, num_kv_heads=HEADS)


def span(ctx: lp.BaseCacheContext) -> tuple[int, int]:
    (storage,) = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in ctx.kv_tensors}.values()
    return storage.data_ptr(), storage.nbytes()


@pytest.mark.parametrize("layout", ["views", "per-layer"])
def test_prefault_maps_every_page_and_changes_no_byte(kind: str, layout: str) -> None:
    layers = engine(layout)
    wrappers = lp.wrap_kv_caches(layers)
    try:
        with create_cache_context(
            wire.decode(wire.encode(wrappers)), BLOCK * 2, layout_hints=hints(layout)
        ) as ctx:
            start, nbytes = span(ctx)
            before = resident(start, nbytes)
            assert before < nbytes // 2, "a fresh mapping of the engine's memory is mostly unmapped"
            assert ctx.prefault_memory() >= nbytes
            after = resident(start, nbytes)
            assert after >= nbytes - mmap.PAGESIZE, f"{after} of {nbytes} bytes mapped"
            for mine, theirs in zip(layers, ctx.kv_tensors, strict=True):
                assert torch.equal(mine, theirs)
            print(f"{kind}, {layout}: {before / 2**20:.1f} MiB mapped before, {after / 2**20:.1f} MiB after")
    finally:
        for w in wrappers:
            w.close()


def test_a_closed_context_prefaults_nothing_and_close_stops_one_under_way(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = [torch.randn(2, 4 * BLOCKS, BLOCK, HEADS, HEAD) for _ in range(LAYERS)]  # 80 MiB: 5 pieces
    wrappers = lp.wrap_kv_caches(layers)
    hint = hints("per-layer")
    try:
        ctx = create_cache_context(wire.decode(wire.encode(wrappers)), BLOCK * 2, layout_hints=hint)
        ctx.close()
        assert ctx.prefault_memory() == 0

        ctx = create_cache_context(wire.decode(wire.encode(wrappers)), BLOCK * 2, layout_hints=hint)
        assert isinstance(ctx, HostMemoryCacheContext)
        host = ctx
        libc = _populate._libc()
        closer = threading.Thread(target=ctx.close)
        calls: list[int] = []

        class Libc:  # the real madvise; close begins during the second piece
            @staticmethod
            def madvise(address: int, length: int, advice: int) -> int:
                calls.append(length)
                result: int = libc.madvise(address, length, advice)
                if len(calls) == 2:
                    closer.start()
                    while not host._populate_stopped:  # set before close waits for this piece
                        time.sleep(0.001)
                return result

        monkeypatch.setattr(_populate, "_libc", Libc)
        assert ctx.prefault_memory() == 2 * _populate.STEP_BYTES
        closer.join(30)
        assert not closer.is_alive() and len(calls) == 2
    finally:
        for w in wrappers:
            w.close()


def test_populate_says_why_it_could_not(monkeypatch: pytest.MonkeyPatch) -> None:
    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    address = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
    lock = threading.Lock()
    assert _populate.populate(address, len(region), lock=lock, stopped=lambda: False) == len(region)
    assert _populate.populate(address, len(region), lock=lock, stopped=lambda: True) == 0
    monkeypatch.setattr(_populate, "MADV_POPULATE_WRITE", 9999)  # advice this kernel does not know
    with pytest.raises(PopulateUnsupported, match="MADV_POPULATE_WRITE") as unsupported:
        _populate.populate(address, len(region), lock=lock, stopped=lambda: False)
    assert unsupported.value.errno == errno.EINVAL
    monkeypatch.undo()
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    gone = torch.frombuffer(probe, dtype=torch.uint8).data_ptr()
    del probe  # unmapped: nothing lives at that address now (no other mapping is made meanwhile)
    with pytest.raises(OSError, match="MADV_POPULATE_WRITE") as missing:
        _populate.populate(gone, mmap.PAGESIZE, lock=lock, stopped=lambda: False)
    assert missing.value.errno == errno.ENOMEM


def test_serve_maps_a_registered_engine_before_any_transfer(tmp_path: Path) -> None:
    socket_path = private_dir(tmp_path) / "kv.sock"
    eng = TinyEngine()
    try:
        with Serve(socket_path) as serve, ServerClient(str(socket_path), timeout=30) as client:
            context = eng.register(client)
            deadline = time.monotonic() + 30
            while (memory := client.status(context)["context"]["engine_memory"])["state"] == "mapping":
                assert time.monotonic() < deadline, serve.log()
                time.sleep(0.05)
            size = sum(t.untyped_storage().nbytes() for t in eng.tensors)
            assert memory["state"] == "mapped" and memory["bytes"] >= size and memory["seconds"] >= 0, memory
            assert "of the engine's memory mapped" in serve.log()
            with open(f"/proc/{serve.proc.pid}/smaps") as f:
                text = f.read()
            assert mapped_in(text, "lmcache_platform_") >= size, text
    finally:
        eng.close()


def mapped_in(smaps: str, name: str) -> int:
    """Rss bytes of the mappings whose path contains ``name``."""
    total, inside = 0, False
    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            inside = name in line
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


class _Ctx:
    """A context whose prefault ends as the test says (the server's side only is under test)."""

    def __init__(self, outcome: BaseException | int, closed: bool = False) -> None:
        self.outcome, self.closed = outcome, closed

    def prefault_memory(self) -> int:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize(
    ("outcome", "closed", "state"),
    [
        (4096, False, "mapped"),
        (4096, True, "stopped"),
        (PopulateUnsupported(errno.EINVAL, "madvise: before Linux 5.14"), False, "unsupported"),
        (OSError(errno.ENOMEM, "gone"), False, "failed"),
    ],
)
def test_status_tells_how_the_engines_memory_mapping_ended(
    outcome: BaseException | int, closed: bool, state: str, caplog: pytest.LogCaptureFixture
) -> None:
    entry = Entry(7, _Ctx(outcome, closed), "cpu", b"", 1, threading.Lock())  # type: ignore[arg-type]
    assert entry.engine_memory == {"state": "mapping"}
    prefault(entry)
    assert entry.engine_memory["state"] == state, entry.engine_memory
    if state in ("mapped", "stopped"):
        assert entry.engine_memory["bytes"] == 4096
    elif state == "failed":
        assert "OSError" in entry.engine_memory["error"] and "gone" in caplog.text
    else:
        assert "5.14" in entry.engine_memory["error"]

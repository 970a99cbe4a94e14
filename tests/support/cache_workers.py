"""Engine processes for the shared-cache load cases (``test_rel_cache_load.py``).

Every chunk's content is a pure function of its key index (:func:`content`), so any
process can check any chunk it loads, whoever stored it: a torn or stale chunk, or
one written into the wrong blocks, shows as a mismatch. They talk to the test over a
pipe with JSON only (``send_bytes``); nothing received is unpickled.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from lmcache_platform import KVFormat, LayoutHints
from support.commands import PipeChannel, serve_commands


@dataclass(frozen=True)
class Model:
    """A small paged KV cache: ``chunk`` tokens per chunk, so ``chunk // block`` blocks each."""

    layers: int
    heads: int
    head: int
    block: int
    chunk: int
    blocks: int

    @property
    def per_chunk(self) -> int:
        return self.chunk // self.block

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.chunk * self.heads * self.head * 2  # bfloat16

    def slots(self) -> int:
        return self.blocks // self.per_chunk

    def blocks_of(self, slot: int) -> list[int]:
        return [slot * self.per_chunk + b for b in range(self.per_chunk)]


def key(k: int) -> bytes:
    return k.to_bytes(8, "little") * 4


def content(model: Model, k: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of chunk ``k`` for one layer (``like`` is the layer's view of one chunk's blocks)."""
    gen = torch.Generator().manual_seed(0x5EED0000 + k)
    return torch.randint(-(2**15), 2**15, like.shape, dtype=torch.int16, generator=gen)


class Engine:
    """One model's KV caches, registered with one server (:meth:`also` registers them with another)."""

    def __init__(
        self, model: Model, socket_path: str, namespace: bytes, *, share: Engine | None = None
    ) -> None:
        import lmcache_platform as lp
        from lmcache_platform.server import ServerClient

        self.model = model
        self.namespace = namespace
        self.owner = share is None
        if share is None:
            shape = (2, model.blocks, model.block, model.heads, model.head)
            self.tensors = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(model.layers)]
            self.wrappers = lp.wrap_kv_caches(self.tensors)
        else:
            self.tensors, self.wrappers = share.tensors, share.wrappers
        self.client = ServerClient(socket_path, timeout=300)
        hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=model.block, num_kv_heads=model.heads)
        self.ctx = self.client.register(
            self.wrappers, namespace=namespace, layout_hints=hints, lmcache_tokens_per_chunk=model.chunk
        ).context

    def also(self, socket_path: str) -> Engine:
        """The same KV caches registered with the server at ``socket_path`` too."""
        return Engine(self.model, socket_path, self.namespace, share=self)

    def write(self, slot: int, k: int) -> None:
        blocks = self.model.blocks_of(slot)
        for t in self.tensors:
            view = t[:, blocks]
            t[:, blocks] = content(self.model, k, view).view(torch.bfloat16)

    def check(self, slot: int, k: int | None) -> bool:
        """Slot holds chunk ``k`` exactly (``None``: still all zero)."""
        blocks = self.model.blocks_of(slot)
        for t in self.tensors:
            got = t[:, blocks].view(torch.int16)
            if k is None:
                if got.any():
                    return False
            elif not bool((got == content(self.model, k, got)).all()):
                return False
        return True

    def clear(self, slot: int) -> None:
        for t in self.tensors:
            t[:, self.model.blocks_of(slot)] = 0

    def close(self) -> None:
        self.client.unregister(self.ctx)
        self.client.close()
        if self.owner:
            for w in self.wrappers:
                w.close()


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def mixed_client(conn: Connection, socket_path: str, spec: dict[str, Any]) -> None:
    """Random puts, gets and lookups of prefixes of one shared key universe; every load checked.

    A put writes chunks ``k .. k+n-1`` into source slots and stores them. A get asks
    for the same kind of run into cleared destination slots: the leading ``retrieved``
    must hold exactly their chunks, the rest must still be zero.
    """
    torch.set_num_threads(1)
    model = Model(**spec["model"])
    rng = random.Random(spec["seed"])
    universe, requests = spec["universe"], spec["requests"]
    engine = Engine(model, socket_path, bytes.fromhex(spec["namespace"]))
    half = model.slots() // 2
    report: dict[str, Any] = {
        "puts": 0,
        "gets": 0,
        "lookups": 0,
        "stored": 0,
        "present": 0,
        "dropped": 0,
        "retrieved": 0,
        "hits": 0,
        "mismatches": 0,
        "errors": [],
    }
    _send(conn, {"ready": True})
    conn.recv_bytes()  # go
    started = time.perf_counter()
    for i in range(requests):
        n = rng.randint(1, min(4, half))
        k = rng.randrange(universe - n + 1)
        run = list(range(k, k + n))
        try:
            roll = rng.random()
            if roll < 0.45:
                for j, kk in enumerate(run):
                    engine.write(j, kk)
                r = engine.client.put(
                    engine.ctx, [(key(kk), [model.blocks_of(j)]) for j, kk in enumerate(run)]
                )
                report["puts"] += 1
                for name in ("stored", "present", "dropped"):
                    report[name] += getattr(r, name)
            elif roll < 0.9:
                for j in range(n):
                    engine.clear(half + j)
                got = engine.client.get(
                    engine.ctx, [(key(kk), [model.blocks_of(half + j)]) for j, kk in enumerate(run)]
                )
                report["gets"] += 1
                report["retrieved"] += got.retrieved
                for j, kk in enumerate(run):
                    if not engine.check(half + j, kk if j < got.retrieved else None):
                        report["mismatches"] += 1
            else:
                report["lookups"] += 1
                report["hits"] += engine.client.lookup(engine.namespace, [key(kk) for kk in run])
        except Exception as exc:  # reported to the test, which fails on any
            report["errors"].append(f"request {i}: {type(exc).__name__}: {exc}")
    report["seconds"] = time.perf_counter() - started
    engine.close()
    _send(conn, report)


def store_then_load_client(conn: Connection, socket_path: str, spec: dict[str, Any]) -> None:
    """Store this client's keys (and the shared ones), then load every key any client stored.

    Between the two phases the test waits for every client, so the load phase must find
    every key: nothing stored may be lost while the cap is not reached.
    """
    torch.set_num_threads(1)
    model = Model(**spec["model"])
    engine = Engine(model, socket_path, bytes.fromhex(spec["namespace"]))
    mine, everyone = spec["keys"], spec["all_keys"]
    report: dict[str, Any] = {
        "stored": 0,
        "present": 0,
        "dropped": 0,
        "retrieved": 0,
        "missing": 0,
        "mismatches": 0,
        "errors": [],
    }
    _send(conn, {"ready": True})
    conn.recv_bytes()
    batch = model.slots() // 2
    try:
        for start in range(0, len(mine), batch):
            run = mine[start : start + batch]
            for j, kk in enumerate(run):
                engine.write(j, kk)
            r = engine.client.put(engine.ctx, [(key(kk), [model.blocks_of(j)]) for j, kk in enumerate(run)])
            for name in ("stored", "present", "dropped"):
                report[name] += getattr(r, name)
    except Exception as exc:
        report["errors"].append(f"store: {type(exc).__name__}: {exc}")
    _send(conn, {"stored": True})
    conn.recv_bytes()  # every client has stored
    try:
        for start in range(0, len(everyone), batch):
            run = everyone[start : start + batch]
            for j in range(len(run)):
                engine.clear(batch + j)
            got = engine.client.get(
                engine.ctx, [(key(kk), [model.blocks_of(batch + j)]) for j, kk in enumerate(run)]
            )
            report["retrieved"] += got.retrieved
            report["missing"] += len(run) - got.retrieved
            for j, kk in enumerate(run[: got.retrieved]):
                if not engine.check(batch + j, kk):
                    report["mismatches"] += 1
    except Exception as exc:
        report["errors"].append(f"load: {type(exc).__name__}: {exc}")
    engine.close()
    _send(conn, report)


def reader_client(conn: Connection, socket_paths: list[str], spec: dict[str, Any]) -> None:
    """Throughput: register with every server, store a few big chunks in each once, then on
    each ``read`` (``support.commands``, ``server=i``) load them ``requests`` times from server ``i``.

    One process serves every round, so rounds against different servers differ only in
    the server. Every loaded chunk is checked after each round.
    """
    torch.set_num_threads(1)
    model = Model(**spec["model"])
    first = Engine(model, socket_paths[0], bytes.fromhex(spec["namespace"]))
    engines = [first, *(first.also(path) for path in socket_paths[1:])]
    base, n, per_request = spec["first_key"], spec["chunks"], spec["per_request"]
    half = model.slots() // 2
    for j in range(n):
        first.write(j, base + j)
    for e in engines:
        e.client.put(e.ctx, [(key(base + j), [model.blocks_of(j)]) for j in range(n)])
    _send(conn, {"ready": True})

    def read(server: int) -> dict[str, Any]:
        engine = engines[server]
        errors, moved, mismatches = [], 0, 0
        started = time.perf_counter()
        for i in range(spec["requests"]):
            js = [(i * per_request + m) % n for m in range(per_request)]
            try:
                got = engine.client.get(
                    engine.ctx, [(key(base + j), [model.blocks_of(half + j)]) for j in js]
                )
                moved += got.bytes
            except Exception as exc:
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - started
        for j in range(n):
            mismatches += not first.check(half + j, base + j)
            first.clear(half + j)
        return {
            "seconds": seconds,
            "bytes": moved,
            "mismatches": mismatches,
            "errors": errors[:5],
            "error_count": len(errors),
        }

    serve_commands(PipeChannel(conn), {"read": read})
    for e in reversed(engines):
        e.close()

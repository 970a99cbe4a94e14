"""Entry points of the processes the reliability tests spawn.

They talk to the test over a ``multiprocessing`` pipe with ``send_bytes`` only:
JSON for control, :mod:`lmcache_platform.wire` bytes for wrappers. Nothing
received from another process is unpickled.
"""

from __future__ import annotations

import json
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def _recv(conn: Connection) -> Any:
    return json.loads(conn.recv_bytes())


# -- case 5: each spawned worker resolves on its own ---------------------------------------


def resolve_worker(conn: Connection, wrappers: bytes, checksum: float) -> None:
    """Resolve ``cpu`` from metadata here, decode the parent's wrappers, check their bytes."""
    import importlib_metadata

    fresh = {
        "backend_module_loaded": "lmcache_platform_cpu._wrapper" in sys.modules,
        "torch_loaded": "torch" in sys.modules,
    }
    scans: list[int] = []
    real = importlib_metadata.distributions

    def counting(**kw: Any) -> Any:
        scans.append(1)
        return real(**kw)

    importlib_metadata.distributions = counting

    import lmcache_platform as lp
    from lmcache_platform import wire
    from lmcache_platform._plugins.registry import selected_backend

    factory = lp.get_kv_wrapper_factory("cpu")
    decoded = wire.decode(wrappers)  # the default allow-list: this process's own resolution
    views = [w.to_tensor() for w in decoded]
    total = float(sum(v.double().sum().item() for v in views))
    try:
        lp.get_kv_wrapper_factory("relworker")  # registered by hand in the parent only
        parent_state_leaked = True
    except lp.BackendNotFoundError:
        parent_state_leaked = False
    info = selected_backend("cpu")
    del views
    for w in decoded:
        w.close()
    _send(
        conn,
        {
            "pid": os.getpid(),
            **fresh,
            "scans": len(scans),
            "factory": factory.__qualname__,
            "backend": [info.name, info.distribution],
            "checksum_ok": total == checksum,
            "parent_state_leaked": parent_state_leaked,
        },
    )


# -- case 4: a consumer process that reopens and closes, reporting its own resources ---------


def reopen_consumer(conn: Connection) -> None:
    """Reopen the wrappers of each ``reopen`` (``support.commands``), touch every byte, close;
    ``mark`` records fds/maps/RSS, ``exit`` answers every mark."""
    import gc

    from lmcache_platform import wire
    from support.commands import PipeChannel, serve_commands
    from support.reliability import Resources

    channel = PipeChannel(conn)
    channel.send({"ready": True})
    marks: dict[str, Any] = {}
    done = 0

    def reopen(data: str) -> dict[str, float]:
        nonlocal done
        wrappers = wire.decode(bytes.fromhex(data))
        views = [w.to_tensor() for w in wrappers]
        total = float(sum(v.double().sum().item() for v in views))
        del views
        for w in wrappers:
            w.close()
        done += 1
        return {"checksum": total}

    def mark() -> dict[str, int]:
        gc.collect()
        marks[str(done)] = Resources.of().__dict__
        return {"marked": done}

    serve_commands(channel, {"reopen": reopen, "mark": mark, "exit": lambda: {"marks": marks, "done": done}})


# -- case 4: a producer that gets SIGKILLed -------------------------------------------------


def doomed_producer(conn: Connection, layers: int) -> None:
    """Wrap a model's KV caches, report the segment names, then wait to be killed."""
    import torch

    import lmcache_platform as lp

    tensors = [torch.full((2, 16, 4, 2, 8), float(i), dtype=torch.float16) for i in range(layers)]
    wrappers = lp.wrap_kv_caches(tensors)
    _send(conn, {"pid": os.getpid(), "names": [w.shm_name for w in wrappers]})  # type: ignore[attr-defined]
    while True:
        time.sleep(60)


# -- case 6: an engine client under load ----------------------------------------------------

LOAD_BLOCKS, LOAD_BLOCK, LOAD_HEADS = 64, 4, 2
LOAD_CHUNK = 8  # tokens: two blocks per chunk
LOAD_CHUNK_IDS = 8  # chunk ids each client cycles through (bounded server memory)


def load_client(
    conn: Connection, socket_path: str, client_id: int, requests: int, seed: int, layers: int, head: int
) -> None:
    """Register a small model, then alternate store and retrieve, checking every byte.

    Store: fresh random bytes into a source block pair, store them as chunk ``c``
    (the bytes are remembered). Retrieve: a random stored chunk into a destination
    pair, compared byte for byte with what was stored. Afterwards: unregister and
    report counts, bytes moved and any mismatch.
    """
    import torch

    import lmcache_platform as lp
    from lmcache_platform import KVFormat, LayoutHints
    from lmcache_platform.server import ServerClient

    torch.set_num_threads(1)  # eight clients on a few cores: no intra-op oversubscription
    gen = torch.Generator().manual_seed(seed)
    shape = (2, LOAD_BLOCKS, LOAD_BLOCK, LOAD_HEADS, head)
    tensors = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]
    wrappers = lp.wrap_kv_caches(tensors)
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=LOAD_BLOCK, num_kv_heads=LOAD_HEADS)
    stored: dict[str, list[torch.Tensor]] = {}
    mismatches, errors, stores, retrieves, moved = 0, [], 0, 0, 0
    blocks_per_chunk = LOAD_CHUNK // LOAD_BLOCK
    _send(conn, {"ready": True})
    _recv(conn)  # go: every client starts together
    started = time.perf_counter()
    with ServerClient(socket_path, timeout=120) as client:
        ctx = client.register(wrappers, lmcache_tokens_per_chunk=LOAD_CHUNK, layout_hints=hints).context
        for i in range(requests):
            try:
                if i % 2 == 0 or not stored:
                    cid = f"c{(i // 2) % LOAD_CHUNK_IDS}"
                    src = [2 * ((i // 2) % 16) + b for b in range(blocks_per_chunk)]
                    for t in tensors:
                        raw = torch.randint(
                            -(2**15), 2**15, t[:, src].shape, dtype=torch.int16, generator=gen
                        )
                        t[:, src] = raw.view(torch.bfloat16)
                    moved += client.store(ctx, [(cid, [src])])
                    stored[cid] = [t[:, src].clone() for t in tensors]
                    stores += 1
                else:
                    cid = sorted(stored)[int(torch.randint(len(stored), (1,), generator=gen))]
                    dst = [32 + 2 * ((i // 2) % 16) + b for b in range(blocks_per_chunk)]
                    for t in tensors:
                        t[:, dst] = 0
                    moved += client.retrieve(ctx, [(cid, [dst])])
                    retrieves += 1
                    for t, want in zip(tensors, stored[cid], strict=True):
                        if not torch.equal(t[:, dst].view(torch.int16), want.view(torch.int16)):
                            mismatches += 1
            except Exception as exc:  # reported to the test, which fails on any
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")
        elapsed = time.perf_counter() - started
        client.unregister(ctx)
    for w in wrappers:
        w.close()
    _send(
        conn,
        {
            "client": client_id,
            "stores": stores,
            "retrieves": retrieves,
            "bytes": moved,
            "mismatches": mismatches,
            "errors": errors[:5],
            "error_count": len(errors),
            "seconds": elapsed,
        },
    )

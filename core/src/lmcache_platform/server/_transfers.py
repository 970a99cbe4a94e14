"""Moving chunks between an engine's paged blocks and the chunk index, under deadlines.

The data path of the reference server: a registered context (:class:`Entry`), the
checks every chunk passes before any chunk moves (:func:`check`: a bad request writes
nothing), and the two moves of checked chunks, each one call into the context:
:func:`gather` (a store: ``read_chunks``, then a commit into the index) and
:func:`scatter` (a load: pinned chunks through ``write_chunks``). The context waits
for the engine's event itself. Chunks the remote tier holds come in through
:func:`fetch_remote`.

Deadlines: a request may carry ``deadline`` (``time.monotonic_ns()``; client and
server share the host's clock). Work whose deadline has passed is not done: a request
is dropped if it is late when read, a transfer checks again under its context's lock
before each batch of writes into the engine's blocks, and a store checks after its
reads, before it commits (a late store commits nothing). So an engine that stopped
waiting is never written into afterwards. Remote calls get a share of what is left.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._errors import LMCachePlatformError, TransferError
from ..protocol._ops import Chunk
from ..remote._entry import TensorSpec
from ._index import ChunkIndex, Reservation, StoredChunk
from ._namespaces import show_name

if TYPE_CHECKING:
    import torch

    from .._kv.context import BaseCacheContext
    from .._kv.plan import CheckedChunk
    from ..remote._chain import RemoteChain
    from ..remote._tier import RemoteTier


class DeadlineExceeded(LMCachePlatformError):
    """A request's deadline passed before (or while) the server did its work.

    It travels as an error reply of type ``"DeadlineExceeded"``
    (:data:`~lmcache_platform.server._messages.DEADLINE_EXCEEDED`); what was not done
    by then was not done at all: a late store commits nothing.
    """


def check_deadline(deadline: int | None, what: str) -> None:
    """Raise :class:`DeadlineExceeded` if ``deadline`` (monotonic ns) has passed."""
    if deadline is not None:
        late = time.monotonic_ns() - deadline
        if late > 0:
            raise DeadlineExceeded(f"deadline passed {late / 1e6:.1f} ms ago, {what}")


@dataclass(eq=False)
class Entry:
    """One registered cache context."""

    context: int
    ctx: BaseCacheContext
    device_type: str
    #: The namespace of its keyed chunks; empty when registered without one.
    namespace: bytes
    #: Bytes of one chunk in host memory (all object groups).
    chunk_bytes: int
    #: Held for each transfer on this context: its staging slots are not shareable.
    lock: threading.Lock
    #: Its namespace's name in the remote tier (``remote_namespace``); empty without one.
    remote_ns: bytes = b""
    #: How far the server got mapping the engine's memory (``prefault``): ``status`` shows it.
    engine_memory: dict[str, Any] = field(default_factory=lambda: {"state": "mapping"})


def gather(
    index: ChunkIndex,
    entry: Entry,
    chunks: Sequence[Chunk],
    checked: Sequence[CheckedChunk],
    res: Reservation,
    deadline: int | None = None,
    event: bytes = b"",
) -> list[tuple[list[torch.Tensor], int]]:
    """Copy the reserved chunks out of the engine's blocks, then commit them. Caller holds entry.lock.

    ``checked[i]`` is ``chunks[i]``'s ids (:func:`check`). Each chunk is read into fresh
    host tensors (one pass on the host); with an ``event``, the reads wait for it on the
    device first. Past ``deadline`` once the copies are done, nothing is committed: the
    engine may have reused its blocks meanwhile, so what was read is not trusted.
    Returns ``(tensors, nbytes)`` per reserved key, in order.
    """
    todo = set(res.keys)
    payloads: list[tuple[list[torch.Tensor], int]] = []
    try:
        mine = [ids for c, ids in zip(chunks, checked, strict=True) if c.chunk_id in todo]
        read = entry.ctx.read_chunks(mine, event=event)
        payloads = [(tensors, sum(t.nbytes for t in tensors)) for tensors in read]
        check_deadline(deadline, "after the store's reads; nothing was committed")
    except BaseException:
        index.abort(res)
        raise
    index.commit(res, payloads)  # readable only once every byte has landed
    return payloads


def scatter(
    index: ChunkIndex,
    entry: Entry,
    checked: Sequence[CheckedChunk],
    held: Sequence[StoredChunk],
    deadline: int | None = None,
    event: bytes = b"",
) -> int:
    """Write pinned chunks into the engine's blocks (``checked[i]``: ``held[i]``'s), then unpin them.

    Caller holds entry.lock. Each chunk is written straight from its host tensors on
    the host (one pass); with an ``event``, the writes wait for it on the device first.
    Before each batch of writes, :class:`DeadlineExceeded` once ``deadline`` has passed:
    the engine no longer waits for those blocks. Earlier batches stay written.
    """
    total = 0
    try:

        def before_batch(done: int) -> None:
            check_deadline(deadline, f"after {done} of {len(held)} chunks were written")

        entry.ctx.write_chunks(
            [(ids, stored.payload) for ids, stored in zip(checked, held, strict=True)],
            event=event,
            before_batch=before_batch,
        )
        total = sum(host.nbytes for stored in held for host in stored.payload)
    finally:
        index.release(held)
    return total


def num_object_groups(ctx: BaseCacheContext) -> int:
    return int(ctx.kv_layer_groups_manager.num_object_groups)


def chunk_names(chunks: Sequence[Chunk]) -> list[str | bytes]:
    return [c.chunk_id for c in chunks]


def content_key(chunk_id: Hashable) -> bytes:
    """A content key (``put``/``get`` chunks carry bytes; the protocol checks it)."""
    assert isinstance(chunk_id, bytes), chunk_id
    return chunk_id


def namespace_of(entry: Entry, op: str) -> bytes:
    if not entry.namespace:
        raise TransferError(
            f"{op}: context {entry.context} was registered without a namespace; "
            "keyed chunks need one (register with namespace=...)"
        )
    return entry.namespace


def check_unique(chunks: Sequence[Chunk]) -> None:
    seen: set[str | bytes] = set()
    for c in chunks:
        if c.chunk_id in seen:
            raise TransferError(f"{show_name(c.chunk_id)} appears twice in one request")
        seen.add(c.chunk_id)


def check(entry: Entry, chunks: Sequence[Chunk], *, retrieve: bool) -> list[CheckedChunk]:
    """Every chunk's ids checked before any chunk moves, so a bad request writes nothing."""
    ids = [c.block_ids for c in chunks]
    return entry.ctx.check_chunks(ids, retrieve=retrieve, name=lambda i: show_name(chunks[i].chunk_id))


#: The share of a request's time left that a remote call may use: the rest answers the engine.
REMOTE_SHARE = 0.8


def remote_share(deadline: int | None) -> int | None:
    """The deadline of a remote call made for a request due at ``deadline`` (``None``: the tier's own)."""
    if deadline is None:
        return None
    now = time.monotonic_ns()
    return now + int(max(deadline - now, 0) * REMOTE_SHARE)


def fetch_remote(
    tier: RemoteTier | RemoteChain, entry: Entry, chunks: Sequence[Chunk], deadline: int | None
) -> list[tuple[Hashable, Sequence[Any], int]]:
    """The leading run of ``chunks`` the remote tier holds, in fresh chunk memory of ``entry``'s context.

    Each entry is checked against the context's chunk (one uint8 tensor per object
    group, of its size) besides its identity and checksum; the first chunk the store
    lacks, refuses or loses ends the run. Returns ``(key, tensors, nbytes)`` per chunk.
    """
    keys = [content_key(c.chunk_id) for c in chunks]
    expect = [TensorSpec("uint8", (n,)) for n in entry.ctx.chunk_nbytes]
    fetched = tier.fetch(entry.remote_ns, keys, remote_share(deadline), expect, into=entry.ctx.allocate_chunk)
    items: list[tuple[Hashable, Sequence[Any], int]] = []
    for key, decoded in zip(keys, itertools.takewhile(lambda d: d is not None, fetched), strict=False):
        assert decoded is not None
        if decoded.placed:  # read straight into chunk memory (a disk tier)
            items.append((key, decoded.tensors, decoded.nbytes))
            continue
        tensors = entry.ctx.allocate_chunk()  # pool memory, like a put's: the fetched bytes go
        for dst, src in zip(tensors, decoded.tensors, strict=True):
            dst.copy_(src)
        items.append((key, tensors, decoded.nbytes))
    return items

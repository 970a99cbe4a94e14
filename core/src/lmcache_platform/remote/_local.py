"""Fetches from a store of independent local items (``parallel_items``: a disk).

Each entry is read and checked on a thread of its own, so one entry's checksum runs while
the next one is read; with the store's ``get_many_into`` and a maker of host tensors
(``RemoteTier.fetch(into=...)``), an entry is read straight into those tensors and checked
in place (:func:`~lmcache_platform.remote._entry.decode_placed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, TypeVar

from . import _entry
from ._entry import Decoded, EntryIdentity, Refused, TensorSpec
from ._store import Buffer, RemoteStore

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class RemoteTier(Protocol):
    """What these fetches use of :class:`~lmcache_platform.remote.RemoteTier`, declared here
    so that this module, which the tier calls, does not import it back."""

    store: RemoteStore
    prefix: bytes
    _secret: bytes | None

    def store_key(self, namespace: bytes, key: bytes) -> bytes: ...

    def _call(
        self, what: str, deadline: int | None, fn: Callable[[float], list[T]], n: int
    ) -> tuple[list[T], frozenset[int]] | None: ...

    def _decode(
        self, namespace: bytes, key: bytes, value: Buffer, expect: Sequence[TensorSpec] | None
    ) -> Decoded | None: ...

    def _add(self, **counts: int) -> None: ...

    def _refused(self, exc: Refused, key: bytes) -> None: ...

    def _item_pool(self) -> ThreadPoolExecutor: ...

    def _remove(self, namespace: bytes, keys: Sequence[bytes], deadline: int | None) -> None: ...


def fetch_each(
    tier: RemoteTier,
    namespace: bytes,
    keys: Sequence[bytes],
    deadline: int | None,
    expect: Sequence[TensorSpec] | None,
    into: Callable[[], Sequence[torch.Tensor]] | None = None,
) -> list[Decoded | None]:
    """:meth:`RemoteTier.fetch` from a store whose items are independent (``parallel_items``: a local
    disk): each entry read and checked on its own decoder thread, so one entry's checksum
    runs while the next one is read; with ``into``, read in place (:func:`fetch_placed`)."""

    def one(key: bytes) -> tuple[bool, Decoded | None]:
        if into is not None and expect is not None:
            placed = fetch_placed(tier, namespace, key, deadline, expect, into)
            if placed is not None:
                return placed
        answer = tier._call(
            "fetch",
            deadline,
            lambda t: tier.store.get_many([tier.store_key(namespace, key)], timeout=t),
            1,
        )
        if answer is None or answer[0][0] is None:
            if answer is not None and not answer[1]:
                tier._add(fetch_misses=1)
            return False, None
        return True, tier._decode(namespace, key, answer[0][0], expect)

    got = list(tier._item_pool().map(one, keys))
    refused = [k for k, (found, d) in zip(keys, got, strict=True) if found and d is None]
    if refused:
        tier._remove(namespace, refused, deadline)
    return [d for _, d in got]


def fetch_placed(
    tier: RemoteTier,
    namespace: bytes,
    key: bytes,
    deadline: int | None,
    expect: Sequence[TensorSpec],
    into: Callable[[], Sequence[torch.Tensor]],
) -> tuple[bool, Decoded | None] | None:
    """One entry read straight into tensors ``into`` makes (the store's ``get_many_into``):
    ``(found, decoded)``, or ``None`` when it is not of the planned layout (read it whole)."""
    dests = list(into())
    if [_entry.spec_of(t) for t in dests] != [TensorSpec(e.dtype, tuple(e.shape)) for e in expect]:
        return None
    who = EntryIdentity(tier.prefix, namespace, key)
    header_len, offsets, payload_len = _entry.plan(who, expect, tier._secret)
    header = bytearray(header_len)
    pieces: list[memoryview] = []
    prev = 0
    for t, off in zip(dests, offsets, strict=True):
        if off > prev:
            pieces.append(memoryview(bytearray(off - prev)))  # the padding, read and checked too
        if t.nbytes:
            pieces.append(_entry.byte_view(t))
        prev = off + int(t.nbytes)
    store_key = tier.store_key(namespace, key)
    get_into = tier.store.get_many_into  # type: ignore[attr-defined]
    answer = tier._call("fetch", deadline, lambda t: get_into([store_key], [[header, *pieces]], timeout=t), 1)
    if answer is None or answer[0][0] is None:
        if answer is not None and not answer[1]:
            tier._add(fetch_misses=1)
        return False, None
    if answer[0][0] != header_len + payload_len:
        return None
    try:
        chunk = _entry.decode_placed(header, pieces, dests, who, tier._secret, expect)
    except Refused as exc:
        tier._refused(exc, key)
        return True, None
    tier._add(fetched=1, bytes_fetched=chunk.nbytes, fetched_v1=int(chunk.version == 1))
    return True, chunk._replace(placed=True)

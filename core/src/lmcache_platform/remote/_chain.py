"""Tiers in a chain: ``serve --remote URL --remote URL ...``, tried in the order given.

A chain is what the server holds in place of one :class:`RemoteTier`, with the same
calls, so the server has one code path for one store or several:

* **lookups** ask each tier in turn for the keys after what the tiers before it hold,
  and add up the leading run;
* **fetches** take each key from the first tier that has it; a chunk found in a lower
  tier is queued for the tiers above it (write-behind, never waited for), so the next
  fetch finds it nearer;
* **stores** go to every tier, each through its own bounded write-behind queue;
* **stats** sum the tiers' counters (the unlabelled metrics) and list each tier's own
  under ``tiers`` (the ``tier``-labelled metrics); ``state`` is the first tier's.

A tier that is down answers nothing and takes nothing (its own policy): the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ._entry import Decoded, TensorSpec
    from ._store import RemoteOptions
    from ._tier import RemoteTier


class RemoteChain:
    """Several :class:`RemoteTier`, nearest first, behind the calls of one."""

    def __init__(self, tiers: Sequence[RemoteTier]) -> None:
        if not tiers:
            raise ValueError("a chain needs at least one tier")
        self.tiers = list(tiers)
        self.name = " -> ".join(t.name for t in self.tiers)

    # the attributes serve logs at start: the first tier's
    @property
    def prefix(self) -> bytes:
        return self.tiers[0].prefix

    @property
    def queue_bytes(self) -> int:
        return sum(t.queue_bytes for t in self.tiers)

    @property
    def keyed(self) -> bool:
        return all(t.keyed for t in self.tiers)

    @property
    def state(self) -> str:
        return self.tiers[0].state

    def lookup_more_many(
        self, asks: Sequence[tuple[bytes, Sequence[bytes]]], deadline: int | None = None
    ) -> list[int]:
        totals = [0] * len(asks)
        for tier in self.tiers:
            rest = [(ns, keys[totals[i] :]) for i, (ns, keys) in enumerate(asks)]
            if not any(keys for _, keys in rest):
                break
            more = tier.lookup_more_many(rest, deadline)
            totals = [t + m for t, m in zip(totals, more, strict=True)]
            if all(t == len(keys) for t, (_, keys) in zip(totals, asks, strict=True)):
                break
        return totals

    def lookup_more(self, namespace: bytes, keys: Sequence[bytes], deadline: int | None = None) -> int:
        return self.lookup_more_many([(namespace, keys)], deadline)[0]

    def fetch(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        deadline: int | None = None,
        expect: Sequence[TensorSpec] | None = None,
        into: Callable[[], Sequence[torch.Tensor]] | None = None,
    ) -> list[Decoded | None]:
        out: list[Decoded | None] = [None] * len(keys)
        for depth, tier in enumerate(self.tiers):
            missing = [i for i, d in enumerate(out) if d is None]
            if not missing or (deadline is not None and time.monotonic_ns() >= deadline):
                break
            got = tier.fetch(namespace, [keys[i] for i in missing], deadline, expect, into)
            for i, decoded in zip(missing, got, strict=True):
                if decoded is None:
                    continue
                out[i] = decoded
                for above in self.tiers[:depth]:  # nearer next time
                    above.write_behind(namespace, keys[i], decoded.tensors)
        return out

    def write_behind(self, namespace: bytes, key: bytes, tensors: Sequence[torch.Tensor]) -> bool:
        taken = [tier.write_behind(namespace, key, tensors) for tier in self.tiers]
        return any(taken)

    def stats(self) -> dict[str, Any]:
        per = [{"store": t.name, **t.stats()} for t in self.tiers]
        out: dict[str, Any] = {"state": self.state}
        for stats in per:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[key] = out.get(key, 0) + value
        out["tiers"] = per
        return out

    def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        return all(t.wait_ready(max(end - time.monotonic(), 0.0)) for t in self.tiers)

    def flush(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        return all(t.flush(max(end - time.monotonic(), 0.0)) for t in self.tiers)

    def close(self, timeout: float = 5.0) -> None:
        """Each tier writes what is queued (the whole chain within ``timeout``), then closes."""
        end = time.monotonic() + timeout
        for tier in self.tiers:
            tier.close(max(end - time.monotonic(), 0.1))


def open_chain(
    urls: Sequence[str],
    options: RemoteOptions | None = None,
    *,
    key_file: str | None = None,
    prefix: str | None = None,
    ttl_s: float | None = None,
    queue_bytes: int | None = None,
    call_timeout_s: float | None = None,
) -> RemoteTier | RemoteChain:
    """The tier at ``urls[0]``, or a chain nearest first for several, every one with the same
    key, prefix and bounds (so a chunk moves between them unchanged).

    What ``serve --remote URL ...`` opens, and a vLLM tier's ``"remote"`` key: one place for
    both. Nothing waits on the network (a store that is down is probed in the background);
    a tier opened before a later one fails is closed again. Raises
    :class:`~lmcache_platform.remote.RemoteConfigError` (a URL given twice, an unknown
    scheme, an unreadable secret) or
    :class:`~lmcache_platform.remote.RemoteStoreLoadError` (the store's plugin is broken).
    """
    from ._errors import RemoteConfigError
    from ._tier import DEFAULT_CALL_TIMEOUT_S, DEFAULT_QUEUE_BYTES, RemoteTier

    if not urls:
        raise RemoteConfigError("no remote URL given")
    if len(set(urls)) != len(urls):
        raise RemoteConfigError("--remote: the same URL is given twice")
    tiers: list[RemoteTier] = []
    try:
        for url in urls:
            tiers.append(
                RemoteTier.open(
                    url,
                    options,
                    key_file=key_file,
                    prefix=prefix or "lmcache",
                    ttl_s=ttl_s,
                    queue_bytes=queue_bytes or DEFAULT_QUEUE_BYTES,
                    call_timeout_s=call_timeout_s or DEFAULT_CALL_TIMEOUT_S,
                )
            )
    except BaseException:
        for tier in tiers:
            tier.close(0.1)
        raise
    return tiers[0] if len(tiers) == 1 else RemoteChain(tiers)

"""The small engine KV the layout tests share: its sizes, random bytes over it, a host context on it.

One set of sizes keeps the hand-indexed references of every layout test module alike;
random bytes (not zeros) make a transfer that moved the wrong rows visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_platform import CacheContextConfig
from support.cache import HeldWrapper, HostContext

#: Blocks, tokens a block, KV heads, head size, layers.
NB, BS, H, D, L = 10, 4, 2, 8, 3
#: Tokens a chunk: two blocks.
CHUNK = 2 * BS
#: Current vLLM's six physical orders of its ``[L, B, H, N, C]`` KV.
ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def planes(layers: Sequence[Any]) -> list[tuple[torch.Tensor, ...]]:
    """Each layer as the tuple of its tensors (one, or a K/V pair)."""
    return [entry if isinstance(entry, tuple) else (entry,) for entry in layers]


def fill(layers: Sequence[Any], seed: int = 7) -> None:
    """Random bit patterns over every byte of each layer's backing storage (same seed, same bytes)."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for t in (t for entry in planes(layers) for t in entry):
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def host_context(layers: Sequence[Any], **config: Any) -> HostContext:
    """A host context over ``layers`` (tensors or K/V pairs), ``CHUNK`` tokens a chunk unless told."""
    config.setdefault("lmcache_tokens_per_chunk", CHUNK)
    entries = [
        tuple(HeldWrapper.wrap(t) for t in e) if isinstance(e, tuple) else HeldWrapper.wrap(e) for e in layers
    ]
    return HostContext(entries, CacheContextConfig(**config))


__all__ = ["BS", "CHUNK", "NB", "ORDERS", "D", "H", "L", "fill", "host_context", "planes"]

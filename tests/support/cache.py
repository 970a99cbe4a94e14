"""Helpers for the cache-context tests: an in-process wrapper, a host context, KV builders.

``HeldWrapper`` is a test double for the IPC part only (it hands back the very
tensor it wrapped, in this process); everything the cache context does with the
tensor is real torch on the host. Real shared memory is covered by the CPU-backend
tests.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypedDict

import torch

from lmcache_platform import (
    BaseCacheContext,
    CacheContextConfig,
    DeviceIPCWrapper,
    EngineGroupInfo,
    KVFormat,
    LayoutHints,
    WireField,
    allocate_kv_caches,
    kv_cache_shape,
)
from lmcache_platform.conformance._kv import random_bits, token_view


class HeldWrapper(DeviceIPCWrapper):
    """Keeps its tensor in this process; counts reopens and closes."""

    device_type = "cpu"
    wire_tag = "test.held/1"
    wire_fields: ClassVar = {"serial": WireField(int, lo=0)}
    _serial = 0

    def __init__(self, *, serial: int, **base: Any) -> None:
        super().__init__(**base)
        self.serial = serial
        self.tensor: torch.Tensor | None = None
        self.opens = 0
        self.releases = 0
        self.fail_open = False
        self.fail_close = False

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> HeldWrapper:
        HeldWrapper._serial += 1
        w = cls.describe(tensor, device_uuid="cpu", serial=HeldWrapper._serial)
        w.tensor = tensor
        return w

    def to_tensor(self) -> torch.Tensor:
        self.opens += 1
        if self.fail_open:
            raise OSError(f"cannot reopen wrapper {self.serial}")
        assert self.tensor is not None
        return self.tensor

    def release(self) -> None:
        self.releases += 1
        if self.fail_close:
            raise OSError(f"cannot release wrapper {self.serial}")


class HostContext(BaseCacheContext):
    """The base machinery on the host, as a backend would subclass it."""

    device_type = "cpu"


#: Shapes per format, in terms of (num_blocks, block_size, heads, head_size).
def layer_shape(fmt: KVFormat, nb: int, bs: int, h: int, d: int) -> tuple[int, ...]:
    return kv_cache_shape(fmt, num_blocks=nb, block_size=bs, num_kv_heads=h, head_size=d)


#: Random bit patterns of a dtype from a generator: the conformance kit's helper.
random_bytes = random_bits


def make_layers(
    fmt: KVFormat,
    num_layers: int,
    *,
    nb: int = 12,
    bs: int = 4,
    h: int = 2,
    d: int = 8,
    dtype: torch.dtype = torch.float16,
    shared: bool = False,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Per-layer KV tensors in ``fmt``: separate allocations, or views of one (``shared``)."""
    gen = torch.Generator().manual_seed(seed)
    shape = layer_shape(fmt, nb, bs, h, d)
    if shared:
        whole = random_bytes((num_layers, *shape), dtype, gen)
        return list(whole.unbind(0))
    return [random_bytes(shape, dtype, gen) for _ in range(num_layers)]


def engine_kv(
    fmt: KVFormat,
    layers: int,
    blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float16,
    *,
    device: str | torch.device = "cpu",
    order: str | None = None,
) -> list[Any]:
    """:func:`lmcache_platform.allocate_kv_caches`, sizes in the order of the letters L, B, N, H, C.

    One line a call where a test allocates engine KV of its module's sizes; for the vLLM
    formats each entry is one layer's tensor (:func:`engine_views`).
    """
    sizes = Sizes(
        num_layers=layers, num_blocks=blocks, block_size=block_size, num_kv_heads=heads, head_size=head_size
    )
    return allocate_kv_caches(fmt, **sizes, dtype=dtype, device=device, engine_layout=order)


def engine_views(*sizes: Any, **kw: Any) -> list[torch.Tensor]:
    """:func:`engine_kv` of vLLM's format: one tensor a layer (views of one allocation)."""
    views = engine_kv(KVFormat.VLLM, *sizes, **kw)
    if not all(isinstance(v, torch.Tensor) for v in views):  # the format's contract: one tensor a layer
        raise TypeError(f"allocate_kv_caches(VLLM) returned {[type(v).__name__ for v in views]}")
    return views


class Sizes(TypedDict):
    """The sizes :func:`lmcache_platform.allocate_kv_caches` takes as keywords."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int


def context(
    tensors: list[torch.Tensor],
    *,
    cls: type[BaseCacheContext] = HostContext,
    **config: Any,
) -> BaseCacheContext:
    config.setdefault("lmcache_tokens_per_chunk", 16)
    if "engine_group_infos" in config:
        config["engine_group_infos"] = tuple(config["engine_group_infos"])
    return cls([HeldWrapper.wrap(t) for t in tensors], CacheContextConfig(**config))


def hybrid(
    *, nb: int, bs: int, window: int, seed: int = 0, **config: Any
) -> tuple[BaseCacheContext, list[torch.Tensor]]:
    """A context over two engine groups, and its layers: 0 and 2 full attention
    (flash-attn, one allocation a layer), 1 and 3 a ``window``-token sliding window
    (FlashInfer HND, views of one allocation). ``config``: more of the context's."""
    fa = make_layers(KVFormat.FLASH_ATTN, 2, nb=nb, bs=bs, seed=seed)
    sw = make_layers(KVFormat.FLASHINFER_HND, 2, nb=nb, bs=bs, seed=seed + 1, shared=True)
    layers = [fa[0], sw[0], fa[1], sw[1]]
    infos = [
        EngineGroupInfo(layer_indices=[0, 2], block_size=bs),
        EngineGroupInfo(layer_indices=[1, 3], block_size=bs, sliding_window=window),
    ]
    ctx = context(layers, engine_group_infos=infos, layout_hints=LayoutHints(num_kv_heads=2), **config)
    return ctx, layers


def token_rows(t: torch.Tensor, fmt: KVFormat, block: int, lo: int, hi: int) -> torch.Tensor:
    """Reference: tokens ``[lo, hi)`` of ``block`` as ``[kv, tokens, hidden]``.

    The conformance kit's hand-indexed reference (independent of the layout model under
    test), flattened; the slot formats use :func:`slot_rows`.
    """
    rows = token_view(t, fmt, block, lo, hi)
    return rows.reshape(rows.shape[0], hi - lo, -1)


def slot_rows(planes: tuple[torch.Tensor, ...], page: int, block: int, lo: int, hi: int) -> torch.Tensor:
    """Reference for the slot formats: tokens ``[lo, hi)`` of page ``block``, ``[kv, tokens, hidden]``."""
    start = block * page
    return torch.stack([p[start + lo : start + hi].reshape(hi - lo, -1) for p in planes])


__all__ = [
    "EngineGroupInfo",
    "HeldWrapper",
    "HostContext",
    "LayoutHints",
    "Sizes",
    "context",
    "engine_kv",
    "engine_views",
    "hybrid",
    "layer_shape",
    "make_layers",
    "random_bytes",
    "slot_rows",
    "token_rows",
]

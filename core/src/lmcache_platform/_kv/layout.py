"""KV layout discovery: which :class:`KVFormat` each per-layer tensor uses.

Discovery reads the tensor's *logical* shape (dims in the order the tensor presents
them), decides the format, and extracts ``num_blocks``, ``block_size``,
``num_kv_heads`` and ``head_size``. It never copies or moves memory; strides are
only consulted to break a tie (see :func:`discover_layout`).

Supported per-layer shapes (``H`` = num_kv_heads, ``B`` = block_size, ``D`` = head_size):

==================  ====================================
``FLASH_ATTN``      ``[2, num_blocks, B, H, D]``
``FLASH_ATTN_HND``  ``[2, num_blocks, H, B, D]``
``FLASHINFER``      ``[num_blocks, 2, B, H, D]``
``FLASHINFER_HND``  ``[num_blocks, 2, H, B, D]``
``MLA``             ``[num_blocks, B, D]``
==================  ====================================

Every format has a *canonical view* ``[kv, num_blocks, B, H, D]`` (``kv`` = 2, or 1
for MLA, whose view is ``[1, num_blocks, B, 1, D]``): a strided view of the same
memory in which the transfer code and native kernels can treat all formats alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import LayoutError
from .._types import KVFormat, LayoutHints

if TYPE_CHECKING:
    import torch

#: Permutation taking each 5-D format to the canonical ``[kv, blocks, B, H, D]`` order.
_TO_CANONICAL: dict[KVFormat, tuple[int, ...]] = {
    KVFormat.FLASH_ATTN: (0, 1, 2, 3, 4),
    KVFormat.FLASH_ATTN_HND: (0, 1, 3, 2, 4),
    KVFormat.FLASHINFER: (1, 0, 2, 3, 4),
    KVFormat.FLASHINFER_HND: (1, 0, 3, 2, 4),
}
#: Position of the size-2 K/V dim for the 5-D formats.
_KV_DIM = {
    KVFormat.FLASH_ATTN: 0,
    KVFormat.FLASH_ATTN_HND: 0,
    KVFormat.FLASHINFER: 1,
    KVFormat.FLASHINFER_HND: 1,
}
_HND = {KVFormat.FLASH_ATTN_HND, KVFormat.FLASHINFER_HND}
_NHD_OF_FAMILY = {0: KVFormat.FLASH_ATTN, 1: KVFormat.FLASHINFER}
_HND_OF_FAMILY = {0: KVFormat.FLASH_ATTN_HND, 1: KVFormat.FLASHINFER_HND}

def kv_cache_shape(
    kv_format: KVFormat, *, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """One layer's paged KV-cache shape in ``kv_format``, as an engine allocates it.

    For MLA, ``num_kv_heads`` is ignored and ``head_size`` is the latent width.
    """
    nb, bs, h, d = num_blocks, block_size, num_kv_heads, head_size
    if kv_format is KVFormat.MLA:
        return (nb, bs, d)
    # The canonical order is [kv, blocks, block_size, heads, head]; each permutation
    # is its own inverse, so it also maps canonical sizes back to the format's order.
    canonical = (2, nb, bs, h, d)
    return tuple(canonical[i] for i in _TO_CANONICAL[kv_format])


SHAPES_HELP = (
    "supported per-layer shapes: FLASH_ATTN [2, num_blocks, block_size, num_kv_heads, "
    "head_size], FLASH_ATTN_HND [2, num_blocks, num_kv_heads, block_size, head_size], "
    "FLASHINFER [num_blocks, 2, block_size, num_kv_heads, head_size], FLASHINFER_HND "
    "[num_blocks, 2, num_kv_heads, block_size, head_size], MLA [num_blocks, block_size, "
    "head_size]"
)


class FormatDims:
    """Sizes derived from a KV format and head geometry; shared by layers and groups."""

    kv_format: KVFormat
    num_kv_heads: int
    head_size: int

    @property
    def is_mla(self) -> bool:
        return self.kv_format is KVFormat.MLA

    @property
    def kv_size(self) -> int:
        """2 (K and V planes), or 1 for MLA's single latent plane."""
        return 1 if self.is_mla else 2

    @property
    def hidden_dim(self) -> int:
        """Elements of one token of one plane: ``num_kv_heads * head_size``."""
        return self.num_kv_heads * self.head_size


@dataclass(frozen=True)
class LayerLayout(FormatDims):
    """What discovery learned about one layer's tensor."""

    kv_format: KVFormat
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    #: The tensor's shape and stride as given (in elements).
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _fmt_hint(formats: list[KVFormat]) -> str:
    opts = " or ".join(f"KVFormat.{f.name}" for f in formats)
    return f"LayoutHints(kv_format={opts})"


def _tokens_dim_first(
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    block_size: int | None,
    num_kv_heads: int | None,
) -> bool | None:
    """Decide whether dim 2 (True, NHD) or dim 3 (False, HND) holds the block's tokens.

    Returns None when the evidence cannot decide. Evidence, strongest first: a known
    block size, a known head count, then the strides of a permuted view.
    """
    a, b = shape[2], shape[3]
    for known, tokens_first in ((block_size, True), (num_kv_heads, False)):
        if known is None or a == b:
            continue
        if a == known:
            return tokens_first
        if b == known:
            return not tokens_first
    # Engines build HND memory and present an NHD *logical* view of it (vLLM's
    # kv_cache_stride_order). A view whose dims 2 and 3 are swapped in memory is
    # therefore the logical NHD shape. A dense tensor gives no such evidence.
    if a != 1 and b != 1 and stride[2] < stride[3]:
        return True
    return None


def discover_layout(
    tensor: torch.Tensor,
    *,
    layer: int,
    kv_format: KVFormat | None = None,
    block_size: int | None = None,
    num_kv_heads: int | None = None,
) -> LayerLayout:
    """Discover the layout of layer ``layer``.

    ``kv_format`` (from :class:`LayoutHints`) is checked against the shape and wins.
    Otherwise the rank picks MLA (3-D) or the 5-D family; the position of the
    size-2 dim picks flash-attention (dim 0) or FlashInfer (dim 1); ``block_size``
    (from the hints or the layer's :class:`EngineGroupInfo`) or ``num_kv_heads``
    picks NHD or HND. Without either, a permuted view whose dims 2 and 3 are swapped
    in memory is read as NHD (see :func:`_tokens_dim_first`). Anything still
    undecided raises :class:`LayoutError` naming the hint that settles it.
    """
    shape = tuple(int(s) for s in tensor.shape)
    stride = tuple(int(s) for s in tensor.stride())
    where = f"layer {layer} (shape {list(shape)})"

    def done(fmt: KVFormat) -> LayerLayout:
        if fmt is KVFormat.MLA:
            blocks, bsz, heads, head = shape[0], shape[1], 1, shape[2]
        else:
            kv_dim = _KV_DIM[fmt]
            if shape[kv_dim] != 2:
                raise LayoutError(f"{where}: format {fmt.name} needs size 2 at dim {kv_dim}; {SHAPES_HELP}")
            blocks = shape[1 - kv_dim]
            bsz, heads = (shape[3], shape[2]) if fmt in _HND else (shape[2], shape[3])
            head = shape[4]
        if block_size is not None and bsz != block_size:
            raise LayoutError(
                f"{where}: read as {fmt.name} its block size is {bsz}, but the hints or "
                f"engine group say {block_size}"
            )
        if num_kv_heads is not None and fmt is not KVFormat.MLA and heads != num_kv_heads:
            raise LayoutError(
                f"{where}: read as {fmt.name} it has {heads} KV heads, but the hints say {num_kv_heads}"
            )
        if min(blocks, bsz, heads, head) <= 0:
            raise LayoutError(f"{where}: {fmt.name} layout has an empty dimension")
        return LayerLayout(fmt, blocks, bsz, heads, head, tensor.dtype, shape, stride)

    if kv_format is not None:
        want = 3 if kv_format is KVFormat.MLA else 5
        if len(shape) != want:
            raise LayoutError(
                f"{where}: hinted format {kv_format.name} needs a {want}-D tensor; {SHAPES_HELP}"
            )
        return done(kv_format)
    if len(shape) == 3:
        return done(KVFormat.MLA)
    if len(shape) != 5:
        raise LayoutError(f"{where}: {len(shape)}-D tensor is not a known KV layout; {SHAPES_HELP}")

    families = [d for d in (0, 1) if shape[d] == 2]
    if not families:
        raise LayoutError(f"{where}: neither dim 0 nor dim 1 has size 2 (the K/V planes); {SHAPES_HELP}")
    for name, known in (("block size", block_size), ("KV head count", num_kv_heads)):
        if known is not None and known not in shape[2:4]:
            raise LayoutError(
                f"{where}: the {name} {known} (from the hints or engine group) matches neither "
                f"dim 2 ({shape[2]}) nor dim 3 ({shape[3]}); {SHAPES_HELP}"
            )
    tokens_first = _tokens_dim_first(shape, stride, block_size, num_kv_heads)
    if len(families) == 1 and tokens_first is not None:
        table = _NHD_OF_FAMILY if tokens_first else _HND_OF_FAMILY
        return done(table[families[0]])

    candidates = [
        fmt
        for fam in families
        for fmt in (_NHD_OF_FAMILY[fam], _HND_OF_FAMILY[fam])
        if tokens_first is None or (fmt not in _HND) == tokens_first
    ]
    reasons = []
    if len(families) == 2:
        reasons.append("dims 0 and 1 both have size 2, so num_blocks may be 2")
    if tokens_first is None:
        if shape[2] == shape[3]:
            reasons.append(f"dims 2 and 3 are both {shape[2]}, so tokens and heads look alike")
        else:
            reasons.append(
                f"it is unknown whether dim 2 ({shape[2]}) or dim 3 ({shape[3]}) is the block size"
            )
    fix = _fmt_hint(candidates)
    if len(families) == 1 and shape[2] != shape[3]:
        fix += (
            f", or LayoutHints(block_size=...) / EngineGroupInfo(block_size=...) "
            f"with {shape[2]} or {shape[3]}"
        )
    raise LayoutError(f"{where} is ambiguous: {'; '.join(reasons)}. Pass {fix}.")


def discover_layouts(
    tensors: list[torch.Tensor],
    hints: LayoutHints | None,
    block_sizes: dict[int, int],
) -> list[LayerLayout]:
    """Discover every layer; ``block_sizes`` maps a layer to its engine group's block size.

    A block size stated both in the hints and by the engine group must agree.
    """
    hints = hints or LayoutHints()
    for idx in hints.per_layer:
        if not 0 <= idx < len(tensors):
            raise LayoutError(f"LayoutHints.per_layer names layer {idx}, but there are {len(tensors)} layers")
    out = []
    for i, tensor in enumerate(tensors):
        bsz = block_sizes.get(i)
        if hints.block_size is not None and bsz is not None and bsz != hints.block_size:
            raise LayoutError(
                f"layer {i}: LayoutHints.block_size={hints.block_size} contradicts its engine "
                f"group's block_size={bsz}"
            )
        out.append(
            discover_layout(
                tensor,
                layer=i,
                kv_format=hints.per_layer.get(i, hints.kv_format),
                block_size=bsz if bsz is not None else hints.block_size,
                num_kv_heads=hints.num_kv_heads,
            )
        )
    return out


def canonical_view(tensor: torch.Tensor, kv_format: KVFormat) -> torch.Tensor:
    """The same memory as ``[kv, num_blocks, block_size, num_kv_heads, head_size]``."""
    if kv_format is KVFormat.MLA:
        return tensor.unsqueeze(0).unsqueeze(3)
    return tensor.permute(_TO_CANONICAL[kv_format])

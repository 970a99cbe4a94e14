"""KV layout model: what each axis of a layer's tensor means, and one strided view per plane.

Every supported layout is *data*: a :class:`FormatSpec` naming the meaning of each
axis of the tensor(s) an engine hands over for one layer. Discovery picks the spec
that fits the tensor's shape, the engine type and the hints, reads the sizes off the
shape, and checks them. :func:`plane_views` then turns the layer into one strided view
per plane (K and V, or MLA's single latent plane), each ``[num_blocks, block_size,
num_kv_heads, head_size]``, over the engine's memory as it is: no copy, whatever the
physical order (strides) and however the layers interleave in their allocation. The
transfer code only ever sees those views.

Axis meanings (:class:`Axis`): ``KV`` (size 2: K then V), ``BLOCK``, ``TOKEN`` (tokens
of a block), ``HEAD``, ``DIM`` (head size, or MLA's latent width), ``KV_DIM`` (K and V
packed in one axis, K first, each ``head_size`` wide: current vLLM's ``C``) and
``SLOT`` (token slots, block-major: ``slot = block * block_size + token``, SGLang).

========================  =======================================  ====================
format                    per-layer tensor(s)                      engine
========================  =======================================  ====================
``VLLM``                  ``[num_blocks, H, block_size, 2 * D]``   vLLM >= 0.2x, any of
                                                                   the six physical
                                                                   ``KVCacheLayout``\\ s
``VLLM_MLA``              ``[num_blocks, 1, block_size, latent]``  vLLM MLA
``FLASH_ATTN``            ``[2, num_blocks, block_size, H, D]``    older vLLM
``FLASH_ATTN_HND``        ``[2, num_blocks, H, block_size, D]``    older vLLM
``FLASHINFER``            ``[num_blocks, 2, block_size, H, D]``    older vLLM
``FLASHINFER_HND``        ``[num_blocks, 2, H, block_size, D]``    older vLLM
``MLA``                   ``[num_blocks, block_size, latent]``     older vLLM MLA
``SGLANG``                a pair ``([slots, H, D], [slots, H, D])`` SGLang MHA pool
``SGLANG_MLA``            ``[slots, 1, latent]``                   SGLang MLA pool
========================  =======================================  ====================

``H`` is num_kv_heads and ``D`` head_size. A layer's ``block_size`` here is the tensor's
own (vLLM's *kernel* block); an engine group may use blocks that are a whole multiple
of it, and block ids are then translated (see :mod:`.groups`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .._errors import LayoutError
from .._types import EngineType, KVFormat, LayoutHints

if TYPE_CHECKING:
    import torch

#: What an engine hands over for one layer: a tensor, or a (K, V) pair of tensors.
LayerTensors = Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]


class Axis(enum.Enum):
    """What one axis of a layer's KV tensor holds."""

    KV = "kv"
    BLOCK = "block"
    TOKEN = "token"  # noqa: S105 - an axis name, not a secret
    HEAD = "head"
    DIM = "dim"
    KV_DIM = "kv_dim"
    SLOT = "slot"


@dataclass(frozen=True)
class FormatSpec:
    """The meaning of a format's axes: the whole definition of a layout."""

    axes: tuple[Axis, ...]
    #: Planes per layer: 2 (K and V) or 1 (MLA's latent).
    planes: int
    #: Tensors per layer: 1, or 2 when K and V come as a pair of tensors.
    tensors: int = 1
    #: Whether an engine block may span several of the tensor's blocks (vLLM's kernel
    #: blocks); older formats never split, so a different block size is an error there.
    kernel_blocks: bool = False

    @property
    def engine_views(self) -> bool:
        """Current vLLM's logical ``[B, H, N, C]``: the axes its six physical orders permute."""
        return self.axes[:3] == (Axis.BLOCK, Axis.HEAD, Axis.TOKEN)

    @property
    def shape_text(self) -> str:
        names = {
            Axis.KV: "2",
            Axis.BLOCK: "num_blocks",
            Axis.TOKEN: "block_size",
            Axis.HEAD: "num_kv_heads" if self.planes == 2 else "1",
            Axis.DIM: "head_size" if self.planes == 2 else "latent",
            Axis.KV_DIM: "2*head_size",
            Axis.SLOT: "slots",
        }
        one = "[" + ", ".join(names[a] for a in self.axes) + "]"
        return f"a pair ({one}, {one})" if self.tensors == 2 else one


_A = Axis
#: Every layout the base cache context understands, as data.
FORMATS: dict[KVFormat, FormatSpec] = {
    KVFormat.VLLM: FormatSpec((_A.BLOCK, _A.HEAD, _A.TOKEN, _A.KV_DIM), planes=2, kernel_blocks=True),
    KVFormat.VLLM_MLA: FormatSpec((_A.BLOCK, _A.HEAD, _A.TOKEN, _A.DIM), planes=1, kernel_blocks=True),
    KVFormat.FLASH_ATTN: FormatSpec((_A.KV, _A.BLOCK, _A.TOKEN, _A.HEAD, _A.DIM), planes=2),
    KVFormat.FLASH_ATTN_HND: FormatSpec((_A.KV, _A.BLOCK, _A.HEAD, _A.TOKEN, _A.DIM), planes=2),
    KVFormat.FLASHINFER: FormatSpec((_A.BLOCK, _A.KV, _A.TOKEN, _A.HEAD, _A.DIM), planes=2),
    KVFormat.FLASHINFER_HND: FormatSpec((_A.BLOCK, _A.KV, _A.HEAD, _A.TOKEN, _A.DIM), planes=2),
    KVFormat.MLA: FormatSpec((_A.BLOCK, _A.TOKEN, _A.DIM), planes=1),
    KVFormat.SGLANG: FormatSpec((_A.SLOT, _A.HEAD, _A.DIM), planes=2, tensors=2),
    KVFormat.SGLANG_MLA: FormatSpec((_A.SLOT, _A.HEAD, _A.DIM), planes=1),
}

#: vLLM's ``KVCacheLayout`` names: the physical order of the logical ``[L, B, H, N, C]``.
ENGINE_LAYOUTS: dict[str, str] = {
    "LBHNC": "LBHNC",
    "LBNHC": "LBNHC",
    "LHBNC": "LHBNC",
    "BLHNC": "BLHNC",
    "BLNHC": "BLNHC",
    "BHLNC": "BHLNC",
    # The older two-name vocabulary (vLLM's get_kv_cache_layout, upstream LMCache).
    "NHD": "LBNHC",
    "HND": "LBHNC",
}

SHAPES_HELP = "supported per-layer shapes: " + ", ".join(
    f"{fmt.name} {spec.shape_text}" for fmt, spec in FORMATS.items()
)


def kv_cache_shape(
    kv_format: KVFormat, *, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """One layer's logical KV-cache shape in ``kv_format`` (of each tensor, for a pair).

    For the MLA formats ``num_kv_heads`` is ignored and ``head_size`` is the latent width.
    """
    spec = FORMATS[kv_format]
    heads = num_kv_heads if spec.planes == 2 else 1
    sizes = {
        Axis.KV: 2,
        Axis.BLOCK: num_blocks,
        Axis.TOKEN: block_size,
        Axis.HEAD: heads,
        Axis.DIM: head_size,
        Axis.KV_DIM: 2 * head_size,
        Axis.SLOT: num_blocks * block_size,
    }
    return tuple(sizes[a] for a in spec.axes)


class FormatDims:
    """Sizes derived from a KV format and head geometry; shared by layers and groups."""

    kv_format: KVFormat
    num_kv_heads: int
    head_size: int

    @property
    def is_mla(self) -> bool:
        return FORMATS[self.kv_format].planes == 1

    @property
    def kv_size(self) -> int:
        """2 (K and V planes), or 1 for MLA's single latent plane."""
        return FORMATS[self.kv_format].planes

    @property
    def hidden_dim(self) -> int:
        """Elements of one token of one plane: ``num_kv_heads * head_size``."""
        return self.num_kv_heads * self.head_size


@dataclass(frozen=True)
class LayerLayout(FormatDims):
    """What discovery learned about one layer."""

    kv_format: KVFormat
    num_blocks: int
    #: Tokens per block of this tensor (a vLLM *kernel* block).
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    #: The (first) tensor's shape and stride as given, in elements.
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: The engine's layout name, when the hints gave one (``"LBHNC"``, ...).
    engine_layout: str | None = None


def _hint(*parts: str) -> str:
    return "LayoutHints(" + ", ".join(parts) + ")"


def _fmt_hint(formats: Sequence[KVFormat]) -> str:
    return _hint("kv_format=" + " or ".join(f"KVFormat.{f.name}" for f in formats))


class _Probe:
    """One layer's evidence: its tensor(s), name, and what the hints and engine group say."""

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...],
        where: str,
        *,
        block_size: int | None,
        num_kv_heads: int | None,
        head_size: int | None,
        engine_layout: str | None,
        engine_type: EngineType,
    ) -> None:
        self.tensors = tensors
        self.shape = tuple(int(s) for s in tensors[0].shape)
        self.stride = tuple(int(s) for s in tensors[0].stride())
        self.where = f"{where} (shape {list(self.shape)})"
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.engine_layout = engine_layout
        self.engine_type = engine_type

    def fail(self, message: str) -> LayoutError:
        return LayoutError(f"{self.where}: {message}")


def _tokens_dim_first(p: _Probe) -> bool | None:
    """For the 5-D formats: does dim 2 (True, NHD) or dim 3 (False, HND) hold the tokens?

    Evidence, strongest first: a known block size, a known head count, the engine's
    layout name, then the strides of a permuted view. None when nothing decides.
    """
    a, b = p.shape[2], p.shape[3]
    for known, tokens_first in ((p.block_size, True), (p.num_kv_heads, False)):
        if known is None or a == b:
            continue
        if a == known:
            return tokens_first
        if b == known:
            return not tokens_first
    if p.engine_layout is not None:
        return ENGINE_LAYOUTS[p.engine_layout].index("N") < ENGINE_LAYOUTS[p.engine_layout].index("H")
    # Engines build HND memory and present an NHD *logical* view of it (vLLM's
    # kv_cache_stride_order). A view whose dims 2 and 3 are swapped in memory is
    # therefore the logical NHD shape. A dense tensor gives no such evidence.
    if a != 1 and b != 1 and p.stride[2] < p.stride[3]:
        return True
    return None


def _pick_5d(p: _Probe) -> KVFormat:
    shape = p.shape
    families = [d for d in (0, 1) if shape[d] == 2]
    if not families:
        raise p.fail(f"neither dim 0 nor dim 1 has size 2 (the K/V planes); {SHAPES_HELP}")
    for name, known in (("block size", p.block_size), ("KV head count", p.num_kv_heads)):
        if known is not None and known not in shape[2:4]:
            raise p.fail(
                f"the {name} {known} (from the hints or engine group) matches neither "
                f"dim 2 ({shape[2]}) nor dim 3 ({shape[3]}); {SHAPES_HELP}"
            )
    nhd = {0: KVFormat.FLASH_ATTN, 1: KVFormat.FLASHINFER}
    hnd = {0: KVFormat.FLASH_ATTN_HND, 1: KVFormat.FLASHINFER_HND}
    tokens_first = _tokens_dim_first(p)
    if len(families) == 1 and tokens_first is not None:
        return (nhd if tokens_first else hnd)[families[0]]
    candidates = [
        fmt
        for fam in families
        for fmt, is_nhd in ((nhd[fam], True), (hnd[fam], False))
        if tokens_first is None or is_nhd == tokens_first
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
    raise LayoutError(f"{p.where} is ambiguous: {'; '.join(reasons)}. Pass {fix}.")


def _pick_4d(p: _Probe) -> KVFormat:
    """Current vLLM ``[B, H, N, C]``: K/V packed in ``C``, or MLA's latent with ``H = 1``."""
    heads, content = p.shape[1], p.shape[3]
    if p.head_size is not None:
        if content == 2 * p.head_size:
            return KVFormat.VLLM
        if content == p.head_size and heads == 1:
            return KVFormat.VLLM_MLA
        raise p.fail(
            f"its content dim ({content}) is neither 2 * head_size ({2 * p.head_size}: K and V) "
            f"nor, with one head, head_size (an MLA latent); {SHAPES_HELP}"
        )
    if heads != 1:
        return KVFormat.VLLM
    raise LayoutError(
        f"{p.where} is ambiguous: with one KV head, its content dim {content} may be K and V "
        f"of head size {content // 2} or an MLA latent of {content}. Pass "
        f"{_hint('head_size=...')} or {_fmt_hint([KVFormat.VLLM, KVFormat.VLLM_MLA])}."
    )


def _pick(p: _Probe) -> KVFormat:
    """The format of a layer with no format hint."""
    rank = len(p.shape)
    if len(p.tensors) == 2:
        return KVFormat.SGLANG
    if rank == 5:
        return _pick_5d(p)
    if rank == 4:
        return _pick_4d(p)
    if rank == 3:
        return KVFormat.SGLANG_MLA if p.engine_type is EngineType.SGLANG else KVFormat.MLA
    raise p.fail(f"{rank}-D tensor is not a known KV layout; {SHAPES_HELP}")


def _check_engine_layout(p: _Probe, fmt: KVFormat) -> None:
    """The strides must put ``B, H, N, C`` in the order the engine's layout name says."""
    if p.engine_layout is None or not FORMATS[fmt].engine_views:
        return
    order = [c for c in ENGINE_LAYOUTS[p.engine_layout] if c != "L"]
    by_axis = dict(zip("BHNC", zip(p.shape, p.stride, strict=True), strict=True))
    # Axes of size 1 have no meaningful stride; the rest must descend in that order.
    strides = [by_axis[c][1] for c in order if by_axis[c][0] != 1]
    if strides != sorted(strides, reverse=True):
        raise p.fail(
            f"its strides {list(p.stride)} do not match the engine layout {p.engine_layout} "
            f"(memory order {''.join(order)}); check LayoutHints.engine_layout"
        )


def _sizes(p: _Probe, fmt: KVFormat) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, num_kv_heads, head_size)`` read off the shape in ``fmt``."""
    spec = FORMATS[fmt]
    if len(p.tensors) != spec.tensors:
        raise p.fail(
            f"format {fmt.name} takes {spec.tensors} tensor(s) per layer, got {len(p.tensors)}; {SHAPES_HELP}"
        )
    for t in p.tensors[1:]:
        if tuple(t.shape) != p.shape or t.dtype != p.tensors[0].dtype or t.device != p.tensors[0].device:
            raise p.fail("the K and V tensors of a pair must share shape, dtype and device")
    if len(p.shape) != len(spec.axes):
        raise p.fail(f"format {fmt.name} needs a {len(spec.axes)}-D tensor; {SHAPES_HELP}")
    size = dict(zip(spec.axes, p.shape, strict=True))
    if size.get(Axis.KV, 2) != 2:
        raise p.fail(f"format {fmt.name} needs size 2 at dim {spec.axes.index(Axis.KV)}; {SHAPES_HELP}")
    heads = size.get(Axis.HEAD, 1)
    if spec.planes == 1 and heads != 1:
        raise p.fail(f"format {fmt.name} has one latent head, but its head dim is {heads}")
    if Axis.KV_DIM in size:
        content = size[Axis.KV_DIM]
        head = p.head_size if p.head_size is not None else content // 2
        if content != 2 * head:
            raise p.fail(f"its content dim {content} is not 2 * head_size ({head}): K then V; {SHAPES_HELP}")
    else:
        head = size[Axis.DIM]
        if p.head_size is not None and head != p.head_size:
            raise p.fail(f"read as {fmt.name} its head size is {head}, but the hints say {p.head_size}")
    if Axis.SLOT in size:
        if p.block_size is None:
            raise p.fail(
                f"format {fmt.name} stores token slots; its page size is unknown. Pass "
                f"{_hint('block_size=...')} or EngineGroupInfo(block_size=...)"
            )
        if size[Axis.SLOT] % p.block_size:
            raise p.fail(f"{size[Axis.SLOT]} slots are not a whole number of {p.block_size}-token pages")
        blocks, bsz = size[Axis.SLOT] // p.block_size, p.block_size
    else:
        blocks, bsz = size[Axis.BLOCK], size[Axis.TOKEN]
        if p.block_size is not None and (p.block_size % bsz if spec.kernel_blocks else p.block_size != bsz):
            allowed = f" (it must be {bsz} or a whole multiple of it)" if spec.kernel_blocks else ""
            raise p.fail(
                f"read as {fmt.name} its block size is {bsz}, but the hints or engine group say "
                f"{p.block_size}{allowed}"
            )
    if p.num_kv_heads is not None and spec.planes == 2 and heads != p.num_kv_heads:
        raise p.fail(f"read as {fmt.name} it has {heads} KV heads, but the hints say {p.num_kv_heads}")
    if min(blocks, bsz, heads, head) <= 0:
        raise p.fail(f"{fmt.name} layout has an empty dimension")
    return blocks, bsz, heads, head


def discover_layout(
    tensor: LayerTensors,
    *,
    layer: int,
    name: str | None = None,
    kv_format: KVFormat | None = None,
    block_size: int | None = None,
    num_kv_heads: int | None = None,
    head_size: int | None = None,
    engine_layout: str | None = None,
    engine_type: EngineType = EngineType.VLLM,
) -> LayerLayout:
    """Discover the layout of layer ``layer`` (engine name ``name``, for messages).

    ``kv_format`` (from :class:`LayoutHints`) is checked against the shape and wins.
    Otherwise a pair is SGLang's; the rank picks among the rest: 5-D the older vLLM
    formats (the size-2 dim picks flash-attention or FlashInfer, ``block_size``,
    ``num_kv_heads``, the engine layout name or a permuted view picks NHD or HND),
    4-D current vLLM (``head_size``, or more than one head, tells K/V from an MLA
    latent), 3-D MLA (SGLang's slot pool when the engine is SGLang). Anything still
    undecided raises :class:`LayoutError` naming the hint that settles it.
    """
    tensors = tensor if isinstance(tensor, tuple) else (tensor,)
    if engine_layout is not None and engine_layout not in ENGINE_LAYOUTS:
        raise LayoutError(
            f"LayoutHints.engine_layout {engine_layout!r} is not a known layout "
            f"(known: {', '.join(ENGINE_LAYOUTS)})"
        )
    where = f"layer {layer}" + (f" ({name})" if name else "")
    p = _Probe(
        tensors,
        where,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        engine_layout=engine_layout,
        engine_type=engine_type,
    )
    fmt = kv_format if kv_format is not None else _pick(p)
    blocks, bsz, heads, head = _sizes(p, fmt)
    _check_engine_layout(p, fmt)
    return LayerLayout(
        fmt,
        blocks,
        bsz,
        heads,
        head,
        tensors[0].dtype,
        p.shape,
        p.stride,
        ENGINE_LAYOUTS[engine_layout] if engine_layout is not None else None,
    )


def discover_layouts(
    tensors: Sequence[LayerTensors],
    hints: LayoutHints | None,
    block_sizes: dict[int, int],
    *,
    names: Sequence[str] = (),
    engine_type: EngineType = EngineType.VLLM,
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
        name = names[i] if i < len(names) else None
        bsz = block_sizes.get(i)
        if hints.block_size is not None and bsz is not None and bsz != hints.block_size:
            raise LayoutError(
                f"layer {i}{f' ({name})' if name else ''}: LayoutHints.block_size={hints.block_size} "
                f"contradicts its engine group's block_size={bsz}"
            )
        out.append(
            discover_layout(
                tensor,
                layer=i,
                name=name,
                kv_format=hints.per_layer.get(i, hints.kv_format),
                block_size=bsz if bsz is not None else hints.block_size,
                num_kv_heads=hints.num_kv_heads,
                head_size=hints.head_size,
                engine_layout=hints.engine_layout,
                engine_type=engine_type,
            )
        )
    return out


def plane_views(tensor: LayerTensors, layout: LayerLayout) -> list[torch.Tensor]:
    """The layer's planes (K and V, or the latent), each ``[blocks, block_size, heads, head]``.

    Strided views of the engine's memory, built only from the format's axis meanings:
    split the packed and slot axes, add the axes a format lacks, move them into
    ``[KV, BLOCK, TOKEN, HEAD, DIM]`` order, then take each plane.
    """
    spec = FORMATS[layout.kv_format]
    tensors = tensor if isinstance(tensor, tuple) else (tensor,)
    planes: list[torch.Tensor] = []
    for t in tensors:
        axes = list(spec.axes)
        for packed, inner, sizes in (
            (Axis.KV_DIM, (Axis.KV, Axis.DIM), (2, layout.head_size)),
            (Axis.SLOT, (Axis.BLOCK, Axis.TOKEN), (layout.num_blocks, layout.block_size)),
        ):
            if packed in axes:
                at = axes.index(packed)
                t = t.unflatten(at, sizes)  # type: ignore[no-untyped-call]
                axes[at : at + 1] = inner
        for missing in (Axis.KV, Axis.HEAD):
            if missing not in axes:
                t = t.unsqueeze(0)
                axes.insert(0, missing)
        order = [axes.index(a) for a in (Axis.KV, Axis.BLOCK, Axis.TOKEN, Axis.HEAD, Axis.DIM)]
        planes.extend(t.permute(order).unbind(0))
    return planes


def allocate_kv_caches(
    kv_format: KVFormat,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    engine_layout: str | None = None,
) -> list[LayerTensors]:
    """Uninitialised per-layer KV caches, allocated the way the engine of ``kv_format`` does.

    The current vLLM formats get one backing allocation holding every layer in the
    physical order ``engine_layout`` (default ``"LBHNC"``, the CPU engine's; GPU
    flash-attention uses ``"LBNHC"``) and one strided ``[B, H, N, C]`` view per layer,
    as vLLM's ``create_kv_cache_views`` builds them: in the block-outermost orders the
    layers' pages interleave. The older formats get equally spaced views of one
    allocation; SGLang's pools a separate tensor per layer (a K and a V for ``SGLANG``).
    For demos, benchmarks and tests; engines allocate their own.
    """
    import torch

    spec = FORMATS[kv_format]
    shape = kv_cache_shape(
        kv_format,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
    )
    if Axis.SLOT in spec.axes:

        def pool() -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        return [(pool(), pool()) if spec.tensors == 2 else pool() for _ in range(num_layers)]
    if not spec.engine_views:
        return list(torch.empty((num_layers, *shape), dtype=dtype, device=device).unbind(0))
    order = ENGINE_LAYOUTS[engine_layout or "LBHNC"]
    sizes = dict(zip("LBHNC", (num_layers, *shape), strict=True))
    strides: dict[str, int] = {}
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= sizes[axis]
    flat = torch.empty(step, dtype=dtype, device=device)
    return [
        flat.as_strided(shape, tuple(strides[a] for a in "BHNC"), layer * strides["L"])
        for layer in range(num_layers)
    ]

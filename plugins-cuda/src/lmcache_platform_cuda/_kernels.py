"""Fused Triton gather/scatter: one launch moves a kernel group's share of a chunk.

What drives the kernel is data the layout model already has, never a per-format code
path: :func:`lmcache_platform.copy_geometry` describes a kernel group (every layer, K
and V planes or block-form pieces, for either chunk format) as *units* with an offset
each and strides they all share. Here that becomes

* a word type: the widest of 8, 4, 2 and 1 bytes that divides every offset, stride and
  contiguous run, so bytes move as opaque integers (bit-exact for any dtype, fp8
  included) and each thread moves up to 8 bytes per access;
* an anchor tensor (the group's first tensor, seen as words) and, per unit, its offset
  from that anchor and into the chunk buffer, in words: one small int64 table on the
  device, made once per context. Layers in separate allocations are just other offsets.

A launch is one program per (block of the part, unit): it loads its block id, masks the
rows outside the part (partial first or last block, a trimmed sliding window, a
``-1`` block id) and copies ``[rows, row words]`` tiles between the paged memory and the
dense buffer. The part's first row, row count and staged row are plain arguments, so a
partial chunk reuses the compiled kernel.

:class:`TritonTransfers` falls back (``run`` returns False, the caller takes the torch
path) when triton is not installed or fails to import, the operator chose
``LMCACHE_PLATFORM_CUDA_KERNELS=torch``, a group has no single copy geometry, a buffer is
not aligned to the word type or lives on another device, a launch fails (compiling, say),
or the tensors are on the CPU and triton's interpreter is not enabled
(``TRITON_INTERPRET=1``: how this kernel is tested on machines without a GPU; CUDA
tensors always take the compiled kernel).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_platform import copy_geometry

from ._config import kernels_choice

if TYPE_CHECKING:
    import torch

    from lmcache_platform import BaseCacheContext, ChunkTransfer, CopyGeometry, KernelGroup

log = logging.getLogger(__name__)

#: Why the kernels cannot run in this process at all (triton missing or broken); read
#: only while ``triton`` is None.
_UNAVAILABLE = "triton is not installed"
try:  # optional: without it every plan takes the torch path, and TritonTransfers says why
    import triton
    import triton.language as tl
except ImportError:
    triton = None
except Exception as exc:  # a broken install (a missing CUDA library, ...) must not break transfers
    triton = None
    _UNAVAILABLE = f"triton failed to import: {type(exc).__name__}: {exc}"
    log.warning("torch path for every transfer: %s", _UNAVAILABLE)

#: Word widths in bytes, widest first, and the torch dtype of each.
_WORDS = ((8, "int64"), (4, "int32"), (2, "int16"), (1, "uint8"))
#: Words one program copies per step (a [rows, row words] tile): 32 KiB of int64.
TILE_WORDS = 4096
#: The part's runtime values: never specialized, so partial chunks reuse the compiled kernel.
_PART_ARGS = ("first_row", "num_rows", "staged_row")


def _copy_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: tl types, not Python's
    paged,
    staged,
    units,
    ids,
    first_row,
    num_rows,
    staged_row,
    block_stride,
    row_stride,
    outer_stride,
    inner_stride,
    ROWS: tl.constexpr,
    ROW_TILE: tl.constexpr,
    OUTER: tl.constexpr,
    INNER: tl.constexpr,
    ELEM_TILE: tl.constexpr,
    VEC: tl.constexpr,
    STORE: tl.constexpr,
):
    """Copy block ``program_id(0)`` of the part for unit ``program_id(1)`` (see the module docstring)."""
    j = tl.program_id(0)
    u = tl.program_id(1)
    paged_off = tl.multiple_of(tl.load(units + 2 * u), VEC)
    staged_off = tl.multiple_of(tl.load(units + 2 * u + 1), VEC)
    block = tl.load(ids + j)
    # Offsets in int64 throughout: a row's stride times its index, or an element's outer
    # stride times its plane, passes 2**31 words in a large cache (heads outermost, say).
    r = tl.arange(0, ROW_TILE).to(tl.int64)
    pos = (first_row // ROWS + j) * ROWS + r
    # A -1 id (a block not to write) masks every row; broadcast first (a scalar mask is refused).
    rows = (r < ROWS) & (pos >= first_row) & (pos < first_row + num_rows) & (block + 0 * r >= 0)
    paged_row = paged_off + block * block_stride + r * row_stride
    staged_row_start = staged_off + (staged_row + pos - first_row) * (OUTER * INNER)
    for e0 in range(0, OUTER * INNER, ELEM_TILE):
        e = e0 + tl.arange(0, ELEM_TILE)
        e64 = e.to(tl.int64)
        within = (e64 // INNER) * outer_stride + (e64 % INNER) * inner_stride
        mask = rows[:, None] & (e < OUTER * INNER)[None, :]
        at_paged = paged + paged_row[:, None] + within[None, :]
        at_staged = staged + staged_row_start[:, None] + e[None, :]
        if STORE:
            tl.store(at_staged, tl.load(at_paged, mask=mask), mask=mask)
        else:
            tl.store(at_paged, tl.load(at_staged, mask=mask), mask=mask)


_LAUNCHERS: dict[str, Any] = {}
#: Held while kernels compile (:meth:`TritonTransfers.warm`): triton's JIT cache has no lock
#: of its own, so two contexts made at once (a TP=2 engine's) would compile the same kernels
#: twice; under it the second finds the first's in the cache.
_COMPILE_LOCK = threading.Lock()
#: Why contexts of this process fell back to the torch path, and how often (``fallbacks``);
#: the first of each reason is logged at WARNING, the rest at DEBUG.
FALLBACKS: collections.Counter[str] = collections.Counter()
_FALLBACKS_LOCK = threading.Lock()


def _fall_back(reason: str) -> None:
    """Count a context's fallback to the torch path; say it at WARNING the first time."""
    with _FALLBACKS_LOCK:
        FALLBACKS[reason] += 1
        first = FALLBACKS[reason] == 1
    log.log(logging.WARNING if first else logging.DEBUG, "torch path for every transfer: %s", reason)


#: Block ids come as views into the plan's ids buffer at a part's offset: their 16-byte
#: alignment varies, and specializing on it would recompile the kernel on the request path.
_NO_ALIGNMENT_ARGS = ("ids",)


def _interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is on, read as triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _launcher(device_type: str) -> Any | None:
    """The kernel compiled for CUDA, or interpreted on CPU tensors under ``TRITON_INTERPRET=1``.

    Each kind is built directly, never through ``triton.jit``: that returns an interpreted
    function whenever ``TRITON_INTERPRET`` is set, and the interpreter copies each tensor's
    own storage to the host, so a CUDA launch reaching other layers' allocations through
    offsets from the anchor would read or write the wrong memory.
    """
    if device_type == "cpu" and not _interpreting():
        return None
    if device_type not in ("cuda", "cpu"):
        return None
    if device_type not in _LAUNCHERS:
        options: dict[str, Any] = {
            "do_not_specialize": _PART_ARGS,
            "do_not_specialize_on_alignment": _NO_ALIGNMENT_ARGS,
        }
        if device_type == "cuda":
            from triton.runtime.jit import JITFunction

            _LAUNCHERS[device_type] = JITFunction(_copy_kernel, **options)
        else:
            from triton.runtime.interpreter import InterpretedFunction

            _LAUNCHERS[device_type] = InterpretedFunction(_copy_kernel, **options)
    return _LAUNCHERS[device_type]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Launch:
    """One kernel group's compiled-ahead data: anchor, unit table, strides in words."""

    word: torch.dtype
    width: int
    anchor: torch.Tensor
    units: torch.Tensor
    num_units: int
    tokens_per_row: int
    strides: tuple[int, int, int, int]
    constants: dict[str, int]
    num_warps: int


def _word_width(geo: CopyGeometry, itemsize: int, offsets: Sequence[int]) -> int:
    """The widest word that divides every byte offset, stride and contiguous run; 0 if none.

    A row whose inner elements are contiguous may move in any word that divides it; a
    strided one moves element by element, so its words are the elements.
    """
    sizes = [geo.block_stride, geo.row_stride, geo.outer_stride, *(u.staged_offset for u in geo.units)]
    in_bytes = [s * itemsize for s in sizes] + list(offsets)
    if geo.inner_stride == 1 or geo.inner == 1:
        in_bytes.append(geo.inner * itemsize)
        widths = [w for w, _ in _WORDS]
    else:
        widths = [itemsize] if itemsize in dict(_WORDS) else []
    return next((w for w in widths if all(b % w == 0 for b in in_bytes)), 0)


def _plan_group(
    kg: KernelGroup, tensors: Sequence[Sequence[torch.Tensor]], chunk_format: str, slot_region: torch.Tensor
) -> _Launch | str:
    """The launch data of one kernel group, or why it takes the torch path."""
    import torch

    geo = copy_geometry(kg, tensors, chunk_format)
    if geo is None:
        return f"kernel group {kg.index}: its tensors share no single copy geometry"
    flat = [t for layer in tensors for t in layer]
    itemsize = int(kg.dtype.itemsize)
    anchor_ptr = flat[0].untyped_storage().data_ptr()
    paged = [flat[u.tensor].data_ptr() - anchor_ptr + u.paged_offset * itemsize for u in geo.units]
    width = _word_width(geo, itemsize, [*paged, slot_region.data_ptr() - anchor_ptr])
    if not width:
        return f"kernel group {kg.index}: no word type fits its {kg.dtype} rows"
    contiguous = geo.inner_stride == 1 or geo.inner == 1

    def words(elements: int) -> int:
        return elements * itemsize // width

    table = [[p // width, words(u.staged_offset)] for p, u in zip(paged, geo.units, strict=True)]
    row_tile = _next_pow2(geo.rows_per_block)
    row_words = geo.outer * words(geo.inner)
    elem_tile = min(_next_pow2(row_words), max(1, TILE_WORDS // row_tile))
    per_16 = max(1, 16 // width)  # words in 16 bytes: the offsets' shared multiple, for vector access
    vec = per_16 if all(v % per_16 == 0 for row in table for v in row) else 1
    device = flat[0].device
    word = getattr(torch, dict(_WORDS)[width])
    return _Launch(
        word=word,
        width=width,
        anchor=torch.empty(0, dtype=word, device=device).set_(flat[0].untyped_storage(), 0, (1,), (1,)),
        units=torch.tensor(table, dtype=torch.int64).flatten().to(device),
        num_units=len(geo.units),
        tokens_per_row=geo.tokens_per_row,
        strides=(
            words(geo.block_stride),
            words(geo.row_stride),
            words(geo.outer_stride),
            1 if contiguous else geo.inner_stride,
        ),
        constants={
            "ROWS": geo.rows_per_block,
            "ROW_TILE": row_tile,
            "OUTER": geo.outer,
            "INNER": words(geo.inner),
            "ELEM_TILE": elem_tile,
            "VEC": vec,
        },
        num_warps=8 if row_tile * elem_tile > 2048 else 4,
    )


class TritonTransfers:
    """The fused kernels of one cache context: :meth:`run` moves a plan or declines it.

    Built when the context is made, then :meth:`warm` compiles every kernel it will
    launch. ``reason`` says why every plan falls back (None when the kernels run);
    ``launches`` counts kernel launches (tests read it).
    """

    def __init__(self, ctx: BaseCacheContext) -> None:
        self.reason: str | None = None
        self.launches = 0
        self._groups: list[_Launch | str] = []
        self._launch: Any = None
        if kernels_choice() == "torch":
            self.reason = "LMCACHE_PLATFORM_CUDA_KERNELS=torch"
            return
        if triton is None:
            self.reason = _UNAVAILABLE
            return
        try:
            self._launch = _launcher(ctx.device.type)
        except Exception as exc:  # a triton that cannot build kernels here: the torch path moves
            self.reason = f"no triton kernel: {type(exc).__name__}: {exc}"
            _fall_back(self.reason)
            return
        if self._launch is None:
            self.reason = (
                f"no triton kernel for {ctx.device.type} tensors (TRITON_INTERPRET=1 runs them on CPU)"
            )
            return
        flat = iter(ctx.kv_tensors)
        layers = [tuple(next(flat) for _ in entry) for entry in ctx.layer_wrappers]
        for kg in ctx.kv_layer_groups_manager.kernel_groups:
            tensors = [layers[i] for i in kg.layer_indices]
            region = ctx.get_temp_kernel_group_buffer(0, kg.index)
            self._groups.append(_plan_group(kg, tensors, ctx.chunk_format, region))
        reasons = [g for g in self._groups if isinstance(g, str)]
        if reasons:
            log.info("torch path for some kernel groups: %s", "; ".join(reasons))

    def warm(self, ctx: BaseCacheContext) -> None:
        """Compile both directions of every kernel group now, not in the first transfer.

        One launch per kernel group and direction, over slot 0's region as a transfer
        would (so the same specialization), with a block id of -1 and no rows: every
        access is masked, nothing is read or written. A launch that fails (a build
        without a C compiler, say) sends every plan down the torch path, as in :meth:`run`.
        """
        import torch

        from lmcache_platform import GroupTransfer

        if self.reason is not None:
            return
        ids = torch.full((1,), -1, dtype=torch.int64, device=ctx.device)
        with _COMPILE_LOCK, ctx.stream_context():
            for index, launch in enumerate(self._groups):
                if isinstance(launch, str):
                    continue
                region = ctx.get_temp_kernel_group_buffer(0, index)
                buffer = _words_of(region.reshape(-1) if ctx.chunk_format == "blocks" else region, launch)
                if buffer is None:
                    continue
                part = GroupTransfer(index, 0, 0, ids, (-1,), region)
                for store in (True, False):
                    try:
                        self._one(launch, part, buffer, store)
                    except Exception as exc:  # logged, counted, and every plan takes the torch path
                        self.reason = f"the triton kernel failed to build: {type(exc).__name__}: {exc}"
                        _fall_back(self.reason)
                        return
        ctx.synchronize()

    @property
    def active(self) -> bool:
        """Whether any plan can take the kernels."""
        return self.reason is None and any(not isinstance(g, str) for g in self._groups)

    def run(self, plan: ChunkTransfer, *, store: bool) -> bool:
        """Launch the plan's parts, one launch each; False (nothing moved) to take the torch path."""
        if self.reason is not None:
            return False
        jobs: list[tuple[_Launch, Any, torch.Tensor]] = []
        for part in plan.groups:
            launch = self._groups[part.kernel_group_idx]
            if isinstance(launch, str):
                return False
            buffer = _words_of(part.buffer, launch)
            if buffer is None:
                return False
            jobs.append((launch, part, buffer))
        for launch, part, buffer in jobs:
            # Any launch may compile (a first one, or a buffer of another alignment), so each
            # is covered: a failure happens before that launch enqueues anything, and the
            # torch path then moves the whole plan, rewriting what earlier parts moved with
            # the same bytes, in order on the same stream.
            try:
                self._one(launch, part, buffer, store)
            except Exception as exc:  # logged, counted, and every later plan takes the torch path
                self.reason = f"the triton kernel failed to launch: {type(exc).__name__}: {exc}"
                _fall_back(self.reason)
                return False
        return True

    def _one(self, launch: _Launch, part: Any, buffer: torch.Tensor, store: bool) -> None:
        tpr = launch.tokens_per_row
        grid = (len(part.block_id_list), launch.num_units)
        kernel: Callable[..., object] = self._launch[grid]
        kernel(
            launch.anchor,
            buffer,
            launch.units,
            part.block_ids,
            part.first_token // tpr,
            part.num_tokens // tpr,
            part.staging_offset // tpr,
            *launch.strides,
            STORE=store,
            num_warps=launch.num_warps,
            # Words copied as integers: nothing to fuse. Explicit, since triton 3.9 warns on
            # every compile that leaves it to TRITON_DEFAULT_FP_FUSION (an error under pytest).
            enable_fp_fusion=False,
            **launch.constants,
        )
        self.launches += 1


def _words_of(buffer: torch.Tensor, launch: _Launch) -> torch.Tensor | None:
    """A part's buffer as a flat tensor of the launch's words, or None if it cannot be one."""
    if buffer.device != launch.anchor.device or not buffer.is_contiguous():
        return None
    if buffer.data_ptr() % launch.width or buffer.numel() * buffer.element_size() % launch.width:
        return None
    try:
        return buffer.reshape(-1).view(launch.word)
    except RuntimeError:
        return None

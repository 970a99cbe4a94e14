"""``BaseCacheContext``: server-side view of one engine's registered KV caches.

The base does everything that does not depend on the device: it reopens the
wrappers (``to_tensors()``, one call per wrapper class), discovers each layer's
layout (``layout.py``), groups layers (``groups.py``), builds per-kernel-group
pointer tensors and the staging buffer (``staging.py``), validates transfer
requests and moves chunks with generic torch ops (``transfer.py``, ``blocks.py``).
A backend subclass only says how its device differs.

Contract with backends (stable within an API major):

* Constructor ``cls(kv_caches, config)``: the IPC wrappers (one per layer) and a
  frozen :class:`CacheContextConfig`. Keyword fields can be added to the config
  without breaking any backend. The context owns the wrappers: :meth:`close` closes
  them, and a failing constructor closes those it tried to reopen (it reopens each
  wrapper class's with one ``to_tensors`` call, in layer order).
* Customization points, all optional:

  - :meth:`allocate_staging` -- staging memory on the device (default
    ``torch.empty`` on :attr:`device`; a backend may pin or register it).
  - :meth:`create_stream` -- the object :attr:`stream` returns (default a
    :class:`NullStream` for devices that copy synchronously, like the host).
  - :meth:`stream_context` -- a context manager that makes work issued inside it
    run on :attr:`stream` (default: does nothing).
  - :meth:`store` / :meth:`retrieve` -- move one validated
    :class:`~lmcache_platform.ChunkTransfer`; override these with native kernels and keep
    the validation and block-id staging of :meth:`store_chunk`/:meth:`retrieve_chunk`.
    A kernel moves between the blocks and each part's ``buffer``: a staging slot's
    view, or (``plan.staged`` False) the caller's host tensors of :meth:`read_chunk` /
    :meth:`write_chunk` on a host context. Plans come in the context's chunk format
    (``plan.chunk_format``); an override that handles only ``"tokens"`` passes
    ``"blocks"`` plans on to ``super()``.
  - :meth:`allocate_chunk` -- fresh host tensors for one chunk (default: huge-page
    advised on the host, pinned for a device; a backend may register them with a NIC).
  - :meth:`device_event_class` -- the :class:`~lmcache_platform.DeviceEvent` class that
    :meth:`wait_event` opens handles with (default: the one the selected backend's
    ``lmcache_platform_device_event_class`` hook gives for :attr:`device_type`).
  - :meth:`synchronize` -- wait for enqueued transfers (default: ``stream.synchronize()``).
  - :meth:`release` -- free device resources on :meth:`close`, after
    :meth:`synchronize` and before the wrappers are closed.
  - :meth:`prefault_memory` -- make the engine's memory cheap to touch from this
    process before the first transfer does (default: nothing; host contexts map
    every page, see :class:`~lmcache_platform.hostmem.HostMemoryCacheContext`).

  Hooks run inside the base ``__init__``, so a subclass sets any attribute they
  need *before* calling ``super().__init__``. If a subclass's own ``__init__``
  fails after ``super().__init__`` returned, it calls ``self.close()`` and re-raises.

Moving a chunk to or from host memory (what a server does): :meth:`read_chunk` and
:meth:`write_chunk` take the chunk's host tensors (one 1-D uint8 tensor per object
group, as :meth:`allocate_chunk` makes them) and pick the path. On a host context the
movers gather straight into them and scatter straight from them: one pass over the
bytes. On a device they go through staging slot ``slot`` and one device-host copy each,
enqueued on :attr:`stream`: call :meth:`synchronize` before reading what
:meth:`read_chunk` filled, and keep :meth:`write_chunk`'s tensors unchanged until then.

Chunk formats (``CacheContextConfig.chunk_format``): ``"tokens"``, the default, is
token-major (``[kv, layers, tokens, hidden]`` per kernel group), readable by any layout;
``"blocks"`` keeps the engine's own block order, so a move copies whole blocks
(``blocks.py``). Both hold the same bytes per chunk in the same regions.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Union

from .._errors import LayoutError, LMCachePlatformError, TransferError
from .blocks import BlockMover, block_order
from .groups import KVLayerGroupsManager, resolve_engine_groups
from .hostalloc import DEFAULT_AHEAD_BYTES, HUGE_PAGE_BYTES, POOL, host_empty
from .layout import LayerTensors, discover_layouts, plane_views
from .staging import STAGING_ALIGN, StagingLayout
from .transfer import (
    GATHER_WORD_DTYPES,
    SCATTER_WORD_DTYPES,
    SKIP_BLOCK,
    ChunkTransfer,
    GroupMover,
    GroupTransfer,
)

if TYPE_CHECKING:
    from types import TracebackType

    import torch
    from typing_extensions import Self

    from .._events import DeviceEvent
    from .._ipc_wrapper import DeviceIPCWrapper
    from .._types import CacheContextConfig, KVFormat


#: One layer's registration: its wrapper, or a (K, V) pair of wrappers (SGLang).
KVCacheEntry = Union["DeviceIPCWrapper", tuple["DeviceIPCWrapper", "DeviceIPCWrapper"]]

_log = logging.getLogger(__name__)
#: Alignment the staging buffer's start must have (torch's allocators give at least this).
_STAGING_BASE_ALIGN = 64
#: Events a context keeps open (an engine reuses a few; see ``DeviceEvent``).
_MAX_OPEN_EVENTS = 64


class NullStream:
    """The stream of a device whose copies complete before they return (the host)."""

    def synchronize(self) -> None:
        """Nothing is ever pending."""

    def query(self) -> bool:
        """Always idle."""
        return True

    def __repr__(self) -> str:
        return "NullStream()"


class BaseCacheContext(abc.ABC):  # noqa: B024 - abstract through device_type, see __init__
    """Base of every backend's cache context; see the module docstring for the contract.

    Every member has a portable default, so a backend may add nothing but
    ``device_type``; the base itself refuses to be instantiated without one.
    """

    #: torch device type served by this class; must match the backend's entry-point name.
    device_type: ClassVar[str] = ""
    #: KV formats this context can serve; ``None`` means every :class:`KVFormat`.
    #: The conformance suite tests exactly these.
    supported_kv_formats: ClassVar[tuple[KVFormat, ...] | None] = None
    #: Element types the generic store (gather) moves bytes as, first fit wins; a device
    #: lacking one (``complex128``, say) drops it.
    store_word_dtypes: ClassVar[tuple[str, ...]] = GATHER_WORD_DTYPES
    #: The same for the generic retrieve (scatter).
    retrieve_word_dtypes: ClassVar[tuple[str, ...]] = SCATTER_WORD_DTYPES

    def __init__(self, kv_caches: Sequence[KVCacheEntry], config: CacheContextConfig) -> None:
        if not type(self).device_type:
            raise TypeError(f"{type(self).__name__} has no device_type: subclass BaseCacheContext and set it")
        #: Per layer, its wrappers: one, or a (K, V) pair for SGLang-style layers.
        self.layer_wrappers: list[tuple[DeviceIPCWrapper, ...]] = [
            entry if isinstance(entry, tuple) else (entry,) for entry in kv_caches
        ]
        #: Every IPC wrapper this context owns, in layer order (one per layer, two for a pair).
        self.kv_caches: list[DeviceIPCWrapper] = [w for entry in self.layer_wrappers for w in entry]
        self.config = config
        self.lmcache_tokens_per_chunk = config.lmcache_tokens_per_chunk
        self._closed = False
        self._close_lock = threading.Lock()
        # Serializes transfers: they share the block-id buffer (and, on devices with
        # streams, rely on issue order on one stream).
        self._transfer_lock = threading.Lock()
        #: Device events opened by :meth:`wait_event`, by handle, least recently used first.
        self._events: OrderedDict[bytes, DeviceEvent] = OrderedDict()
        attempted: list[DeviceIPCWrapper] = []  # closed again if construction fails
        try:
            if not self.kv_caches:
                raise LayoutError("a cache context needs a non-empty list of KV-cache wrappers")
            names = config.layer_names
            if names and len(names) != len(self.layer_wrappers):
                raise LayoutError(
                    f"{len(names)} layer names for {len(self.layer_wrappers)} layers; "
                    f"CacheContextConfig.layer_names must name every layer or none"
                )
            for entry in self.layer_wrappers:
                if len(entry) not in (1, 2):
                    raise LayoutError(f"a layer is one wrapper or a (K, V) pair, got {len(entry)} wrappers")
            # One call per wrapper class, in layer order, so a backend can place separate
            # exports where the layers stack (DeviceIPCWrapper.to_tensors).
            by_class: dict[type[DeviceIPCWrapper], list[int]] = {}
            for i, wrapper in enumerate(self.kv_caches):
                by_class.setdefault(type(wrapper), []).append(i)
            tensors: dict[int, torch.Tensor] = {}
            for cls, indices in by_class.items():
                batch = [self.kv_caches[i] for i in indices]
                attempted += batch
                got = cls.to_tensors(batch)
                if len(got) != len(indices):
                    raise LayoutError(
                        f"{cls.__name__}.to_tensors returned {len(got)} tensors for {len(indices)} wrappers"
                    )
                tensors.update(zip(indices, got, strict=True))
            layers: list[LayerTensors] = []
            flat = 0
            for entry in self.layer_wrappers:
                if len(entry) == 1:
                    layers.append(tensors[flat])
                else:
                    layers.append((tensors[flat], tensors[flat + 1]))
                flat += len(entry)
            self._build(layers)
        except BaseException:
            self._closed = True
            try:
                _close_all(attempted)
            except Exception:
                # Raise what broke construction; the cleanup failure goes to the log.
                _log.warning(
                    "closing wrappers after a failed %s init failed", type(self).__name__, exc_info=True
                )
            raise

    # -- construction ----------------------------------------------------------------

    def layer_name(self, layer: int) -> str:
        """``layer 3 (model.layers.3.self_attn.attn)``: how messages name a layer."""
        names = self.config.layer_names
        return f"layer {layer} ({names[layer]})" if layer < len(names) else f"layer {layer}"

    def _build(self, layers: list[LayerTensors]) -> None:
        import torch

        flat = [t for entry in layers for t in _tensors_of(entry)]
        devices = sorted({str(t.device) for t in flat})
        if len(devices) != 1:
            raise LayoutError(f"KV tensors must live on one device, got {devices}")
        device = flat[0].device
        if device.type != type(self).device_type:
            raise LayoutError(
                f"{type(self).__name__} serves {type(self).device_type!r} tensors, got tensors on {device}"
            )
        cfg = self.config
        engine_groups = resolve_engine_groups(cfg.engine_group_infos, len(layers))
        block_sizes = {layer: eg.block_size for eg in engine_groups or () for layer in eg.layer_indices}
        layouts = discover_layouts(
            layers, cfg.layout_hints, block_sizes, names=cfg.layer_names, engine_type=cfg.engine_type
        )
        supported = type(self).supported_kv_formats
        if supported is not None:
            for index, lay in enumerate(layouts):
                if lay.kv_format not in supported:
                    raise LayoutError(
                        f"{self.layer_name(index)}: {type(self).__name__} does not serve the "
                        f"{lay.kv_format.value} format (it serves: "
                        f"{', '.join(f.value for f in supported)})"
                    )
        manager = KVLayerGroupsManager(
            layouts,
            engine_groups,
            tokens_per_chunk=cfg.lmcache_tokens_per_chunk,
            separate_object_groups=cfg.separate_object_groups,
            full_sw_kv=cfg.full_sw_kv,
        )
        self._device = device
        self._tensors = flat
        self._layouts = layouts
        self._manager = manager
        self._num_blocks = min(lay.num_blocks for lay in layouts)
        # Engine group -> the engine block ids all its kernel groups can address.
        self._engine_group_blocks = [
            min(kg.num_engine_blocks for kg in manager.kernel_groups if kg.engine_group_idx == eg.index)
            for eg in manager.engine_groups
        ]
        self._kv_pointers = [
            torch.tensor(
                [t.data_ptr() for i in kg.layer_indices for t in _tensors_of(layers[i])], dtype=torch.int64
            ).to(device)
            for kg in manager.kernel_groups
        ]

        self._staging_layout = StagingLayout.build(manager, cfg.max_batch_size)
        staging = self.allocate_staging(self._staging_layout.total_nbytes)
        if (
            staging.dtype != torch.uint8
            or staging.dim() != 1
            or staging.numel() < self._staging_layout.total_nbytes
            or staging.device != device
            or staging.data_ptr() % _STAGING_BASE_ALIGN
        ):
            raise TypeError(
                f"{type(self).__name__}.allocate_staging must return a 1-D uint8 tensor of at "
                f"least {self._staging_layout.total_nbytes} bytes on {device}, "
                f"{_STAGING_BASE_ALIGN}-byte aligned; got {staging.dtype} {tuple(staging.shape)} "
                f"on {staging.device} at {staging.data_ptr():#x}"
            )
        self._staging: torch.Tensor | None = staging
        slot_bytes = self._staging_layout.slot_nbytes
        self._slot_kg_views = [
            [
                staging.narrow(0, s * slot_bytes + off, nbytes)
                .view(kg.dtype)
                .view(kg.kv_size, kg.num_layers, kg.tokens_per_slot, kg.hidden_dim)
                for kg, (off, nbytes) in zip(
                    manager.kernel_groups, self._staging_layout.kernel_group_spans, strict=True
                )
            ]
            for s in range(cfg.max_batch_size)
        ]
        self._movers = [
            GroupMover(
                [plane_views(layers[i], layouts[i]) for i in kg.layer_indices],
                [self._slot_kg_views[s][kg.index] for s in range(cfg.max_batch_size)],
                block_size=kg.block_size,
                num_kv_heads=kg.num_kv_heads,
                gather_words=type(self).store_word_dtypes,
                scatter_words=type(self).retrieve_word_dtypes,
            )
            for kg in manager.kernel_groups
        ]
        self._stacked = [mover.stacked for mover in self._movers]
        self._block_orders = [
            block_order(_tensors_of(layers[kg.layer_indices[0]]), layouts[kg.layer_indices[0]])
            for kg in manager.kernel_groups
        ]
        self._block_movers: list[BlockMover] = []
        if cfg.chunk_format == "blocks":
            for kg in manager.kernel_groups:
                if kg.tokens_per_slot % kg.block_size:
                    raise LayoutError(
                        f"kernel group {kg.index} (layers {list(kg.layer_indices)}): chunk_format "
                        f"'blocks' keeps whole blocks, but the group keeps {kg.tokens_per_slot} tokens "
                        f"of a chunk (sliding window {kg.sliding_window}), not a multiple of its block "
                        f"size {kg.block_size}; use chunk_format='tokens' or full_sw_kv=True"
                    )
            self._block_movers = [
                BlockMover(
                    [_tensors_of(layers[i]) for i in kg.layer_indices],
                    layouts[kg.layer_indices[0]],
                    slot_region=self._slot_kg_views[0][kg.index].reshape(-1),
                    blocks_per_slot=kg.tokens_per_slot // kg.block_size,
                    gather_words=type(self).store_word_dtypes,
                    scatter_words=type(self).retrieve_word_dtypes,
                )
                for kg in manager.kernel_groups
            ]
            self._stacked = [mover.stacked for mover in self._block_movers]
        # Enough block ids for every slot's chunk in every engine group.
        per_chunk = sum(-(-cfg.lmcache_tokens_per_chunk // eg.block_size) for eg in manager.engine_groups)
        self._block_ids_capacity = cfg.max_batch_size * per_chunk
        self._block_ids_buffer: torch.Tensor | None = torch.empty(
            self._block_ids_capacity, dtype=torch.int64, device=device
        )
        # The tensor block ids one chunk's transfer plan needs, over all kernel groups.
        kernel_ids = sum(
            -(-cfg.lmcache_tokens_per_chunk // kg.engine_block_size) * kg.blocks_per_engine_block
            for kg in manager.kernel_groups
        )
        self._kernel_ids_buffer: torch.Tensor | None = torch.empty(
            kernel_ids, dtype=torch.int64, device=device
        )
        self._stream = self.create_stream()

    # -- customization points ----------------------------------------------------------

    def allocate_staging(self, nbytes: int) -> torch.Tensor:
        """Return a 64-byte aligned 1-D uint8 tensor of at least ``nbytes`` on :attr:`device`."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def create_stream(self) -> Any:
        """Return the stream object :attr:`stream` exposes (default :class:`NullStream`)."""
        return NullStream()

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        """Make device work issued inside this block run on :attr:`stream`.

        Transfers enter it themselves; a server enters it too to order its own
        work (waiting on an engine's event, say) with the transfers. No-op here.
        """
        yield

    def synchronize(self) -> None:
        """Block until every transfer enqueued on :attr:`stream` has finished."""
        self._stream.synchronize()

    def store(self, plan: ChunkTransfer) -> None:
        """Gather ``plan`` from the paged blocks into its parts' buffers (runs on the stream)."""
        movers, slot = self._movers_of(plan)
        for part in plan.groups:
            movers[part.kernel_group_idx].gather(slot, part)

    def retrieve(self, plan: ChunkTransfer) -> None:
        """Scatter ``plan``'s parts' buffers into its paged blocks (runs on the stream)."""
        movers, slot = self._movers_of(plan)
        for part in plan.groups:
            movers[part.kernel_group_idx].scatter(slot, part)

    def _movers_of(self, plan: ChunkTransfer) -> tuple[Sequence[GroupMover | BlockMover], int | None]:
        """The movers of the plan's chunk format, and the slot whose cached views they may use."""
        movers = self._block_movers if plan.chunk_format == "blocks" else self._movers
        return movers, plan.slot if plan.staged else None

    def allocate_chunk(self) -> list[torch.Tensor]:
        """Host tensors for one chunk: one 1-D uint8 tensor per object group.

        They are views of one allocation laid out like a staging slot, so the movers'
        word types fit them (:meth:`read_chunk` gathers straight into them on the host).
        On the host the allocation reuses the memory of chunks nothing holds any more
        (else a fresh mapping, huge pages requested); pinned when :attr:`device` is not
        the host. Contents are uninitialised.
        """
        layout = self._staging_layout
        device = self._device.type != "cpu"
        whole = host_empty(layout.slot_nbytes, pin=device and layout.slot_nbytes < HUGE_PAGE_BYTES)
        if device:
            POOL.register_once(whole, self.register_host_memory)
        return [whole.narrow(0, off, nbytes) for off, nbytes in layout.object_group_spans]

    def prepare_host_memory(
        self, limit: int, *, ahead: int = DEFAULT_AHEAD_BYTES, eager: bool = False
    ) -> None:
        """Have host memory for this context's chunks mapped and faulted in ahead of use.

        A server calls it once a context registers (``limit``: its memory bound): a
        background thread keeps ``ahead`` bytes of chunk buffers ready for
        :meth:`allocate_chunk`, or, ``eager``, fills ``limit``. Never blocks.
        """
        POOL.prepare(self._staging_layout.slot_nbytes, limit=limit, ahead=ahead, eager=eager)

    def register_host_memory(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Make host memory ``[address, address + nbytes)`` fast to copy to and from the device.

        Called once per host mapping a device context's chunks use (the server's memory,
        prepared ahead of use: see ``_kv.hostalloc``); what it returns is called before the
        mapping is unmapped. Default: nothing (copies from pageable memory still work, at
        the cost of a staging copy in the driver). The cuda backend page-locks it
        (``cudaHostRegister``).
        """
        return None

    def read_chunks(self, chunks: Sequence[Sequence[Sequence[int]]]) -> list[list[torch.Tensor]]:
        """Copy a batch of chunks out of the paged blocks into fresh host tensors, one list per chunk.

        ``chunks[i]`` is one chunk's block ids per engine group (as :meth:`read_chunk`
        takes them). Up to :attr:`max_batch_size` chunks are in flight at once, each in
        its own staging slot, so on a device the gather of one overlaps the host copy of
        another; returns once every byte has landed.
        """
        out: list[list[torch.Tensor]] = []
        for start in range(0, len(chunks), self.max_batch_size):
            for slot, block_ids in enumerate(chunks[start : start + self.max_batch_size]):
                tensors = self.allocate_chunk()
                self.read_chunk(block_ids, tensors, slot=slot)
                out.append(tensors)
            self.synchronize()
        return out

    def write_chunks(
        self,
        chunks: Sequence[tuple[Sequence[Sequence[int]], Sequence[torch.Tensor]]],
        *,
        before_batch: Callable[[int], None] | None = None,
    ) -> None:
        """Copy a batch of chunks (block ids per engine group, host tensors) into the paged blocks.

        The inverse of :meth:`read_chunks`, pipelined the same way. ``before_batch(done)``
        runs before each batch of :attr:`max_batch_size` chunks (``done`` written so far):
        a caller's deadline check, which may raise to stop between batches.
        """
        for start in range(0, len(chunks), self.max_batch_size):
            if before_batch is not None:
                before_batch(start)
            for slot, (block_ids, src) in enumerate(chunks[start : start + self.max_batch_size]):
                self.write_chunk(block_ids, src, slot=slot)
            self.synchronize()

    def device_event_class(self) -> type[DeviceEvent] | None:
        """The event class :meth:`wait_event` opens handles with; None: no events here.

        Default: what the ``lmcache_platform_device_event_class`` hook of the backend
        selected for :attr:`device_type` gives (None for a hand-installed class).
        """
        from .._plugins.registry import REGISTRY  # the registry imports this module

        return REGISTRY.device_event_class(type(self).device_type)

    def release(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Free device resources (registrations, events). Called once by :meth:`close`."""

    def prefault_memory(self) -> int:
        """Prepare the engine's memory for transfers ahead of them; bytes prepared.

        A server calls it once after registering the context, on a thread of its own,
        while transfers may already run: an override must be safe beside them and stop
        soon once :meth:`close` begins. Default: nothing to do (0).
        """
        return 0

    # -- properties --------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device the engine's KV tensors live on (and the staging buffer)."""
        return self._device

    @property
    def chunk_format(self) -> str:
        """``"tokens"`` (token-major chunks) or ``"blocks"`` (the engine's own blocks)."""
        return self.config.chunk_format

    @property
    def chunk_nbytes(self) -> list[int]:
        """Bytes of each object group of one chunk, the sizes of its host tensors."""
        return [nbytes for _, nbytes in self._staging_layout.object_group_spans]

    @property
    def kv_tensors(self) -> list[torch.Tensor]:
        """The reopened per-layer tensors, as the engine shaped them (empty once closed)."""
        return self._tensors

    @property
    def num_layers(self) -> int:
        """Layers registered (a (K, V) pair of wrappers is one layer)."""
        return len(self._layouts)

    @property
    def num_blocks(self) -> int:
        """Blocks per layer, the smallest if layers differ; the shared block-id space."""
        return self._num_blocks

    @property
    def max_batch_size(self) -> int:
        """Chunk slots in the staging buffer."""
        return self.config.max_batch_size

    @property
    def stream(self) -> Any:
        """The stream transfers run on (see :meth:`create_stream`)."""
        return self._stream

    @property
    def kv_layer_groups_manager(self) -> KVLayerGroupsManager:
        """The context's engine, kernel and object groups."""
        return self._manager

    @property
    def hidden_dim_sizes(self) -> list[int]:
        """Per kernel group, the elements of one token of one plane (heads x head size)."""
        return [kg.hidden_dim for kg in self._manager.kernel_groups]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (or construction failed)."""
        return self._closed

    # -- per-group queries -------------------------------------------------------------

    def _kg(self, kernel_group_idx: int) -> int:
        n = self._manager.num_kernel_groups
        if not _is_int(kernel_group_idx) or not 0 <= kernel_group_idx < n:
            raise TransferError(f"kernel group {kernel_group_idx!r} out of range 0..{n - 1}")
        return kernel_group_idx

    def _slot(self, slot: int) -> int:
        self._check_open()
        n = self.max_batch_size
        if not _is_int(slot) or not 0 <= slot < n:
            raise TransferError(f"staging slot {slot!r} out of range 0..{n - 1}")
        return slot

    def get_kernel_group_kv_pointers(self, kernel_group_idx: int) -> torch.Tensor:
        """1-D int64 tensor of the group's layer base addresses, on :attr:`device`."""
        self._check_open()
        return self._kv_pointers[self._kg(kernel_group_idx)]

    def get_engine_kv_format(self, kernel_group_idx: int) -> KVFormat:
        """The KV format of the group's layers, as discovered from the engine's tensors."""
        return self._manager.kernel_groups[self._kg(kernel_group_idx)].kv_format

    def tokens_kept_per_chunk(self, kernel_group_idx: int) -> int:
        """Tokens of a full chunk the group keeps (fewer than a chunk for a trimmed window)."""
        return self._manager.kernel_groups[self._kg(kernel_group_idx)].tokens_per_slot

    def get_slots_per_chunk_in_sw(self, kernel_group_idx: int) -> int:
        """Upstream LMCache's name for :meth:`tokens_kept_per_chunk` (it counts tokens, not
        staging slots); kept so ported code runs."""
        return self.tokens_kept_per_chunk(kernel_group_idx)

    def get_kernel_group_shape_dtype(
        self, num_tokens: int, kernel_group_idx: int
    ) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of ``num_tokens`` tokens of the group in chunk layout.

        The shape is ``[kv, layers, kept, hidden]``: ``kv`` is 2 (1 for MLA), and
        ``kept`` the tokens the group keeps when ``num_tokens`` is cut into chunks
        (all of them, unless the group is a trimmed sliding window).
        """
        import torch

        kg = self._manager.kernel_groups[self._kg(kernel_group_idx)]
        if not _is_int(num_tokens) or num_tokens < 0:
            raise TransferError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        kept = self._manager.kept_tokens(num_tokens, kg.index)
        return torch.Size((kg.kv_size, kg.num_layers, kept, kg.hidden_dim)), kg.dtype

    def calculate_num_blocks(self, num_tokens: int, kernel_group_idx: int) -> int:
        """Block ids covering a chunk of ``num_tokens`` tokens in the group's engine group."""
        self._kg(kernel_group_idx)
        if not _is_int(num_tokens) or num_tokens < 0:
            raise TransferError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return self._manager.blocks_for(num_tokens, kernel_group_idx)

    def get_temp_kernel_group_buffer(self, slot: int, kernel_group_idx: int) -> torch.Tensor:
        """Typed staging view ``[kv, layers, tokens_per_slot, hidden]`` of one group in a slot.

        In the ``"blocks"`` chunk format the same bytes hold the group's whole blocks
        (``[layers, tensors, *outer, blocks, *inner]``; see ``report_status()``'s ``block_order``).
        """
        return self._slot_kg_views[self._slot(slot)][self._kg(kernel_group_idx)]

    def get_temp_object_group_buffer(self, slot: int, object_group_idx: int) -> torch.Tensor:
        """Flat uint8 view spanning exactly the object group's kernel-group regions in a slot."""
        n = self._manager.num_object_groups
        if not _is_int(object_group_idx) or not 0 <= object_group_idx < n:
            raise TransferError(f"object group {object_group_idx!r} out of range 0..{n - 1}")
        return self._object_group_view(self._slot(slot), object_group_idx)

    def cache_size_per_token(self) -> int:
        """Bytes one token occupies in the engine's paged caches, over all layers."""
        return sum(kg.bytes_per_token for kg in self._manager.kernel_groups)

    def report_status(self) -> dict[str, Any]:
        """A JSON-ready summary of the layout, groups and staging buffer."""
        m = self._manager
        return {
            "device": str(self._device),
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "tokens_per_chunk": self.lmcache_tokens_per_chunk,
            "chunk_format": self.chunk_format,
            "max_batch_size": self.max_batch_size,
            "cache_size_per_token": self.cache_size_per_token(),
            "staging_bytes": self._staging_layout.total_nbytes,
            "kernel_groups": [
                {
                    "kernel_group_idx": kg.index,
                    "engine_group_idx": kg.engine_group_idx,
                    "object_group_idx": kg.object_group_idx,
                    "layer_indices": list(kg.layer_indices),
                    "num_layers": kg.num_layers,
                    "kv_format": kg.kv_format.value,
                    "is_mla": kg.is_mla,
                    "dtype": str(kg.dtype).removeprefix("torch."),
                    "layer_shape": list(kg.layer_shape),
                    "num_blocks": kg.num_blocks,
                    "block_size": kg.block_size,
                    "num_kv_heads": kg.num_kv_heads,
                    "head_size": kg.head_size,
                    "sliding_window": kg.sliding_window,
                    "tokens_per_slot": kg.tokens_per_slot,
                    "stacked": self._stacked[kg.index],
                    "block_order": self._block_orders[kg.index],
                }
                for kg in m.kernel_groups
            ],
            "object_groups": [
                {
                    "object_group_idx": og.index,
                    "kernel_group_indices": list(og.kernel_group_indices),
                    "sliding_window": og.sliding_window,
                    "nbytes_per_slot": self._staging_layout.object_group_spans[og.index][1],
                }
                for og in m.object_groups
            ],
        }

    # -- block ids and transfers -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the cache context is closed; nothing was written")

    def _validate_ids(
        self, block_ids_per_group: Sequence[Sequence[int]], *, skip: bool = False
    ) -> list[list[int]]:
        """Per engine group, the ids as ints, each checked against the group's block space.

        With ``skip`` (a retrieve), :data:`SKIP_BLOCK` is accepted too: positions of no block.
        """
        n_groups = self._manager.num_engine_groups
        if len(block_ids_per_group) != n_groups:
            raise TransferError(
                f"expected block ids for {n_groups} engine group(s), got {len(block_ids_per_group)}"
            )
        out = []
        for g, ids in enumerate(block_ids_per_group):
            try:
                values = [operator.index(x) for x in _as_list(ids)]
            except TypeError as exc:
                raise TransferError(f"engine group {g}: block ids must be ints ({exc})") from None
            limit = self._engine_group_blocks[g]
            for pos, value in enumerate(values):
                if value == SKIP_BLOCK and not skip:
                    raise TransferError(
                        f"engine group {g}: block id {SKIP_BLOCK} (skip) at position {pos} is allowed "
                        "only in a retrieve; a store reads every block it names"
                    )
                if not 0 <= value < limit and not (skip and value == SKIP_BLOCK):
                    raise TransferError(
                        f"engine group {g}: block id {value} at position {pos} is out of range 0..{limit - 1}"
                    )
            out.append(values)
        return out

    def _stage(self, ids: list[list[int]]) -> list[torch.Tensor]:
        import torch

        flat = [x for group in ids for x in group]
        if len(flat) > self._block_ids_capacity:
            raise TransferError(
                f"{len(flat)} block ids exceed the staging capacity of {self._block_ids_capacity}"
            )
        host = torch.tensor(flat, dtype=torch.int64)
        assert self._block_ids_buffer is not None  # callers check the context is open
        staged = self._block_ids_buffer[: len(flat)]
        staged.copy_(host, non_blocking=True)
        views, start = [], 0
        for group in ids:
            views.append(staged.narrow(0, start, len(group)))
            start += len(group)
        return views

    def stage_block_ids(self, block_ids_per_group: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Copy block ids (one list per engine group) to :attr:`device`; one view per group.

        Every id is checked against its group's block count, and the total against
        the buffer's capacity, before anything is copied (:class:`TransferError`).
        Call it inside :meth:`stream_context`; the views stay valid until the next
        staging call on this context.
        """
        self._check_open()
        ids = self._validate_ids(block_ids_per_group)
        with self._transfer_lock:
            self._check_open()  # again: a close() may have won the race for the lock
            return self._stage(ids)

    def _plan(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        slot: int,
        num_tokens: int | None,
        *,
        retrieve: bool,
    ) -> tuple[int, int, list[list[int]]]:
        """Validate a transfer request completely; returns ``(slot, num_tokens, ids)``."""
        self._check_open()
        slot = self._slot(slot)
        chunk = self.lmcache_tokens_per_chunk
        if num_tokens is None:
            num_tokens = chunk
        if not _is_int(num_tokens) or not 1 <= num_tokens <= chunk:
            raise TransferError(f"num_tokens must be an int in 1..{chunk}, got {num_tokens!r}")
        if self.chunk_format == "blocks":
            for kg in self._manager.kernel_groups:
                if num_tokens % kg.block_size:
                    raise TransferError(
                        f"chunk_format 'blocks' moves whole blocks: num_tokens {num_tokens} is not a "
                        f"multiple of kernel group {kg.index}'s block size {kg.block_size}"
                    )
        ids = self._validate_ids(block_ids_per_group, skip=retrieve)
        for eg, group_ids in zip(self._manager.engine_groups, ids, strict=True):
            want = -(-num_tokens // eg.block_size)
            if len(group_ids) != want:
                raise TransferError(
                    f"engine group {eg.index}: {num_tokens} tokens with block size "
                    f"{eg.block_size} need {want} block ids, got {len(group_ids)}"
                )
        if retrieve:
            for eg, group_ids in zip(self._manager.engine_groups, ids, strict=True):
                kgs = [kg for kg in self._manager.kernel_groups if kg.engine_group_idx == eg.index]
                first = min(self._manager.kept_range(num_tokens, kg.index)[0] for kg in kgs)
                written = [b for b in group_ids[first // eg.block_size :] if b != SKIP_BLOCK]
                if len(set(written)) != len(written):
                    raise TransferError(
                        f"engine group {eg.index}: retrieve would write block ids {written} "
                        f"and some repeat; every written block must be distinct"
                    )
        return slot, num_tokens, ids

    def validate_transfer(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        *,
        num_tokens: int | None = None,
        retrieve: bool = False,
    ) -> None:
        """Run every check a store (or, with ``retrieve``, a retrieve) would run; move nothing.

        Lets a caller validate a multi-chunk request up front so that a bad last chunk
        does not leave earlier chunks written. Raises :class:`TransferError`.
        """
        self._plan(block_ids_per_group, 0, num_tokens, retrieve=retrieve)

    def _transfer_plan(
        self,
        slot: int,
        num_tokens: int,
        ids: list[list[int]],
        host: Sequence[torch.Tensor] | None = None,
    ) -> ChunkTransfer:
        """Per kernel group, its kept positions and the tensor blocks holding them, staged.

        Engine block ``b`` of a group split into ``r`` kernel blocks is tensor blocks
        ``b * r .. b * r + r - 1``; all groups' ids go to the device in one copy. The
        parts' buffers are slot ``slot``'s, or views of the chunk's ``host`` tensors.
        """
        import torch

        blocks = self.chunk_format == "blocks"
        buffers = [
            self._slot_kg_views[slot][kg.index] if host is None else self._host_view(host, kg.index)
            for kg in self._manager.kernel_groups
        ]

        runs = []  # (kernel group, first position, positions, tensor ids, staging offset)
        for kg in self._manager.kernel_groups:
            first, count = self._manager.kept_range(num_tokens, kg.index)
            r = kg.blocks_per_engine_block
            tensor_ids = [
                SKIP_BLOCK if b == SKIP_BLOCK else b * r + j
                for b in ids[kg.engine_group_idx]
                for j in range(r)
            ]
            for run in _unskipped(first, count, kg.block_size, tensor_ids[first // kg.block_size :]):
                runs.append((kg, *run, run[0] - first))
        flat = [x for run in runs for x in run[3]]
        assert self._kernel_ids_buffer is not None  # callers check the context is open
        staged = self._kernel_ids_buffer[: len(flat)]
        staged.copy_(torch.tensor(flat, dtype=torch.int64), non_blocking=True)
        parts, start = [], 0
        for kg, first, count, tensor_ids, offset in runs:
            parts.append(
                GroupTransfer(
                    kernel_group_idx=kg.index,
                    first_token=first,
                    num_tokens=count,
                    block_ids=staged.narrow(0, start, len(tensor_ids)),
                    block_id_list=tuple(tensor_ids),
                    buffer=buffers[kg.index].reshape(-1) if blocks else buffers[kg.index],
                    staging_offset=offset,
                )
            )
            start += len(tensor_ids)
        return ChunkTransfer(
            slot=slot,
            num_tokens=num_tokens,
            groups=tuple(parts),
            staged=host is None,
            chunk_format=self.chunk_format,
        )

    def _host_view(self, host: Sequence[torch.Tensor], kernel_group_idx: int) -> torch.Tensor:
        """Kernel group ``kernel_group_idx``'s region of a chunk's host tensors, typed like staging's."""
        kg = self._manager.kernel_groups[kernel_group_idx]
        og_offset = self._staging_layout.object_group_spans[kg.object_group_idx][0]
        offset, nbytes = self._staging_layout.kernel_group_spans[kg.index]
        region = host[kg.object_group_idx].narrow(0, offset - og_offset, nbytes).view(kg.dtype)
        return region.view(kg.kv_size, kg.num_layers, kg.tokens_per_slot, kg.hidden_dim)

    def store_chunk(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        *,
        slot: int = 0,
        num_tokens: int | None = None,
    ) -> None:
        """Gather one chunk from the paged blocks into staging slot ``slot``.

        ``block_ids_per_group[g]`` lists, for engine group ``g``, the blocks holding
        the chunk's tokens in order: exactly ``ceil(num_tokens / block_size)`` ids
        (``num_tokens`` defaults to a full chunk). A trimmed sliding-window group
        reads only the blocks holding its kept tokens; the other ids are still
        bounds-checked. Every argument is validated before anything is copied.
        On a device with streams the copy is enqueued on :attr:`stream`.
        """
        self._run(block_ids_per_group, slot, num_tokens, retrieve=False)

    def retrieve_chunk(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        *,
        slot: int = 0,
        num_tokens: int | None = None,
    ) -> None:
        """Scatter staging slot ``slot`` into the given blocks; the inverse of :meth:`store_chunk`.

        Only the kept tokens are written: the first ``num_tokens`` positions of the
        chunk (the last ``tokens_per_slot`` of them for a trimmed sliding-window
        group); every other token of every block stays untouched. The written
        blocks must be distinct. A block id of ``-1`` (``SKIP_BLOCK``) names no block:
        its positions are not written (vLLM's null blocks); a store refuses it. Every
        argument is validated before anything is written.
        """
        self._run(block_ids_per_group, slot, num_tokens, retrieve=True)

    def read_chunk(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        out: Sequence[torch.Tensor],
        *,
        slot: int = 0,
        num_tokens: int | None = None,
    ) -> None:
        """Copy one chunk from the paged blocks into ``out``, its host tensors.

        ``out[og]`` is a contiguous 1-D uint8 host tensor of :attr:`chunk_nbytes`
        ``[og]`` bytes (:meth:`allocate_chunk` makes such). The block ids and
        ``num_tokens`` mean what they mean for :meth:`store_chunk`. On a host context
        the bytes go straight into ``out`` (one pass); on a device through staging slot
        ``slot`` and one copy to the host, enqueued on :attr:`stream`: call
        :meth:`synchronize` before reading ``out``.
        """
        self._run(block_ids_per_group, slot, num_tokens, retrieve=False, host=out)

    def write_chunk(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        src: Sequence[torch.Tensor],
        *,
        slot: int = 0,
        num_tokens: int | None = None,
    ) -> None:
        """Copy one chunk from ``src``, its host tensors, into the given blocks.

        The inverse of :meth:`read_chunk`, with :meth:`retrieve_chunk`'s rules for the
        block ids (``-1`` skips positions). On a host context the blocks are written
        straight from ``src``; on a device ``src`` is copied into staging slot ``slot``
        first, asynchronously: keep it unchanged until :meth:`synchronize`.
        """
        self._run(block_ids_per_group, slot, num_tokens, retrieve=True, host=src)

    def _check_host(self, host: Sequence[torch.Tensor]) -> bool:
        """Check a chunk's host tensors; True when the movers can use them in place.

        In place needs a host context and tensors whose start is aligned like a
        staging slot's (the movers' word types assume it); others go through staging.
        """
        import torch

        sizes = self.chunk_nbytes
        if len(host) != len(sizes):
            raise TransferError(f"expected {len(sizes)} host tensors (one per object group), got {len(host)}")
        for og, (t, nbytes) in enumerate(zip(host, sizes, strict=True)):
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.uint8
                or t.dim() != 1
                or t.numel() != nbytes
                or t.device.type != "cpu"
                or not t.is_contiguous()
            ):
                got = (
                    f"{t.dtype} {tuple(t.shape)} on {t.device}"
                    if isinstance(t, torch.Tensor)
                    else type(t).__name__
                )
                raise TransferError(
                    f"object group {og}: expected a contiguous 1-D uint8 host tensor of {nbytes} "
                    f"bytes, got {got}"
                )
        return self._device.type == "cpu" and all(t.storage_offset() % STAGING_ALIGN == 0 for t in host)

    def _run(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        slot: int,
        num_tokens: int | None,
        *,
        retrieve: bool,
        host: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Validate in full, then plan and run the store or retrieve under the transfer lock.

        With ``host`` tensors: moved in place where :meth:`_check_host` allows, else
        through slot ``slot`` and one copy each way, in the same critical section.
        """
        slot, num_tokens, ids = self._plan(block_ids_per_group, slot, num_tokens, retrieve=retrieve)
        direct = host is not None and self._check_host(host)
        staged_host = None if direct else host
        with self._transfer_lock:
            self._check_open()  # again: a close() may have won the race for the lock
            with self.stream_context():
                if staged_host is not None and retrieve:
                    for og, src in enumerate(staged_host):
                        self._object_group_view(slot, og).copy_(src, non_blocking=True)
                plan = self._transfer_plan(slot, num_tokens, ids, host if direct else None)
                self.retrieve(plan) if retrieve else self.store(plan)
                if staged_host is not None and not retrieve:
                    for og, out in enumerate(staged_host):
                        out.copy_(self._object_group_view(slot, og), non_blocking=True)

    def _object_group_view(self, slot: int, og: int) -> torch.Tensor:
        off, nbytes = self._staging_layout.object_group_spans[og]
        assert self._staging is not None  # callers check the context is open
        return self._staging.narrow(0, slot * self._staging_layout.slot_nbytes + off, nbytes)

    # -- device events -----------------------------------------------------------------

    def wait_event(self, handle: bytes) -> None:
        """Order this context's next transfers after an engine's event (its ``handle``).

        ``handle`` is what :func:`lmcache_platform.record_event` returned in the engine.
        The wait is enqueued on :attr:`stream` and never blocks the host. Raises
        :class:`TransferError` when this context takes no events (its copies complete
        before they return) or the handle names no event.
        """
        self._check_open()
        cls = self.device_event_class()
        if cls is None:
            raise TransferError(
                f"{type(self).__name__} on {self._device} takes no device events: its copies "
                "complete before they return, so send none"
            )
        with self._transfer_lock:
            self._check_open()
            event = self._events.get(handle)
            if event is None:
                try:
                    event = cls.open(handle, self._device)
                except LMCachePlatformError:
                    raise
                except Exception as exc:  # the backend's own failure: name the handle
                    raise TransferError(
                        f"{cls.__name__} refused a device event handle of {len(handle)} bytes: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                self._events[handle] = event
                while len(self._events) > _MAX_OPEN_EVENTS:
                    self._events.popitem(last=False)[1].close()
            self._events.move_to_end(handle)
            with self.stream_context():
                event.wait()

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for transfers, release device resources and close every wrapper. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            with self._transfer_lock:
                self.synchronize()
                events, self._events = list(self._events.values()), OrderedDict()
                for event in events:
                    event.close()
                self.release()
        finally:
            # Drop every reference to device memory, so it can be freed before the
            # wrappers unmap what the layer views point into.
            self._movers = []
            self._slot_kg_views = []
            self._kv_pointers = []
            self._tensors = []
            self._staging = None
            self._block_ids_buffer = None
            self._kernel_ids_buffer = None
            _close_all(self.kv_caches)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_layers} layers on {self._device}"
        return f"<{type(self).__name__} {state}>"


def _unskipped(
    first: int, count: int, block_size: int, ids: Sequence[int]
) -> Iterator[tuple[int, int, list[int]]]:
    """Split positions ``[first, first + count)``, held by ``ids`` from the block of
    ``first`` on, into runs of real blocks: ``(first position, positions, ids)`` each.

    The one place :data:`SKIP_BLOCK` takes effect: its positions are in no run, so
    nothing reads or writes them. Without skips it yields ``(first, count, ids)`` once.
    """
    base, end = first // block_size, first + count
    run: list[int] = []
    run_start = run_end = first
    for i, block in enumerate(ids):
        lo, hi = max(first, (base + i) * block_size), min(end, (base + i + 1) * block_size)
        if lo >= hi:
            break
        if block == SKIP_BLOCK:
            if run:
                yield run_start, run_end - run_start, run
            run = []
            continue
        if not run:
            run_start = lo
        run.append(block)
        run_end = hi
    if run:
        yield run_start, run_end - run_start, run


def _is_int(value: object) -> bool:
    """An int index, but not a bool (``True`` is never meant as slot 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _tensors_of(layer: LayerTensors) -> tuple[torch.Tensor, ...]:
    return layer if isinstance(layer, tuple) else (layer,)


def _as_list(ids: Sequence[int]) -> list[Any]:
    tolist = getattr(ids, "tolist", None)
    return list(tolist() if callable(tolist) else ids)


def _close_all(wrappers: Sequence[DeviceIPCWrapper]) -> None:
    """Close every wrapper even if some fail; re-raise the first failure."""
    first: BaseException | None = None
    for wrapper in wrappers:
        try:
            wrapper.close()
        except Exception as exc:  # keep closing the rest; the first error is re-raised
            if first is None:
                first = exc
    if first is not None:
        raise first

"""``BaseCacheContext``: server-side view of one engine's registered KV caches.

The base does everything that does not depend on the device: it reopens the
wrappers (``reopen.py``), discovers each layer's layout (``layout.py``), groups
layers (``groups.py``), builds per-kernel-group pointer tensors and the staging
buffer (``staging.py``), checks and plans transfer requests (``plan.py``) and moves
chunks with generic torch ops (``transfer.py``, ``blocks.py``). A backend subclass
only says how its device differs: the contract is :class:`BaseCacheContext`'s docstring.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union

from .._errors import TransferError
from .._events import OpenEvents
from .blocks import BlockMover
from .groups import KVLayerGroupsManager, discover_groups
from .hostalloc import DEFAULT_AHEAD_BYTES, HUGE_PAGE_BYTES, POOL, host_empty
from .layout import LayerTensors
from .movers import build_movers
from .plan import CheckedChunk, ChunkIds, ChunkPlanner, is_int, to_device
from .queries import GroupQueries
from .reopen import close_all, one_device, reopen_layers, tensors_of
from .staging import StagingLayout
from .transfer import GATHER_WORD_DTYPES, SCATTER_WORD_DTYPES, ChunkTransfer, GroupMover

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
T = TypeVar("T")


class NullStream:
    """The stream of a device whose copies complete before they return (the host)."""

    def synchronize(self) -> None:
        """Nothing is ever pending."""

    def query(self) -> bool:
        """Always idle."""
        return True

    def __repr__(self) -> str:
        return "NullStream()"


class BaseCacheContext(GroupQueries, abc.ABC):
    """Base of every backend's cache context: the server-side view of one engine's KV caches.

    Every member has a portable default, so a backend may add nothing but
    ``device_type``; the base itself refuses to be instantiated without one.

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
      - :meth:`copy_into_slot` / :meth:`copy_out_of_slot` -- the host copies of
        :meth:`write_chunk` / :meth:`read_chunk` on a device (default: on :attr:`stream`;
        a device with a copy stream overlaps one chunk's copy with another's gather).
      - :meth:`allocate_chunk` -- fresh host tensors for one chunk (default: huge-page
        advised on the host, pinned for a device; a backend may register them with a NIC).
      - :meth:`device_event_class` -- the :class:`~lmcache_platform.DeviceEvent` class that
        :meth:`wait_event` opens handles with (default: ``config.device_event_class``, which
        ``create_cache_context`` fills from the selected backend's hook).
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
    ``"blocks"`` keeps the engine's own block order, so a move copies whole blocks.
    Both hold the same bytes per chunk in the same regions.
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
        self._events = OpenEvents()  # those wait_event opened
        attempted: list[DeviceIPCWrapper] = []  # closed again if construction fails
        try:
            layers = reopen_layers(self.layer_wrappers, attempted)
            self._build(layers)
        except BaseException:
            self._closed = True
            try:
                close_all(attempted)
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

        flat = [t for entry in layers for t in tensors_of(entry)]
        device = one_device(flat, type(self).device_type, type(self).__name__)
        cfg = self.config
        layouts, manager = discover_groups(
            layers,
            cfg,
            supported=type(self).supported_kv_formats,
            owner=type(self).__name__,
            layer_name=self.layer_name,
        )
        self._device = device
        self._tensors = flat
        self._layouts = layouts
        self._manager = manager
        self._num_blocks = min(lay.num_blocks for lay in layouts)
        self._planner = ChunkPlanner(manager, chunk_format=cfg.chunk_format)
        self._kv_pointers = [
            torch.tensor(
                [t.data_ptr() for i in kg.layer_indices for t in tensors_of(layers[i])], dtype=torch.int64
            ).to(device)
            for kg in manager.kernel_groups
        ]

        self._staging_layout = StagingLayout.build(manager, cfg.max_batch_size)
        staging = self.allocate_staging(self._staging_layout.total_nbytes)
        self._staging_layout.check_buffer(staging, device, f"{type(self).__name__}.allocate_staging")
        self._staging: torch.Tensor | None = staging
        self._slot_kg_views = self._staging_layout.kernel_group_views(staging, manager)
        self._movers, self._block_movers, self._stacked, self._block_orders = build_movers(
            layers,
            layouts,
            manager,
            self._slot_kg_views,
            chunk_format=cfg.chunk_format,
            gather_words=type(self).store_word_dtypes,
            scatter_words=type(self).retrieve_word_dtypes,
        )
        self._block_ids_capacity = cfg.max_batch_size * self._planner.block_ids_per_chunk
        self._block_ids_buffer: torch.Tensor | None = torch.empty(
            self._block_ids_capacity, dtype=torch.int64, device=device
        )
        self._kernel_ids_buffer: torch.Tensor | None = torch.empty(
            self._planner.tensor_ids_per_chunk, dtype=torch.int64, device=device
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
        From 2 MiB on it comes from the process's pool: the memory of chunks nothing
        holds any more, else a slab prepared ahead (else a fresh mapping), registered
        with the device by :meth:`register_host_memory` on the pool's own thread when
        :attr:`device` is not the host; below 2 MiB, pinned there. Contents are
        uninitialised.
        """
        layout = self._staging_layout
        device = self._device.type != "cpu"
        if device:  # once per process: the pool's thread registers its slabs, off this path
            POOL.use_device(self.register_host_memory)
        whole = host_empty(layout.slot_nbytes, pin=device and layout.slot_nbytes < HUGE_PAGE_BYTES)
        return [whole.narrow(0, off, nbytes) for off, nbytes in layout.object_group_spans]

    def prepare_host_memory(
        self, limit: int, *, ahead: int = DEFAULT_AHEAD_BYTES, eager: bool = False
    ) -> None:
        """Have host memory for this context's chunks mapped and faulted in ahead of use.

        A server calls it once a context registers (``limit``: its memory bound): a
        background thread keeps ``ahead`` bytes of chunk buffers ready for
        :meth:`allocate_chunk`, or, ``eager``, fills ``limit``; on a device it also
        registers that memory with the device (:meth:`register_host_memory`) as it is
        prepared. Never blocks.
        """
        POOL.prepare(self._staging_layout.slot_nbytes, limit=limit, ahead=ahead, eager=eager)
        if self._device.type != "cpu":
            POOL.use_device(self.register_host_memory)

    def register_host_memory(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Make host memory ``[address, address + nbytes)`` fast to copy to and from the device.

        Called once per slab of the process's chunk memory, on the thread that prepares
        it (:meth:`prepare_host_memory`), by the first device context's hook: make the
        registration serve every device (CUDA: portable). What it returns is called
        before the memory is unmapped. Raise to say it could not be done: the mapping
        stays pageable, and the server logs and counts it (``host_register_failures``).
        Default: nothing (copies from pageable memory still work, at the cost of a
        staging copy in the driver). The cuda backend page-locks it (``cuMemHostRegister``).
        """
        return None

    def check_chunks(
        self, chunks: Sequence[ChunkIds], *, retrieve: bool = False, name: Callable[[int], str] | None = None
    ) -> list[CheckedChunk]:
        """Check a request's chunks, every one before any moves: the checked chunks to move.

        ``chunks[i]`` is one chunk's block ids per engine group (as :meth:`read_chunk`
        takes them). :meth:`read_chunks` (a store) or, ``retrieve``, :meth:`write_chunks`
        then move them without checking again. A refusal (:class:`TransferError`) names
        the chunk (``name(i)`` where given: a server's key) and says nothing was transferred.
        """
        self._check_open()
        out = []
        for i, chunk in enumerate(chunks):
            try:
                out.append(self._planner.checked(chunk, None, retrieve=retrieve))
            except TransferError as exc:
                which = f"chunk {i}" if name is None else f"chunk {i} ({name(i)})"
                raise TransferError(f"{which}: {exc}; nothing was transferred") from exc
        return out

    def read_chunks(self, chunks: Sequence[ChunkIds], *, event: bytes = b"") -> list[list[torch.Tensor]]:
        """Copy a batch of chunks out of the paged blocks into fresh host tensors, one list per chunk.

        ``chunks[i]`` is one chunk's block ids per engine group, or what
        :meth:`check_chunks` made of them; all are checked before any moves. With an
        engine's ``event`` (:meth:`wait_event`), the reads are ordered after it. Up to
        :attr:`max_batch_size` chunks are in flight at once, each in its own staging
        slot, so on a device the gather of one overlaps the host copy of another;
        returns once every byte has landed.
        """
        checked = self.check_chunks(chunks)
        out: list[list[torch.Tensor]] = []

        def read(slot: int, chunk: CheckedChunk) -> None:
            out.append(self.allocate_chunk())
            self.read_chunk(chunk, out[-1], slot=slot)

        self._in_batches(checked, read, event)
        return out

    def write_chunks(
        self,
        chunks: Sequence[tuple[ChunkIds, Sequence[torch.Tensor]]],
        *,
        event: bytes = b"",
        before_batch: Callable[[int], None] | None = None,
    ) -> None:
        """Copy a batch of chunks (block ids per engine group, host tensors) into the paged blocks.

        The inverse of :meth:`read_chunks`, pipelined the same way; the block ids (as
        :meth:`check_chunks` with ``retrieve`` makes them, or raw) and the host tensors
        of every chunk are checked before any is written. ``before_batch(done)`` runs
        before each batch of :attr:`max_batch_size` chunks (``done`` written so far): a
        caller's deadline check, which may raise to stop between batches.
        """
        checked = self.check_chunks([ids for ids, _ in chunks], retrieve=True)
        for i, (_, host) in enumerate(chunks):
            try:
                self._staging_layout.check_host(host)
            except TransferError as exc:
                raise TransferError(f"chunk {i}: {exc}; nothing was transferred") from exc
        moves = [(chunk, host) for chunk, (_, host) in zip(checked, chunks, strict=True)]
        self._in_batches(moves, lambda slot, c: self.write_chunk(c[0], c[1], slot=slot), event, before_batch)

    def _in_batches(
        self,
        items: Sequence[T],
        move: Callable[[int, T], None],
        event: bytes,
        before: Callable[[int], None] | None = None,
    ) -> None:
        """``move(slot, item)`` for up to :attr:`max_batch_size` items at a time, then synchronize.

        With an ``event``, wait for it first (even for no items: later transfers are
        ordered after it too). A failure mid-batch still waits for the copies already
        issued: the host memory they land in may be handed out again once this returns.
        """
        if event:
            self.wait_event(event)
        for start in range(0, len(items), self.max_batch_size):
            if before is not None:
                before(start)
            try:
                for slot, item in enumerate(items[start : start + self.max_batch_size]):
                    move(slot, item)
            finally:
                self.synchronize()

    def device_event_class(self) -> type[DeviceEvent] | None:
        """The event class :meth:`wait_event` opens handles with; None: no events here.

        Default: ``config.device_event_class``, what the selected backend's
        ``lmcache_platform_device_event_class`` hook gave when ``create_cache_context``
        built this context (None for a context constructed by hand).
        """
        return self.config.device_event_class

    def release(self) -> None:
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

    # -- per-group queries (the rest in queries.py) ------------------------------------

    def _slot(self, slot: int) -> int:
        self._check_open()
        n = self.max_batch_size
        if not is_int(slot) or not 0 <= slot < n:
            raise TransferError(f"staging slot {slot!r} out of range 0..{n - 1}")
        return slot

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
                {**kg.describe(), "stacked": self._stacked[i], "block_order": self._block_orders[i]}
                for i, kg in enumerate(m.kernel_groups)
            ],
            "object_groups": [
                {**og.describe(), "nbytes_per_slot": self._staging_layout.object_group_spans[og.index][1]}
                for og in m.object_groups
            ],
        }

    # -- block ids and transfers -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the cache context is closed; nothing was written")

    def _stage(self, ids: list[list[int]]) -> list[torch.Tensor]:
        total = sum(len(group) for group in ids)
        if total > self._block_ids_capacity:
            raise TransferError(
                f"{total} block ids exceed the staging capacity of {self._block_ids_capacity}"
            )
        assert self._block_ids_buffer is not None  # callers check the context is open
        return to_device(self._block_ids_buffer, ids)

    def stage_block_ids(self, block_ids_per_group: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Copy block ids (one list per engine group) to :attr:`device`; one view per group.

        Every id is checked against its group's block count, and the total against
        the buffer's capacity, before anything is copied (:class:`TransferError`).
        Call it inside :meth:`stream_context`; the views stay valid until the next
        staging call on this context.
        """
        self._check_open()
        ids = self._planner.validate_ids(block_ids_per_group)
        with self._transfer_lock:
            self._check_open()  # again: a close() may have won the race for the lock
            return self._stage(ids)

    def validate_transfer(
        self,
        block_ids_per_group: Sequence[Sequence[int]],
        *,
        num_tokens: int | None = None,
        retrieve: bool = False,
    ) -> None:
        """Run every check a store (or, with ``retrieve``, a retrieve) would run; move nothing.

        Raises :class:`TransferError`. To check a request's chunks up front and move them
        without checking again, use :meth:`check_chunks`.
        """
        self._check_open()
        self._planner.check(block_ids_per_group, num_tokens, retrieve=retrieve)

    def store_chunk(
        self,
        block_ids_per_group: ChunkIds,
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
        block_ids_per_group: ChunkIds,
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
        block_ids_per_group: ChunkIds,
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
        ``slot`` and one copy to the host (:meth:`copy_out_of_slot`), not waited for:
        call :meth:`synchronize` before reading ``out`` (an event recorded on
        :attr:`stream` covers the gather, not necessarily the copy). Between this and the
        seed API's own use of the same slot (:meth:`store_chunk`, :meth:`retrieve_chunk`
        and the ``get_temp_*`` views), call :meth:`synchronize` too.
        """
        self._run(block_ids_per_group, slot, num_tokens, retrieve=False, host=out)

    def write_chunk(
        self,
        block_ids_per_group: ChunkIds,
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

    def _run(
        self,
        block_ids_per_group: ChunkIds,
        slot: int,
        num_tokens: int | None,
        *,
        retrieve: bool,
        host: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Validate in full, then plan and run the store or retrieve under the transfer lock.

        With ``host`` tensors: moved in place on a host context when they are aligned like
        a slot, else through slot ``slot`` and one copy each way, in the same critical section.
        """
        self._check_open()
        slot = self._slot(slot)
        chunk = self._planner.checked(block_ids_per_group, num_tokens, retrieve=retrieve)
        direct = host is not None and self._staging_layout.check_host(host) and self._device.type == "cpu"
        staged_host = None if direct else host
        with self._transfer_lock:
            self._check_open()  # again: a close() may have won the race for the lock
            with self.stream_context():
                if staged_host is not None and retrieve:
                    self.copy_into_slot(slot, staged_host)
                buffers = (
                    [self._staging_layout.host_view(host, kg) for kg in self._manager.kernel_groups]
                    if direct and host is not None
                    else self._slot_kg_views[slot]
                )
                assert self._kernel_ids_buffer is not None  # checked open under the lock
                plan = self._planner.transfer(
                    chunk, slot=slot, buffers=buffers, ids_buffer=self._kernel_ids_buffer, staged=not direct
                )
                self.retrieve(plan) if retrieve else self.store(plan)
                if staged_host is not None and not retrieve:
                    self.copy_out_of_slot(slot, staged_host)

    def copy_into_slot(self, slot: int, host: Sequence[torch.Tensor]) -> None:
        """Copy one chunk's host tensors (one per object group) into staging slot ``slot``.

        The first step of :meth:`write_chunk` on a device, before the scatter, issued
        inside :meth:`stream_context`, not waited for. Default: one ``copy_`` per object
        group on :attr:`stream`. A device that copies on a stream of its own, so the copy
        of one chunk overlaps the scatter of another, overrides it and orders the scatter
        after the copy (the cuda backend does).
        """
        for og, src in enumerate(host):
            self._object_group_view(slot, og).copy_(src, non_blocking=True)

    def copy_out_of_slot(self, slot: int, host: Sequence[torch.Tensor]) -> None:
        """Copy staging slot ``slot`` out to one chunk's host tensors, after :meth:`read_chunk`'s gather.

        The inverse of :meth:`copy_into_slot`, overridden with it: an override must order
        the copy after the gather and the slot's next use after the copy.
        """
        for og, out in enumerate(host):
            out.copy_(self._object_group_view(slot, og), non_blocking=True)

    def _object_group_view(self, slot: int, og: int) -> torch.Tensor:
        assert self._staging is not None  # callers check the context is open
        return self._staging_layout.object_group_view(self._staging, slot, og)

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
            event = self._events.get(handle, cls, self._device)
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
                self._events.close()
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
            close_all(self.kv_caches)

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

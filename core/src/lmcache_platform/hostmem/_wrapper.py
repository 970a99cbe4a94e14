"""``HostMemoryIPCWrapper``: the descriptor of a CPU tensor in a store's memory, both halves.

The producer side puts a tensor's storage in the store's memory once (born there,
shared in place, or migrated by copy) and describes it; the consumer side validates a
descriptor, maps the memory through the store's checks and replays the layout.
The bookkeeping of what lives where is the store's :class:`~._tracker.Tracker`.
"""

from __future__ import annotations

import mmap
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .._errors import DescriptorError
from .._ipc_wrapper import BASE_FIELDS, MAX_EXTENT, DeviceIPCWrapper, Primitive, WireField, dtype_name
from . import _remap
from ._store import EMPTY, STORE_MEMBERS, Handle, HostMemoryStore, empty_handle, partial_protocols
from ._tracker import TRACKERS, Region, Segment, SharedMapping, Tracker, storage_over

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

#: ``device_uuid`` of every host-memory descriptor: there is one host.
HOST_UUID = "cpu"
#: Handles found valid: (class, (type, value) per wire field) -> what _checked_handle returns.
_CHECKED: dict[tuple[Any, ...], tuple[tuple[tuple[str, Any], ...], int]] = {}
_MAX_CHECKED = 4096


def check_store(cls: type, store: object) -> dict[str, WireField]:
    """The wire fields a store's handle schema gives ``cls``; ``TypeError`` saying what is wrong."""
    where = f"{cls.__name__}.store ({type(store).__name__})"
    missing = [m for m in STORE_MEMBERS if not hasattr(store, m)]
    if missing:
        raise TypeError(f"{where} is not a HostMemoryStore: it lacks {', '.join(missing)}")
    partial = partial_protocols(store)
    if partial:  # a store with half an optional ability would silently never use it
        raise TypeError(f"{where} implements part of an optional store protocol: {'; '.join(partial)}")
    schema = store.handle_fields  # type: ignore[attr-defined]
    if (
        not isinstance(schema, Mapping)
        or not schema
        or not all(isinstance(k, str) and isinstance(v, WireField) for k, v in schema.items())
    ):
        raise TypeError(f"{where}.handle_fields must map field names to WireField declarations")
    nbytes_field = cls.nbytes_field  # type: ignore[attr-defined]
    clash = sorted(set(schema) & {*BASE_FIELDS, nbytes_field})
    if clash:
        raise TypeError(
            f"{where}.handle_fields reuses {clash}: the base fields and nbytes_field "
            f"{nbytes_field!r} are the wrapper's; rename the handle's fields"
        )
    shadowed = sorted(n for n in (*schema, nbytes_field) if hasattr(HostMemoryIPCWrapper, n))
    if shadowed:  # each field becomes an attribute of the wrapper
        raise TypeError(
            f"{cls.__name__}: the wire field(s) {shadowed} would hide the wrapper's own "
            "attribute of that name; rename them in handle_fields or nbytes_field"
        )
    for name, spec in schema.items():
        empty = EMPTY.get(spec.kind)
        try:
            if empty is None:
                raise DescriptorError(f"kind {spec.kind.__name__} is not a wire-field kind")
            spec.check(cls.__name__, name, empty)
        except DescriptorError as exc:
            raise TypeError(
                f"{where}.handle_fields[{name!r}] must admit the empty value {empty!r} "
                f"(an empty tensor's handle): {exc}"
            ) from None
    return {**schema, nbytes_field: WireField(int, lo=0, hi=MAX_EXTENT)}


class HostMemoryIPCWrapper(DeviceIPCWrapper):
    """Descriptor of a CPU tensor living in a store's memory.

    A backend subclass sets ``wire_tag`` and ``store``, and may rename
    ``nbytes_field`` (default ``"mem_nbytes"``: the memory's exact size, checked
    against the real memory before mapping). Its wire fields are derived, never
    declared: the store's ``handle_fields`` followed by ``nbytes_field``; declaring
    other ``wire_fields`` is refused when the class is created. Everything else is
    inherited::

        class CpuFileIPCWrapper(HostMemoryIPCWrapper):
            wire_tag = "cpu.file/1"
            store = FileStore()            # handle_fields = {"file_name": WireField(str, ...)}
            nbytes_field = "file_nbytes"

    Each handle field is an attribute of the wrapper; :attr:`handle` gathers them.
    """

    device_type: ClassVar[str] = "cpu"
    #: The store holding this class's memory (set on the subclass, which gets its tracker).
    store: ClassVar[HostMemoryStore]
    nbytes_field: ClassVar[str] = "mem_nbytes"
    _tracker: ClassVar[Tracker | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        store = getattr(cls, "store", None)
        if store is None:
            return  # an intermediate base without a store yet
        declared = cls.__dict__.get("wire_fields")
        cls.wire_fields = check_store(cls, store)
        if declared is not None and dict(declared) != cls.wire_fields:
            raise TypeError(
                f"{cls.__name__} declares wire_fields, but a HostMemoryIPCWrapper derives them from its "
                f"store's handle_fields and its nbytes_field ({', '.join(cls.wire_fields)}): remove the "
                "declaration and put the fields the handle needs in the store's handle_fields"
            )
        if "store" in cls.__dict__:  # subclasses of this class share its tracker
            cls._tracker = Tracker(store)
            TRACKERS.append(cls._tracker)

    @classmethod
    def _memory(cls) -> Tracker:
        if cls._tracker is None:
            raise TypeError(f"{cls.__name__} has no store: subclass HostMemoryIPCWrapper and set `store`")
        return cls._tracker

    def __init__(self, *, device_uuid: str, **fields: Any) -> None:
        """The base fields, as :class:`DeviceIPCWrapper` takes them, then the handle's fields."""
        base = {name: value for name, value in fields.items() if name in BASE_FIELDS}
        handle = {name: value for name, value in fields.items() if name not in BASE_FIELDS}
        super().__init__(device_uuid=device_uuid, **base)
        cls = type(self)
        if device_uuid != HOST_UUID:
            raise DescriptorError(f"{cls.__name__}: device_uuid must be {HOST_UUID!r}, got {device_uuid!r}")
        checked, nbytes = cls._checked_handle(handle)
        if self.nbytes > nbytes:
            raise DescriptorError(
                f"{cls.__name__}: the view spans {self.nbytes} bytes but the memory holds only {nbytes}"
            )
        for name, value in checked:
            setattr(self, name, value)
        self._export: Segment | None = None  # set on wrappers exporting memory made here
        self._mm: mmap.mmap | None = None  # this wrapper's mapping, once opened
        self._shared: SharedMapping | None = None  # the mapping of wrappers decoded together
        self._region: Region | None = None  # where to_tensors mapped this memory, if it did

    @classmethod
    def from_views(cls, export: Mapping[str, Any], views: Sequence[Mapping[str, Any]]) -> list[Self]:
        """Validate as the base does; the wrappers then map their memory once, together."""
        wrappers = super().from_views(export, views)
        if len(wrappers) > 1:
            shared = SharedMapping()
            for wrapper in wrappers:
                wrapper._shared = shared
        return wrappers

    @classmethod
    def to_tensors(cls, wrappers: Sequence[DeviceIPCWrapper]) -> list[torch.Tensor]:
        """Reopen ``wrappers``, mapping their separate exports side by side in one range.

        Older engines allocate each layer's KV cache apart, so each layer is an export
        of its own. Mapped at equal steps in one address range they form one storage,
        where the cache context stacks them and moves every layer of a group with one
        op, as it does for current vLLM's views of one allocation. Each tensor aliases
        the same memory ``to_tensor()`` would, and the wrappers of one wire record
        still share their export's place; each export starts on a boundary of its own
        pages (huge pages included). Falls back to :meth:`to_tensor` per wrapper for
        fewer than two exports, for wrappers already opened, and for a store that is
        not a :class:`~lmcache_platform.hostmem.SideBySideStore`. Wrapping a tensor
        opened here again names its export, as for ``to_tensor()``.
        """
        closed = [w for w in wrappers if w.closed]
        if closed:
            raise DescriptorError(f"{closed[0]!r} is closed")
        tracker = cls._memory()
        exports: dict[tuple[Any, ...], list[HostMemoryIPCWrapper]] = {}
        for w in wrappers:  # by export: the wrappers of one memory share its place
            if isinstance(w, HostMemoryIPCWrapper) and w.memory_nbytes and not w._opened():
                exports.setdefault(w._export_key(), []).append(w)
        store = tracker.side_by_side
        if store is None or len(exports) < 2 or not sys.platform.startswith("linux"):
            return super().to_tensors(wrappers)
        groups = list(exports.values())
        regions = tracker.open_side_by_side(store, [(g[0].handle, g[0].memory_nbytes) for g in groups])
        for group, region in zip(groups, regions, strict=True):
            for w in group:
                w._region = region
        return [w.to_tensor() for w in wrappers]

    def _opened(self) -> bool:
        shared = self._shared
        mapped_together = shared is not None and shared.mm is not None
        return self._mm is not None or self._region is not None or mapped_together

    @classmethod
    def _checked_handle(cls, handle: Mapping[str, Any]) -> tuple[tuple[tuple[str, Any], ...], int]:
        """The handle's fields (``nbytes_field`` included) once valid, and the memory's size.

        Validation is a pure function of the values, so its result is remembered: the
        per-layer views of one export, and every re-wrap of an exported tensor, pay
        for it once.
        """
        names = cls.wire_fields
        raw = tuple(map(handle.get, names))
        try:  # the types are part of the key: True == 1, but a bool is no valid int field
            key: tuple[Any, ...] | None = (cls, raw, tuple(map(type, raw)))
            known = _CHECKED.get(key)  # type: ignore[arg-type]
        except TypeError:  # a list value: not hashable, checked every time
            key, known = None, None
        if known is not None and len(handle) == len(names):
            return known
        where, nbytes_field, store = cls.__name__, cls.nbytes_field, cls._memory().store
        if set(handle) != set(names):
            raise TypeError(
                f"{where} takes {', '.join(names)} besides the base fields; "
                f"missing {sorted(set(names) - set(handle))}, "
                f"unknown {sorted(set(handle) - set(names))}"
            )
        values = {name: spec.check(where, name, handle[name]) for name, spec in names.items()}
        nbytes = values[nbytes_field]
        assert isinstance(nbytes, int)  # an int field, checked above
        named = {k: v for k, v in values.items() if k != nbytes_field}
        empty = empty_handle(store)
        if nbytes:
            if named == empty:
                raise DescriptorError(f"{where}: {nbytes_field} is {nbytes} but no memory is named")
            store.check_handle(named)
        elif named != empty:
            raise DescriptorError(f"{where}: memory is named but {nbytes_field} is 0")
        result = (tuple(values.items()), nbytes)
        if key is not None:
            if len(_CHECKED) >= _MAX_CHECKED:
                _CHECKED.clear()
            _CHECKED[key] = result
        return result

    @property
    def handle(self) -> dict[str, Primitive]:
        """The memory's handle, the store's handle fields (their empty values for an empty tensor)."""
        return {name: getattr(self, name) for name in type(self)._memory().store.handle_fields}

    @property
    def memory_nbytes(self) -> int:
        """Size of the memory the view lives in (``nbytes_field``); 0 for an empty tensor."""
        nbytes: int = getattr(self, type(self).nbytes_field)
        return nbytes

    # -- producer ----------------------------------------------------------------------

    @classmethod
    def empty(cls, *size: int, dtype: torch.dtype) -> torch.Tensor:
        """A new contiguous CPU tensor born in the store's memory, for an engine's KV cache.

        Wrapping it, or any view of it (the per-layer views an engine cuts out of one
        buffer), copies nothing: peak memory stays that of the cache, where wrapping a
        tensor made elsewhere costs one pass over it (one slice of extra memory when
        shared in place, a second copy when migrated). Every view of it, wrapped or not,
        aliases the exported memory. The contents start as
        the store makes them (zeros for memfds, segments and files). Raises the store's
        capacity error when it is too small.
        """
        import torch

        shape, itemsize = tuple(size), dtype.itemsize
        dtype_name(dtype)
        nbytes = torch.Size(shape).numel() * itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        tracker = cls._memory()
        with tracker.lock:
            handle, mm = tracker.store.create(nbytes)
            storage = storage_over(mm, nbytes)
            tracker.track(mm, storage.data_ptr(), Segment(dict(handle), nbytes, weakref.ref(mm), owned=True))
        stride = torch.empty(shape, dtype=dtype, device="meta").stride()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        """Put ``tensor``'s storage in the store's memory (once per storage) and describe it.

        A large allocation of torch's, whose pages hold nothing else (glibc serves it
        with a mapping of its own: a KV cache), is shared in place when the store is
        an :class:`~lmcache_platform.hostmem.InPlaceStore` and the allocation's bounds
        are whole pages of the export's (always, unless its pages are huge pages):
        the memory is mapped over the allocation's pages a slice at a time, so nothing
        moves and every tensor and view of it, wrapped or not, sees the shared bytes.
        Peak memory grows by one slice. Do it before the engine runs: writes from
        another thread during the remap would be lost.

        Otherwise the storage is copied into fresh memory and ``tensor`` itself, and
        only it, is re-pointed there: another tensor object viewing the same old
        storage (a view the engine derived, the flat buffer its layers were cut from)
        keeps pointing at the old memory until it is wrapped too, which then copies
        nothing and shares the first one's handle. :meth:`empty` needs neither.

        Idempotent: a tensor already in the store's memory (made here, or reopened
        here with :meth:`to_tensor`), or a view of it, is described without copying.
        Raises ``DescriptorError`` for a tensor that is not a strided CPU tensor of an
        allowed dtype, and the store's capacity error when it is too small (nothing is
        exported then; pages already shared in place keep the tensor's bytes).
        """
        cls._check_exportable(tensor)
        if tensor.numel() == 0:
            return cls._describe(tensor, empty_handle(cls._memory().store), 0)
        tracker = cls._memory()
        with tracker.lock:
            segment = tracker.into_segment(tensor)
            wrapper = cls._describe(tensor, segment.handle, segment.nbytes, segment.offset)
            if segment.owned:
                segment.wrappers += 1
                wrapper._export = segment
        return wrapper

    @classmethod
    def _describe(cls, tensor: torch.Tensor, handle: Handle, nbytes: int, offset: int = 0) -> Self:
        """The descriptor of ``tensor`` in memory that starts ``offset`` bytes before its storage."""
        if offset % tensor.element_size():
            raise DescriptorError(
                f"{cls.__name__}.wrap: the storage starts {offset} bytes into its memory, "
                f"not a multiple of {tensor.dtype}'s {tensor.element_size()} bytes"
            )
        return cls(
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=int(tensor.storage_offset()) + offset // tensor.element_size(),
            device_uuid=HOST_UUID,
            **handle,
            **{cls.nbytes_field: nbytes},
        )

    @classmethod
    def preflight(cls, tensors: Sequence[torch.Tensor]) -> None:
        """Check up front that the store can hold every storage ``tensors`` would migrate.

        Raises the store's capacity error for the whole batch before anything is
        created. Storages shared by several tensors count once; storages already in
        the store count not at all; storages shared in place count one slice (each
        slice's private pages are freed as its shared ones come; where the export's
        huge pages make ``wrap`` copy instead, that copy's own check raises). Tensors
        :meth:`wrap` would refuse count nothing here: ``wrap`` refuses them, and
        ``wrap_kv_caches`` names their layer.
        """
        needed: dict[int, int] = {}
        tracker = cls._memory()
        in_place = tracker.in_place is not None
        with tracker.lock:
            for tensor in tensors:
                try:
                    cls._check_exportable(tensor)
                except DescriptorError:
                    continue  # left to wrap(), whose error names the layer
                if tensor.numel() == 0:
                    continue
                storage = tensor.untyped_storage()
                if storage.data_ptr() in needed:
                    continue
                if tracker.segment_at(storage) is None and tracker.moved_target(storage) is None:
                    pages = _remap.exclusive_pages(storage) if in_place else None
                    # in place: negative, one slice (slices of all storages come one at a time)
                    needed[storage.data_ptr()] = -min(pages[1], _remap.SLICE) if pages else storage.nbytes()
        if needed:  # every storage already exported (a re-registration): nothing to check
            copies = sum(n for n in needed.values() if n > 0)
            tracker.store.check_capacity(copies + max((-n for n in needed.values() if n < 0), default=0))

    @classmethod
    def _check_exportable(cls, tensor: torch.Tensor) -> None:
        import torch

        where = f"{cls.__name__}.wrap"
        if not isinstance(tensor, torch.Tensor):
            raise DescriptorError(f"{where} expects a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise DescriptorError(
                f"{where} needs a CPU tensor, got one on {tensor.device}; "
                "use the backend for that device type"
            )
        if tensor.layout != torch.strided:
            raise DescriptorError(f"{where} needs a strided tensor, got {tensor.layout}")
        dtype_name(tensor.dtype)

    # -- consumer ----------------------------------------------------------------------

    def to_tensor(self) -> torch.Tensor:
        """Map the memory (once per wrapper) and return a view replaying the layout.

        Wrappers decoded from one wire record (:meth:`from_views`: the per-layer views
        of one allocation) map it once between them, so their views stay views of one
        storage here too, and the cache context moves all layers of a group in one op.
        The mapping stays until the last view of it dies, even after
        :meth:`~lmcache_platform.DeviceIPCWrapper.close`.
        """
        import torch

        if self.closed:
            raise DescriptorError(f"{self!r} is closed")
        nbytes = self.memory_nbytes
        if not nbytes:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        region = self._region
        if region is not None:
            start = region.offset // self.dtype.itemsize + self.storage_offset  # offset: whole pages
            return torch.empty(0, dtype=self.dtype).set_(region.storage, start, self.shape, self.stride)
        shared = self._shared
        if shared is not None and shared.mm is not None and shared.storage is not None:
            mm, storage = shared.mm, shared.storage
        else:
            if self._mm is not None:
                mm, storage = self._mm, storage_over(self._mm, nbytes)
            else:
                mm, storage = self._open(nbytes)
            if shared is not None:
                shared.mm, shared.storage = mm, storage
        self._mm = mm
        view = torch.empty(0, dtype=self.dtype)
        return view.set_(storage, self.storage_offset, self.shape, self.stride)

    def _open(self, nbytes: int) -> tuple[mmap.mmap, torch.UntypedStorage]:
        """Map the memory through the store's checks, remember the mapping, return it and a storage."""
        tracker, handle = type(self)._memory(), self.handle
        mm = tracker.store.open_existing(handle, nbytes)
        storage = storage_over(mm, nbytes)
        with tracker.lock:  # so that wrapping a view of it names this memory instead of copying
            tracker.track(mm, storage.data_ptr(), Segment(handle, nbytes, weakref.ref(mm), owned=False))
        return mm, storage

    def verify(self) -> None:
        """Check that the memory this wrapper mapped has not shrunk; call it before each transfer.

        A same-user process can truncate memory that is not sealed (a named segment, a
        file), and touching a page past the new end kills this process with SIGBUS.
        This check (one ``fstat``) refuses with ``DescriptorError`` instead. It narrows
        the window to the time between the check and the access; it cannot close it.
        A no-op before :meth:`to_tensor` and after :meth:`~lmcache_platform.DeviceIPCWrapper.close`.
        """
        opened: mmap.mmap | Region | None = self._mm if self._mm is not None else self._region
        if opened is None:
            return
        try:
            size = opened.size()
        except (OSError, ValueError):  # closed meanwhile, or memory without a file
            return
        if size < self.memory_nbytes:
            raise DescriptorError(
                f"{type(self).__name__}: the memory {self.handle} shrank to {size} of its "
                f"{self.memory_nbytes} bytes after it was mapped (another process of this user "
                "truncated it); refusing to touch it, which would crash this process with SIGBUS"
            )

    def release(self) -> None:
        """Drop this wrapper's mapping; a producer's last wrapper also releases the handle."""
        self._mm = self._shared = self._region = None
        export, self._export = self._export, None
        if export is not None:
            type(self)._memory().release_export(export)

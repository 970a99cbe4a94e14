"""Named, file-backed host memory shared between processes: the kit behind host-memory backends.

A *store* names, creates and opens memory that can be mapped: POSIX shared memory
for the ``cpu`` backend, files in an operator's directory for ``cpu.file``, anything
a vendor can ``mmap``. The store is the only thing a host-memory backend writes
(:class:`HostMemoryStore`). This module does the rest, which every such backend
needs and which is easy to get subtly wrong:

* **Migration.** :meth:`HostMemoryIPCWrapper.wrap` copies a tensor's *whole storage*
  into a fresh mapping and re-points the *same* tensor object at it, so the engine
  keeps its tensor and its contents; stride and offset stay valid because the
  mapping mirrors the storage byte for byte.
* **Zero-copy reopening.** :meth:`HostMemoryIPCWrapper.to_tensor` maps the memory
  and replays dtype, shape, stride and storage offset exactly.
* **Lifetimes follow torch's reference counting.** A mapping is owned by the torch
  storage built over it, so it lives exactly as long as some tensor uses it. When
  the last one dies, a finalizer forgets the mapping and, in the process that made
  the memory, unlinks its name. Wrappers hold names, never memory.
* **Idempotence per storage.** Views of one allocation (vLLM's hybrid-model KV
  tensors) migrate once and keep aliasing; wrapping a tensor that already lives in
  a mapping of the store (made here, or reopened here) names it instead of copying.
* **Names** (:class:`SegmentNames`) that are unguessable yet tell a garbage collector
  which process made them, and the liveness test for that collector
  (:func:`find_stale`).

torch is imported only when memory is wrapped or reopened, so a backend's probe and
gc hooks may use this module without loading torch.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ._errors import DescriptorError
from ._ipc_wrapper import MAX_EXTENT, DeviceIPCWrapper, WireField, dtype_name

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

__all__ = [
    "HostMemoryIPCWrapper",
    "HostMemoryStore",
    "SegmentNames",
    "find_stale",
    "pid_namespace",
    "producer_alive",
]

#: ``device_uuid`` of every host-memory descriptor: there is one host.
HOST_UUID = "cpu"


class HostMemoryStore(Protocol):
    """Where a host-memory backend keeps shared memory. Security is the store's job.

    Names are unguessable and are names, never paths; memory is created exclusively
    and readable by its user only (mode 0600); nothing is mapped before it is checked.
    Every method raises :class:`~lmcache_platform.DescriptorError` for a name that is
    not well formed, before touching anything.
    """

    @property
    def max_name_len(self) -> int:
        """Longest well-formed name; bounds the descriptor's name field on the wire."""
        ...

    def check_name(self, name: str) -> None:
        """Raise ``DescriptorError`` unless ``name`` is a well-formed name of this store."""
        ...

    def check_capacity(self, nbytes: int) -> None:
        """Raise an ``OSError`` (``ENOSPC``) naming the shortfall if ``nbytes`` cannot fit."""
        ...

    def create(self, nbytes: int) -> tuple[str, mmap.mmap]:
        """Create memory of ``nbytes`` (or more) under a fresh name; map it read-write.

        Exclusive creation, mode 0600, space reserved up front (a full store raises
        here, not as a SIGBUS later). This process owns the name until
        :meth:`unlink`. On failure nothing is left behind.
        """
        ...

    def open_existing(self, name: str, nbytes: int) -> mmap.mmap:
        """Map memory made by another process after checking what it really is.

        ``DescriptorError`` (and nothing mapped) for a missing name, a symlink, a
        non-regular file, another user's or a group/other-accessible file, and a
        size that does not match ``nbytes`` as this store sizes it.
        """
        ...

    def unlink(self, name: str) -> bool:
        """Remove ``name`` if this process created it and return True; else do nothing."""
        ...


# -- names and liveness -------------------------------------------------------------

_pidns: int | None = None


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 where it cannot be read).

    Part of every name, so a collector never judges a pid from another namespace
    (a sidecar container sharing the directory) against its own process table.
    """
    global _pidns
    if _pidns is None:
        try:
            _pidns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            _pidns = 0
    return _pidns


class SegmentNames:
    """Names ``<prefix><pid namespace>_<pid>_<128 random bits in hex>``.

    The random part makes a name unguessable: nobody can pre-create it (to make an
    exclusive create fail) or be pointed at memory it was not given. The pid lets
    :func:`find_stale` tell whether the producer is alive. The pattern admits no
    ``/``, ``..`` or other separator, so a parsed name can never address anything
    outside the store's directory.
    """

    def __init__(self, prefix: str, *, kind: str = "host-memory", noun: str = "segment") -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,47}_", prefix):
            raise ValueError(f"a name prefix is lowercase letters, digits and '_', ending in '_': {prefix!r}")
        self.prefix = prefix
        self.max_len = len(prefix) + 20 + 1 + 10 + 1 + 32
        self._kind, self._noun = kind, noun
        self._re = re.compile(rf"{prefix}([0-9]{{1,20}})_([0-9]{{1,10}})_[0-9a-f]{{32}}")  # ASCII only

    def new(self) -> str:
        """A fresh, unguessable name made by this process."""
        return f"{self.prefix}{pid_namespace()}_{os.getpid()}_{secrets.token_hex(16)}"

    def parse(self, name: str) -> tuple[int, int]:
        """Return ``(pid_namespace, pid)`` of a well-formed name, else raise ``DescriptorError``."""
        match = self._re.fullmatch(name) if len(name) <= self.max_len else None
        if match is None:
            raise DescriptorError(
                f"{self._kind} name {name[: self.max_len]!r} is not a {self._noun} of this project "
                f"(expected {self.prefix}<pidns>_<pid>_<32 hex digits>)"
            )
        return int(match.group(1)), int(match.group(2))


def find_stale(directory: str | int, names: SegmentNames) -> list[str]:
    """Names in ``directory`` (a path or an open directory fd) whose producer is gone.

    Only entries that match ``names``, were made in this pid namespace and are
    regular files of the current user count. Anything uncertain counts as alive: a
    collector may miss stale memory, never delete live memory. Deletes nothing.
    """
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    stale = []
    for name in entries:
        if not name.startswith(names.prefix):
            continue
        try:
            pidns, pid = names.parse(name)
        except DescriptorError:
            continue  # our prefix but not our pattern: not ours to judge
        if pidns != pid_namespace():
            continue
        try:
            if isinstance(directory, int):
                st = os.lstat(name, dir_fd=directory)
            else:
                st = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            continue  # removed meanwhile
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if not producer_alive(pid, segment_ctime=st.st_ctime):
            stale.append(name)
    return stale


def producer_alive(pid: int, segment_ctime: float) -> bool:
    """Whether process ``pid`` may still own memory last changed at ``segment_ctime``.

    False only when the pid is gone, a zombie, or names a process that started after
    the memory was last changed (the pid was reused); True when in doubt.
    """
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else: maybe a reused pid, checked below
    info = _process_state_and_start(pid)
    if info is None:
        return True
    state, started = info
    if state in ("Z", "X"):  # zombie or dead: its cleanup will never run
        return False
    return started is None or started <= segment_ctime


def _process_state_and_start(pid: int) -> tuple[str, float | None] | None:
    """``(state letter, start time in epoch seconds)`` from /proc, or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return ("X", None)  # exited between kill() and here
    except OSError:
        return None
    state = fields[0] if fields else "?"
    boot = _boot_time()
    if boot is None or len(fields) < 20:
        return state, None
    # Field 22 (starttime, clock ticks after boot); fields[0] is field 3. The boot time
    # is truncated to whole seconds, which can only make a process look older: safe.
    return state, boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        return None  # no /proc: the caller falls back to "alive"
    return None


# -- the mappings of one store in this process --------------------------------------


@dataclass(eq=False)
class _Segment:
    """A mapping in this process: of memory made here (``owned``) or reopened.

    For owned memory, ``wrappers`` counts the open wrappers exporting its name; the
    last one to close unlinks it.
    """

    name: str
    nbytes: int
    mm: weakref.ref[mmap.mmap]
    owned: bool
    wrappers: int = 0
    linked: bool = True  # False once we unlinked the name; the memory may live on


class _Tracker:
    """Which storages of this process live in (or were moved into) one store's mappings.

    Keyed by address and checked against the live mapping, so a new storage that
    reuses a dead one's address is never mistaken for it. The lock is reentrant:
    dropping a storage inside a locked section can run a mapping's finalizer on
    this very thread.
    """

    def __init__(self, store: HostMemoryStore) -> None:
        self.store = store
        self.reset()

    def reset(self) -> None:
        self.lock = threading.RLock()
        #: mapping address -> the segment mapped there, while the mapping lives
        self.segments: dict[int, _Segment] = {}
        #: address of a storage whose bytes were moved -> (weak ref to it, where they went)
        self.moved: dict[int, tuple[Any, _Segment]] = {}

    def segment_at(self, storage: torch.UntypedStorage) -> _Segment | None:
        """The live segment ``storage`` is a mapping of, if any (and still named, if ours)."""
        segment = self.segments.get(storage.data_ptr())
        if segment is None or not segment.linked or segment.nbytes != storage.nbytes():
            return None
        return segment if segment.mm() is not None else None

    def moved_target(self, storage: torch.UntypedStorage) -> tuple[_Segment, mmap.mmap] | None:
        """Where ``storage``'s bytes went if another view of it was wrapped earlier."""
        entry = self.moved.get(storage.data_ptr())
        if entry is None:
            return None
        source, segment = entry
        mm = segment.mm()
        if source.expired() or mm is None or not segment.linked or segment.nbytes != storage.nbytes():
            del self.moved[storage.data_ptr()]  # a dead storage whose address was reused, or a gone segment
            return None
        return segment, mm

    def into_segment(self, tensor: torch.Tensor) -> _Segment:
        """The segment ``tensor`` lives in, after moving its storage there if needed."""
        storage = tensor.untyped_storage()
        segment = self.segment_at(storage)
        if segment is not None:
            return segment
        target = self.moved_target(storage)
        if target is not None:
            segment, mm = target
            _repoint(tensor, _storage_over(mm, segment.nbytes))
            return segment
        return self._migrate(tensor, storage)

    def _migrate(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> _Segment:
        """Copy ``storage`` into new memory and re-point ``tensor`` at it."""
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef

        nbytes = storage.nbytes()
        name, mm = self.store.create(nbytes)
        try:
            shared = _storage_over(mm, nbytes)
            source = torch.empty(0, dtype=torch.uint8).set_(storage)
            torch.empty(0, dtype=torch.uint8).set_(shared).copy_(source)
            _repoint(tensor, shared)
        except BaseException:
            self.store.unlink(name)
            raise
        segment = _Segment(name, nbytes, weakref.ref(mm), owned=True)
        self.track(mm, shared.data_ptr(), segment)
        self.moved[storage.data_ptr()] = (StorageWeakRef(storage), segment)  # type: ignore[no-untyped-call]
        return segment

    def track(self, mm: mmap.mmap, address: int, segment: _Segment) -> None:
        """Record a new mapping until it dies (its last storage, hence its last tensor)."""
        self.segments[address] = segment
        finalizer = weakref.finalize(mm, self._mapping_died, segment, address, os.getpid())
        finalizer.atexit = False  # at exit, the store unlinks every name it owns

    def _mapping_died(self, segment: _Segment, address: int, pid: int) -> None:
        """The last storage over a mapping is gone: forget it; unlink the name if ours."""
        if os.getpid() != pid:
            return  # a forked child's copy of the parent's mapping
        with self.lock:
            if self.segments.get(address) is segment:
                del self.segments[address]
            for key in [k for k, (_, s) in self.moved.items() if s is segment]:
                del self.moved[key]
        if segment.owned:
            segment.linked = False
            self.store.unlink(segment.name)

    def release_export(self, segment: _Segment) -> None:
        """One exporting wrapper closed; the last one unlinks the name (memory lives on)."""
        with self.lock:
            segment.wrappers -= 1
            last = segment.wrappers == 0 and segment.linked
            if last:
                segment.linked = False
        if last:
            self.store.unlink(segment.name)  # a no-op in a forked child: the name is the parent's


def _storage_over(mm: mmap.mmap, nbytes: int) -> torch.UntypedStorage:
    """A storage of exactly ``nbytes`` over ``mm`` that keeps ``mm`` alive."""
    import torch

    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).untyped_storage()


def _repoint(tensor: torch.Tensor, storage: torch.UntypedStorage) -> None:
    import torch

    # no_grad: KV caches are leaves; inference tensors may only change in inference mode.
    with torch.inference_mode(tensor.is_inference()), torch.no_grad():
        tensor.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


_TRACKERS: list[_Tracker] = []


def _after_fork_in_child() -> None:
    global _pidns
    _pidns = None
    for tracker in _TRACKERS:
        tracker.reset()  # the child wraps into memory of its own


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the wrapper ----------------------------------------------------------------------


class HostMemoryIPCWrapper(DeviceIPCWrapper):
    """Descriptor of a CPU tensor living in a store's named memory.

    A backend subclass sets ``wire_tag``, ``store`` and the names of its two wire
    fields (``name_field``: the memory's name, empty for an empty tensor, which needs
    none; ``nbytes_field``: its exact size, checked against the real memory before
    mapping). Everything else is inherited::

        class CpuFileIPCWrapper(HostMemoryIPCWrapper):
            wire_tag = "cpu.file/1"
            store = FileStore()
            name_field, nbytes_field = "file_name", "file_nbytes"
    """

    device_type: ClassVar[str] = "cpu"
    #: The store holding this class's memory (set on the subclass, which gets its tracker).
    store: ClassVar[HostMemoryStore]
    name_field: ClassVar[str] = "mem_name"
    nbytes_field: ClassVar[str] = "mem_nbytes"
    _tracker: ClassVar[_Tracker | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        store = cls.__dict__.get("store")
        if store is not None:
            cls._tracker = _Tracker(store)
            _TRACKERS.append(cls._tracker)
        if getattr(cls, "store", None) is not None and "wire_fields" not in cls.__dict__:
            cls.wire_fields = {
                cls.name_field: WireField(str, max_len=cls.store.max_name_len),
                cls.nbytes_field: WireField(int, lo=0, hi=MAX_EXTENT),
            }

    @classmethod
    def _memory(cls) -> _Tracker:
        if cls._tracker is None:
            raise TypeError(f"{cls.__name__} has no store: subclass HostMemoryIPCWrapper and set `store`")
        return cls._tracker

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...] | list[int],
        stride: tuple[int, ...] | list[int],
        storage_offset: int,
        device_uuid: str,
        **segment: Any,
    ) -> None:
        super().__init__(
            dtype=dtype, shape=shape, stride=stride, storage_offset=storage_offset, device_uuid=device_uuid
        )
        cls = type(self)
        where, name_field, nbytes_field = cls.__name__, cls.name_field, cls.nbytes_field
        name, nbytes = segment.pop(name_field, None), segment.pop(nbytes_field, None)
        if segment or not isinstance(name, str) or type(nbytes) is not int:
            raise TypeError(
                f"{where} takes {name_field} (str) and {nbytes_field} (int) besides the base "
                f"fields; unknown arguments: {sorted(segment)}"
            )
        if device_uuid != HOST_UUID:
            raise DescriptorError(f"{where}: device_uuid must be {HOST_UUID!r}, got {device_uuid!r}")
        if name:
            cls._memory().store.check_name(name)
            if nbytes <= 0:
                raise DescriptorError(f"{where}: segment {name!r} cannot hold {nbytes} bytes")
        elif nbytes:
            raise DescriptorError(f"{where}: {nbytes_field} is {nbytes} but no segment is named")
        if self.nbytes > nbytes:
            raise DescriptorError(
                f"{where}: the view spans {self.nbytes} bytes but segment {name!r} holds only {nbytes}"
            )
        setattr(self, name_field, name)
        setattr(self, nbytes_field, nbytes)
        self._export: _Segment | None = None  # set on wrappers exporting memory made here
        self._mm: mmap.mmap | None = None  # this wrapper's mapping, once opened

    @property
    def segment_name(self) -> str:
        """The memory's name in the store (``""`` for an empty tensor)."""
        name: str = getattr(self, type(self).name_field)
        return name

    @property
    def segment_nbytes(self) -> int:
        nbytes: int = getattr(self, type(self).nbytes_field)
        return nbytes

    # -- producer ----------------------------------------------------------------------

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        """Move ``tensor`` into the store (once) and describe it.

        Idempotent: a tensor already in the store's memory (made here, or reopened
        here with :meth:`to_tensor`), or a view of it, is described without copying.
        Raises ``DescriptorError`` for a tensor that is not a strided CPU tensor of an
        allowed dtype, and the store's capacity error when it is too small (nothing is
        created then).
        """
        cls._check_exportable(tensor)
        if tensor.numel() == 0:
            return cls._describe(tensor, "", 0)
        tracker = cls._memory()
        with tracker.lock:
            segment = tracker.into_segment(tensor)
            wrapper = cls._describe(tensor, segment.name, segment.nbytes)
            if segment.owned:
                segment.wrappers += 1
                wrapper._export = segment
        return wrapper

    @classmethod
    def _describe(cls, tensor: torch.Tensor, name: str, nbytes: int) -> Self:
        return cls.describe(tensor, device_uuid=HOST_UUID, **{cls.name_field: name, cls.nbytes_field: nbytes})

    @classmethod
    def preflight(cls, tensors: Sequence[torch.Tensor]) -> None:
        """Check up front that the store can hold every storage ``tensors`` would migrate.

        Raises the store's capacity error for the whole batch before anything is
        created. Storages shared by several tensors count once; storages already in
        the store count not at all. Tensors :meth:`wrap` would refuse count nothing
        here: ``wrap`` refuses them, and ``wrap_kv_caches`` names their layer.
        """
        needed: dict[int, int] = {}
        tracker = cls._memory()
        with tracker.lock:
            for tensor in tensors:
                try:
                    cls._check_exportable(tensor)
                except DescriptorError:
                    continue  # left to wrap(), whose error names the layer
                if tensor.numel() == 0:
                    continue
                storage = tensor.untyped_storage()
                if tracker.segment_at(storage) is None and tracker.moved_target(storage) is None:
                    needed[storage.data_ptr()] = storage.nbytes()
        tracker.store.check_capacity(sum(needed.values()))

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

        The mapping stays until the last view of it dies, even after :meth:`close`.
        """
        import torch

        if self.closed:
            raise DescriptorError(f"{self!r} is closed")
        name, nbytes = self.segment_name, self.segment_nbytes
        if not name:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        tracker = type(self)._memory()
        mm, fresh = self._mm, self._mm is None
        if mm is None:
            mm = self._mm = tracker.store.open_existing(name, nbytes)
        storage = _storage_over(mm, nbytes)
        if fresh:  # so that wrapping a view of it names this memory instead of copying
            with tracker.lock:
                tracker.track(mm, storage.data_ptr(), _Segment(name, nbytes, weakref.ref(mm), owned=False))
        view = torch.empty(0, dtype=self.dtype)
        return view.set_(storage, self.storage_offset, self.shape, self.stride)

    def release(self) -> None:
        """Drop this wrapper's mapping; a producer's last wrapper also unlinks the name."""
        self._mm = None
        export, self._export = self._export, None
        if export is not None:
            type(self)._memory().release_export(export)

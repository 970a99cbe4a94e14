"""Host memory shared between processes through file descriptors: the kit behind host-memory backends.

A *store* creates, opens and releases memory that can be mapped: sealed memfds and
POSIX shared memory for the ``cpu`` backend, files in an operator's directory for
``cpu.file``, anything a vendor can ``mmap``. The store is the only thing a
host-memory backend writes (:class:`HostMemoryStore`). It declares the *handle* a
consumer needs to find the memory as named, bounded wire fields
(``handle_fields``); this module turns that schema into the wrapper's wire fields
and validates it on the receiving side, so a store never parses anything. The rest,
which every such backend needs and which is easy to get subtly wrong, is here:

* **Sharing in place.** :meth:`HostMemoryIPCWrapper.wrap` of a large allocation of
  torch's (a KV cache) maps fresh shared memory over the allocation's own pages, a
  slice at a time: nothing moves, peak memory grows by one slice (32 MiB), and every
  tensor and view the engine holds keeps its address and sees the shared bytes. This
  needs the store's two optional members ``create_in_place`` and ``reserve``.
* **Migration** otherwise (a small allocation, whose pages hold other data too;
  memory torch did not allocate; a store without those members): ``wrap`` copies the
  tensor's *whole storage* into fresh memory and re-points the *same* tensor object
  at it; only tensor objects passed to ``wrap`` are re-pointed (see its docstring).
* **Zero-copy reopening.** :meth:`HostMemoryIPCWrapper.to_tensor` maps the memory
  and replays dtype, shape, stride and storage offset exactly.
  :meth:`HostMemoryIPCWrapper.to_tensors`, which a cache context calls, maps
  separate exports (older engines' one allocation per layer) side by side in one
  address range, so their layers stack in one storage; this needs the store's
  optional ``open_fd``.
* **Lifetimes follow torch's reference counting.** A mapping is owned by the torch
  storage built over it, so it lives exactly as long as some tensor uses it. When
  the last one dies, a finalizer forgets the mapping and, in the process that made
  the memory, releases its handle. Wrappers hold handles, never memory.
* **One export per storage.** Views of one allocation (vLLM's per-layer views of one
  KV buffer) are shared once, share one handle and keep aliasing, and wrappers decoded
  from one wire record map that memory once between them; wrapping a tensor that
  already lives in a mapping of the store (made here, or reopened here) names it
  instead of copying.
* **Fork safety.** A forked child starts with no memory of its own, so nothing it
  does releases its parent's memory.
* **Names** (:class:`SegmentNames`) that are unguessable yet tell a garbage collector
  which process made them, the liveness test for that collector (:func:`find_stale`),
  and the memory limit that anonymous shared memory counts against
  (:func:`memory_headroom`).

torch is imported only when memory is wrapped or reopened, so a backend's probe and
gc hooks may use this module without loading torch.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from . import _remap
from ._errors import DescriptorError
from ._ipc_wrapper import (
    BASE_FIELDS,
    MAX_EXTENT,
    DeviceIPCWrapper,
    Primitive,
    WireField,
    dtype_name,
    required_elements,
)
from ._kv.context import BaseCacheContext

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

    from ._kv.transfer import ChunkTransfer

__all__ = [
    "Handle",
    "Headroom",
    "HostMemoryCacheContext",
    "HostMemoryIPCWrapper",
    "HostMemoryStore",
    "SegmentNames",
    "find_stale",
    "memory_headroom",
    "pid_namespace",
    "producer_alive",
]

#: ``device_uuid`` of every host-memory descriptor: there is one host.
HOST_UUID = "cpu"

#: A store's handle: one value per field of its ``handle_fields``. Every value a store
#: receives was checked against its declaration first, so an ``int`` field holds an int.
Handle = Mapping[str, Any]


class HostMemoryStore(Protocol):
    """Where a host-memory backend keeps shared memory. Security is the store's job.

    Six members, all required (a wrapper class naming a store that lacks one is
    refused when the class is created, with the list of what is missing):

    * ``handle_fields``: the handle's schema, named :class:`~lmcache_platform.WireField`
      declarations (a name, a pid and an fd number, an inode...). They become the
      wrapper's wire fields, next to its ``nbytes_field``; the receiving side checks
      every value against them before the store sees it. An empty tensor needs no
      memory: its handle holds each field's empty value (``0``, ``""``, ``b""``,
      ``[]``), which the declared bounds must admit;
    * :meth:`check_handle`, :meth:`check_capacity`, :meth:`create`,
      :meth:`open_existing` and :meth:`release`.

    Two optional members let the kit share a large allocation where it lies instead of
    copying it (the memory is mapped over the allocation's pages a slice at a time; see
    the backend-author guide); a store without them migrates by copy:

    * ``create_in_place(nbytes) -> (handle, fd)``: like :meth:`create`, but with no
      pages reserved and no mapping; returns a new file descriptor of the memory,
      which the kit closes;
    * ``reserve(fd, offset, nbytes)``: reserve those pages (``posix_fallocate``),
      raising the capacity error when they do not fit; the kit reserves each slice
      before it copies it.

    One more optional member lets a cache context map several exports side by side
    (:meth:`HostMemoryIPCWrapper.to_tensors`); without it each is mapped on its own:

    * ``open_fd(handle, nbytes) -> fd``: :meth:`open_existing` without the mapping:
      the same checks, then a new file descriptor of the memory, which the kit keeps
      while the memory is mapped and then closes.

    Handles are unguessable or verified (a consumer never maps memory just because a
    descriptor names it); memory is created exclusively and readable by its user only
    (mode 0600); nothing is mapped before it is checked. Besides the methods, a store
    owes three things no signature shows:

    * **fork**: a forked child never releases its parent's memory (forget this
      process's records in an ``os.register_at_fork(after_in_child=...)`` handler);
    * **exit**: memory that outlives its last holder (a named file) is released at
      exit (``atexit``); memory that cannot (a memfd) needs nothing;
    * **file descriptors**: Python's ``mmap`` keeps a duplicate of the descriptor it
      maps, one per mapping, so a process holding many layers holds as many fds;
      close your own descriptor once mapped, and mind ``RLIMIT_NOFILE``.
    """

    @property
    def handle_fields(self) -> Mapping[str, WireField]:
        """The handle's schema: field name -> bounds (a class attribute in practice)."""
        ...

    def check_handle(self, handle: Handle) -> None:
        """Raise ``DescriptorError`` unless ``handle`` is a well-formed handle of this store.

        Called for every non-empty descriptor, consumer side included, with values that
        already passed ``handle_fields``. Checks form only (a name's pattern, say); no I/O.
        """
        ...

    def check_capacity(self, nbytes: int) -> None:
        """Raise an ``OSError`` naming the limit and the shortfall if ``nbytes`` more cannot fit."""
        ...

    def create(self, nbytes: int) -> tuple[Handle, mmap.mmap]:
        """Create memory of ``nbytes`` (or more); return its handle and a read-write mapping.

        Exclusive creation, mode 0600, space reserved up front (a full store raises
        here, not as a SIGBUS later). This process owns the handle until
        :meth:`release`. On failure nothing is left behind.
        """
        ...

    def open_existing(self, handle: Handle, nbytes: int) -> mmap.mmap:
        """Map memory another process made, after checking that it is what ``handle`` says.

        ``DescriptorError`` (and nothing mapped) for memory that is missing, of
        another kind or user, accessible to group or others, or of a size that does
        not match ``nbytes`` as this store sizes it.
        """
        ...

    def release(self, handle: Handle) -> bool:
        """Give up ``handle`` if this process created it (unlink it, close it); else do nothing.

        Returns whether it did. Existing mappings, here and elsewhere, keep working.
        """
        ...


#: The members a store must have (see :class:`HostMemoryStore`).
STORE_MEMBERS = ("handle_fields", "check_handle", "check_capacity", "create", "open_existing", "release")
_EMPTY: dict[type, Primitive] = {int: 0, str: "", bytes: b"", list: []}


def _empty_handle(store: HostMemoryStore) -> dict[str, Primitive]:
    """The handle of an empty tensor: each field's empty value."""
    return {
        name: [] if spec.kind is list else _EMPTY[spec.kind] for name, spec in store.handle_fields.items()
    }


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


# -- the memory limit ---------------------------------------------------------------

#: Where cgroup file systems are mounted (Linux).
CGROUP_ROOT = "/sys/fs/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 says "no limit" with a huge page-aligned number


@dataclass(frozen=True)
class Headroom:
    """How much more memory this process may take, and which limit says so."""

    #: Bytes that may still be allocated under ``limit``.
    free: int
    #: The binding limit, for an error message: a cgroup file, or the host's memory.
    limit: str


def memory_headroom() -> Headroom | None:
    """The tightest memory limit on this process: its memory cgroups, then the host.

    Anonymous shared memory (a memfd, ``/dev/shm`` pages) counts against the memory
    cgroup of the process that touches it first, not against any file system. For
    each cgroup from this process's up to the root (v2: ``memory.max`` less
    ``memory.current``; v1: ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``),
    reclaimable file cache (``inactive_file``) counting as free, and for the host
    (``MemAvailable`` plus ``SwapFree``), the smallest headroom wins. None where none
    can be read (no /proc).
    """
    found = [h for h in (*_cgroup_headrooms(), _host_headroom()) if h is not None]
    return min(found, key=lambda h: h.free) if found else None


def _cgroup_headrooms() -> list[Headroom]:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out: list[Headroom] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            out += _walk(CGROUP_ROOT, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            out += _walk(
                os.path.join(CGROUP_ROOT, "memory"),
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
    return out


def _walk(root: str, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[Headroom]:
    """Headrooms of the cgroup at ``path`` under ``root`` and of its ancestors below ``root``.

    In a container the hierarchy is often mounted at the container's own cgroup, so a
    ``path`` that does not exist under ``root`` means ``root`` is that cgroup.
    """
    here = os.path.normpath(os.path.join(root, path.lstrip("/")))
    if not os.path.isdir(here):
        here = root
    out = []
    while True:
        limit, usage = _read_int(os.path.join(here, limit_file)), _read_int(os.path.join(here, usage_file))
        if limit is not None and usage is not None and limit < _UNLIMITED:
            usage -= min(usage, _stat_value(os.path.join(here, "memory.stat"), inactive_key))
            what = f"the memory cgroup limit {os.path.join(here, limit_file)}"
            out.append(Headroom(max(0, limit - usage), f"{what} ({_size(limit)}, {_size(usage)} in use)"))
        if here == root or not here.startswith(root + os.sep):
            return out
        here = os.path.dirname(here)


def _host_headroom() -> Headroom | None:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "SwapFree"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in values:
        return None
    free = values["MemAvailable"] + values.get("SwapFree", 0)
    return Headroom(free, "the host's available memory (MemAvailable + SwapFree in /proc/meminfo)")


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        return 0
    return 0


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


# -- the mappings of one store in this process --------------------------------------


@dataclass(eq=False)
class _Segment:
    """Memory in this process: made here (``owned``) or reopened, mapped by us or in place.

    For owned memory, ``wrappers`` counts the open wrappers exporting its handle; the
    last one to close releases it. Memory mapped over an engine's own allocation
    (:mod:`._remap`) has no mapping object of ours (``mm`` is None): ``source`` is a
    weak reference to the storage living in it, and the storage starts ``offset``
    bytes into the memory.
    """

    handle: Handle
    nbytes: int
    mm: weakref.ref[mmap.mmap] | None
    owned: bool
    wrappers: int = 0
    linked: bool = True  # False once we released the handle; the memory may live on
    offset: int = 0
    source: Any = None
    storage_nbytes: int = 0


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
        #: address of a side-by-side range -> its length and, per export, (offset, segment)
        self.ranges: dict[int, tuple[int, list[tuple[int, _Segment]]]] = {}

    def segment_at(self, storage: torch.UntypedStorage) -> _Segment | None:
        """The live segment ``storage`` lives in, if any (and still exported, if ours)."""
        segment = self.segments.get(storage.data_ptr())
        if segment is None or not segment.linked:
            return None
        if segment.source is not None:  # in place: alive while the engine's storage is
            if segment.source.expired():
                self._in_place_died(storage.data_ptr(), segment)
                return None
            return segment if segment.storage_nbytes == storage.nbytes() else None
        if segment.nbytes != storage.nbytes() or segment.mm is None:
            return None
        return segment if segment.mm() is not None else None

    def moved_target(self, storage: torch.UntypedStorage) -> tuple[_Segment, mmap.mmap] | None:
        """Where ``storage``'s bytes went if another view of it was wrapped earlier."""
        entry = self.moved.get(storage.data_ptr())
        if entry is None:
            return None
        source, segment = entry
        mm = segment.mm() if segment.mm is not None else None
        if source.expired() or mm is None or not segment.linked or segment.nbytes != storage.nbytes():
            del self.moved[storage.data_ptr()]  # a dead storage whose address was reused, or a gone segment
            return None
        return segment, mm

    def into_segment(self, tensor: torch.Tensor) -> _Segment:
        """The segment ``tensor`` lives in, after moving its storage there if needed."""
        storage = tensor.untyped_storage()
        segment = self.segment_at(storage) or self.in_range(tensor)
        if segment is not None:
            return segment
        target = self.moved_target(storage)
        if target is not None:
            segment, mm = target
            _repoint(tensor, _storage_over(mm, segment.nbytes))
            return segment
        self.sweep()
        pages = _remap.exclusive_pages(storage) if _in_place_store(self.store) else None
        if pages is not None:
            return self._share_in_place(storage, *pages)
        return self._migrate(tensor, storage)

    def _migrate(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> _Segment:
        """Copy ``storage`` into new memory and re-point ``tensor`` at it."""
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef

        nbytes = storage.nbytes()
        handle, mm = self.store.create(nbytes)
        try:
            shared = _storage_over(mm, nbytes)
            source = torch.empty(0, dtype=torch.uint8).set_(storage)
            torch.empty(0, dtype=torch.uint8).set_(shared).copy_(source)
            _repoint(tensor, shared)
        except BaseException:
            self.store.release(handle)
            raise
        segment = _Segment(dict(handle), nbytes, weakref.ref(mm), owned=True)
        self.track(mm, shared.data_ptr(), segment)
        self.moved[storage.data_ptr()] = (StorageWeakRef(storage), segment)  # type: ignore[no-untyped-call]
        return segment

    def _share_in_place(self, storage: torch.UntypedStorage, address: int, length: int) -> _Segment:
        """Put new memory under ``storage``'s own pages (:mod:`._remap`); nothing moves."""
        from torch.multiprocessing.reductions import StorageWeakRef

        store: Any = self.store
        handle, fd = store.create_in_place(length)
        try:
            try:
                _remap.remap_in_place(address, length, fd, lambda at, n: store.reserve(fd, at, n))
            finally:
                os.close(fd)
        except BaseException:
            self.store.release(handle)  # the remapped slices keep the bytes; nothing is exported
            raise
        segment = _Segment(
            dict(handle),
            length,
            None,
            owned=True,
            offset=storage.data_ptr() - address,
            source=StorageWeakRef(storage),  # type: ignore[no-untyped-call]
            storage_nbytes=storage.nbytes(),
        )
        self.segments[storage.data_ptr()] = segment
        return segment

    def open_side_by_side(self, exports: Sequence[tuple[Handle, int]]) -> list[_Region]:
        """Map ``(handle, nbytes)`` exports side by side in one range (``_remap.map_side_by_side``).

        One storage spans the range; when it dies, the range is unmapped and the fds
        closed. The range is recorded, so that wrapping a tensor in it names its export
        instead of copying. If an export fails its checks, nothing stays open or mapped.
        """
        import ctypes

        import torch

        open_fd = self.store.open_fd  # type: ignore[attr-defined]  # optional; the caller checked
        fds: list[int] = []
        try:
            for handle, nbytes in exports:
                fds.append(open_fd(handle, nbytes))
            address, length, offsets = _remap.map_side_by_side(fds, [n for _, n in exports])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        try:  # from here the finalizer owns the range and the fds, even if frombuffer fails
            # ctypes keeps one array type per length; contexts are few, and so are lengths
            buffer = (ctypes.c_char * length).from_address(address)
            finalizer = weakref.finalize(buffer, self._range_died, address, length, tuple(fds))
        except BaseException:
            try:
                _remap.unmap(address, length)
            finally:
                for fd in fds:
                    os.close(fd)
            raise
        finalizer.atexit = False  # at exit the process's mappings and fds go anyway
        storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()  # keeps buffer alive
        segments = [
            _Segment(dict(handle), nbytes, None, owned=False, offset=-offset)
            for (handle, nbytes), offset in zip(exports, offsets, strict=True)
        ]
        with self.lock:
            self.ranges[address] = (length, list(zip(offsets, segments, strict=True)))
        return [_Region(storage, offset, fd) for offset, fd in zip(offsets, fds, strict=True)]

    def in_range(self, tensor: torch.Tensor) -> _Segment | None:
        """The export a tensor of a side-by-side range lies in, if it lies within one."""
        storage = tensor.untyped_storage()
        entry = self.ranges.get(storage.data_ptr())
        if entry is None or entry[0] != storage.nbytes():
            return None
        item, first = tensor.element_size(), int(tensor.storage_offset())
        start = first * item
        end = required_elements(tuple(tensor.shape), tuple(tensor.stride()), first) * item
        for offset, segment in entry[1]:
            if offset <= start and end <= offset + segment.nbytes:
                return segment
        return None

    def _range_died(self, address: int, length: int, fds: tuple[int, ...]) -> None:
        with self.lock:
            self.ranges.pop(address, None)
        try:
            _remap.unmap(address, length)
        finally:
            for fd in fds:
                os.close(fd)

    def _in_place_died(self, address: int, segment: _Segment) -> None:
        """The storage living in memory mapped in place is gone: forget it, release the handle."""
        if self._unlink(address, segment):
            self.store.release(segment.handle)

    def _unlink(self, address: int, segment: _Segment) -> bool:
        """Forget ``segment`` (at ``address``); whether its handle is ours to release now."""
        if self.segments.get(address) is segment:
            del self.segments[address]
        last = segment.owned and segment.linked
        segment.linked = False
        return last

    def sweep(self) -> None:
        """Release the memory of in-place storages that died since (torch tells no one)."""
        for address, segment in list(self.segments.items()):
            if segment.source is not None and segment.source.expired():
                self._in_place_died(address, segment)

    def track(self, mm: mmap.mmap, address: int, segment: _Segment) -> None:
        """Record a new mapping until it dies (its last storage, hence its last tensor)."""
        self.segments[address] = segment
        finalizer = weakref.finalize(mm, self._mapping_died, segment, address, os.getpid())
        finalizer.atexit = False  # at exit, the store releases what it owns

    def _mapping_died(self, segment: _Segment, address: int, pid: int) -> None:
        """The last storage over a mapping is gone: forget it; release the handle if ours."""
        if os.getpid() != pid:
            return  # a forked child's copy of the parent's mapping
        with self.lock:
            for key in [k for k, (_, s) in self.moved.items() if s is segment]:
                del self.moved[key]
            last = self._unlink(address, segment)
        if last:
            self.store.release(segment.handle)

    def release_export(self, segment: _Segment) -> None:
        """One exporting wrapper closed; the last one releases the handle (memory lives on)."""
        with self.lock:
            self.sweep()
            segment.wrappers -= 1
            last = segment.wrappers == 0 and segment.linked
            if last:
                segment.linked = False
        if last:
            self.store.release(segment.handle)  # a no-op in a forked child: the handle is the parent's


class _Region:
    """Where one export lies in a range mapped by :meth:`HostMemoryIPCWrapper.to_tensors`.

    ``storage`` spans the whole range (it unmaps the range and closes the fds when it
    dies); the export starts ``offset`` bytes in, and ``fd`` is open while it lives.
    """

    __slots__ = ("fd", "offset", "storage")

    def __init__(self, storage: torch.UntypedStorage, offset: int, fd: int) -> None:
        self.storage, self.offset, self.fd = storage, offset, fd

    def size(self) -> int:
        """The memory's current size (what ``mmap.size()`` says of a mapping)."""
        return os.fstat(self.fd).st_size


class _SharedMapping:
    """The one mapping (and storage over it) of the wrappers decoded from one record,
    once one of them opened it; it goes with the last of those wrappers."""

    __slots__ = ("mm", "storage")

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None
        self.storage: torch.UntypedStorage | None = None


def _side_by_side_store(store: object) -> bool:
    """Whether ``store`` has the optional member that mapping exports side by side needs."""
    return callable(getattr(store, "open_fd", None))


def _in_place_store(store: object) -> bool:
    """Whether ``store`` has the optional members that sharing memory in place needs."""
    return callable(getattr(store, "create_in_place", None)) and callable(getattr(store, "reserve", None))


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
#: Handles found valid: (class, (type, value) per wire field) -> what _checked_handle returns.
_CHECKED: dict[tuple[Any, ...], tuple[tuple[tuple[str, Any], ...], int]] = {}
_MAX_CHECKED = 4096


def _after_fork_in_child() -> None:
    global _pidns
    _pidns = None
    for tracker in _TRACKERS:
        tracker.reset()  # the child wraps into memory of its own


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the wrapper ----------------------------------------------------------------------


def _check_store(cls: type, store: object) -> dict[str, WireField]:
    """The wire fields a store's handle schema gives ``cls``; ``TypeError`` saying what is wrong."""
    where = f"{cls.__name__}.store ({type(store).__name__})"
    missing = [m for m in STORE_MEMBERS if not hasattr(store, m)]
    if missing:
        raise TypeError(f"{where} is not a HostMemoryStore: it lacks {', '.join(missing)}")
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
        empty = _EMPTY.get(spec.kind)
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
    _tracker: ClassVar[_Tracker | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        store = getattr(cls, "store", None)
        if store is None:
            return  # an intermediate base without a store yet
        declared = cls.__dict__.get("wire_fields")
        cls.wire_fields = _check_store(cls, store)
        if declared is not None and dict(declared) != cls.wire_fields:
            raise TypeError(
                f"{cls.__name__} declares wire_fields, but a HostMemoryIPCWrapper derives them from its "
                f"store's handle_fields and its nbytes_field ({', '.join(cls.wire_fields)}): remove the "
                "declaration and put the fields the handle needs in the store's handle_fields"
            )
        if "store" in cls.__dict__:  # subclasses of this class share its tracker
            cls._tracker = _Tracker(store)
            _TRACKERS.append(cls._tracker)

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
        **handle: Any,
    ) -> None:
        super().__init__(
            dtype=dtype, shape=shape, stride=stride, storage_offset=storage_offset, device_uuid=device_uuid
        )
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
        self._export: _Segment | None = None  # set on wrappers exporting memory made here
        self._mm: mmap.mmap | None = None  # this wrapper's mapping, once opened
        self._shared: _SharedMapping | None = None  # the mapping of wrappers decoded together
        self._region: _Region | None = None  # where to_tensors mapped this memory, if it did

    @classmethod
    def from_views(cls, export: Mapping[str, Any], views: Sequence[Mapping[str, Any]]) -> list[Self]:
        """Validate as the base does; the wrappers then map their memory once, together."""
        wrappers = super().from_views(export, views)
        if len(wrappers) > 1:
            shared = _SharedMapping()
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
        still share their export's place. Falls back to :meth:`to_tensor` per wrapper
        for fewer than two exports, for wrappers already opened, and for a store
        without ``open_fd``. Wrapping a tensor opened here again names its export, as
        for ``to_tensor()``.
        """
        closed = [w for w in wrappers if w.closed]
        if closed:
            raise DescriptorError(f"{closed[0]!r} is closed")
        tracker = cls._memory()
        exports: dict[tuple[Any, ...], list[HostMemoryIPCWrapper]] = {}
        for w in wrappers:  # by export: the wrappers of one memory share its place
            if isinstance(w, HostMemoryIPCWrapper) and w.memory_nbytes and not w._opened():
                exports.setdefault(w._export_key(), []).append(w)
        if not _side_by_side_store(tracker.store) or len(exports) < 2 or not sys.platform.startswith("linux"):
            return super().to_tensors(wrappers)
        groups = list(exports.values())
        regions = tracker.open_side_by_side([(group[0].handle, group[0].memory_nbytes) for group in groups])
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
        empty = _empty_handle(store)
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
        """The memory's handle: the store's handle fields (their empty values for an empty tensor)."""
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
            storage = _storage_over(mm, nbytes)
            tracker.track(mm, storage.data_ptr(), _Segment(dict(handle), nbytes, weakref.ref(mm), owned=True))
        stride = torch.empty(shape, dtype=dtype, device="meta").stride()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        """Put ``tensor``'s storage in the store's memory (once per storage) and describe it.

        A large allocation of torch's, whose pages hold nothing else (glibc serves it
        with a mapping of its own: a KV cache), is shared in place when the store
        supports it: the memory is mapped over the allocation's pages a slice at a
        time, so nothing moves and every tensor and view of it, wrapped or not, sees
        the shared bytes. Peak memory grows by one slice. Do it before the engine runs:
        writes from another thread during the remap would be lost.

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
            return cls._describe(tensor, _empty_handle(cls._memory().store), 0)
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
        slice's private pages are freed as its shared ones come). Tensors :meth:`wrap`
        would refuse count nothing here: ``wrap`` refuses them, and ``wrap_kv_caches``
        names their layer.
        """
        needed: dict[int, int] = {}
        tracker = cls._memory()
        in_place = _in_place_store(tracker.store)
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
        The mapping stays until the last view of it dies, even after :meth:`close`.
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
                mm, storage = self._mm, _storage_over(self._mm, nbytes)
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
        storage = _storage_over(mm, nbytes)
        with tracker.lock:  # so that wrapping a view of it names this memory instead of copying
            tracker.track(mm, storage.data_ptr(), _Segment(handle, nbytes, weakref.ref(mm), owned=False))
        return mm, storage

    def verify(self) -> None:
        """Check that the memory this wrapper mapped has not shrunk; call it before each transfer.

        A same-user process can truncate memory that is not sealed (a named segment, a
        file), and touching a page past the new end kills this process with SIGBUS.
        This check (one ``fstat``) refuses with ``DescriptorError`` instead. It narrows
        the window to the time between the check and the access; it cannot close it.
        A no-op before :meth:`to_tensor` and after :meth:`close`.
        """
        opened: mmap.mmap | _Region | None = self._mm if self._mm is not None else self._region
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


# -- the cache context ----------------------------------------------------------------


class HostMemoryCacheContext(BaseCacheContext):
    """The base cache context over host memory, checking the memory before each transfer.

    Before every store and retrieve it calls :meth:`HostMemoryIPCWrapper.verify` on each
    of its wrappers, so memory that another process truncated is refused with
    ``DescriptorError`` instead of crashing the server with SIGBUS. Everything else is
    the base's generic torch machinery, which is what host memory needs.
    """

    device_type: ClassVar[str] = "cpu"

    def verify_memory(self) -> None:
        """Raise ``DescriptorError`` if any wrapper's memory shrank since it was mapped."""
        for wrapper in self.kv_caches:
            if isinstance(wrapper, HostMemoryIPCWrapper):
                wrapper.verify()

    def store(self, plan: ChunkTransfer) -> None:
        self.verify_memory()
        super().store(plan)

    def retrieve(self, plan: ChunkTransfer) -> None:
        self.verify_memory()
        super().retrieve(plan)

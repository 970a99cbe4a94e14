"""Host memory for chunk payloads, prepared before the stores need it.

A server keeps every chunk it stores in host memory of its own. Fresh anonymous memory
costs its first touch: the kernel zeroes each page, and on a VM whose host never backed
the memory far more (0.4-0.5 GB/s on the development VM, against several GB/s for a copy
into used memory). Three measures:

* **Slabs, prepared ahead.** :meth:`HostBufferPool.prepare` starts a background thread
  that maps *slabs* (:data:`SLAB_BYTES`, huge pages requested) and faults them in
  (``MADV_POPULATE_WRITE``) off the request path, one call per slab without the GIL. Slabs do not
  depend on any chunk size, so a server starts preparing when it starts, before any
  engine registers (``serve --host-memory eager``, the default: its whole
  ``--max-host-bytes``; ``ahead``: 256 MiB of ready memory ahead of use, from the first
  registration, so a server no engine uses holds none), and stops short of the host's
  memory headroom.
* **Chunks carved from slabs, reused once unused.** :meth:`HostBufferPool.take` hands
  out a free buffer of the size asked: an idle one of that size first (a chunk evicted,
  a context's chunks dropped), else one carved from a slab's free space, else the free
  space of idle buffers of other sizes; only when the slabs are spent does a take map
  memory on its own path, correct but slower, counted (``slow_takes``).
* **Registered with a device as it is prepared.** Once a device context tells the pool
  how (:meth:`HostBufferPool.use_device`; CUDA: ``cuMemHostRegister``, portable, see
  ``BaseCacheContext.register_host_memory``), the preparing thread registers every slab,
  those mapped before included, once each: never on a take's path, never under the
  pool's lock. The registration is undone before a slab is unmapped.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import functools
import inspect
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)
#: Below this a buffer is plain ``torch.empty`` (the allocator's heap reuses such sizes).
HUGE_PAGE_BYTES = 2 << 20
#: The preparing thread's unit: one mapping, faulted in and registered as a whole.
SLAB_BYTES = 256 << 20
#: What :meth:`HostBufferPool.stats` counts besides its mappings.
_COUNTERS = ("takes", "slow_takes", "prepared_bytes", "registered_bytes", "register_failures", "kept_mapped")
#: How far ahead of use :meth:`HostBufferPool.prepare` keeps ready memory by default.
DEFAULT_AHEAD_BYTES = 256 << 20
#: Host memory the preparing thread leaves free for everything else (see :meth:`HostBufferPool._room`).
HEADROOM_RESERVE_BYTES = 1 << 30
#: Seconds before the host's headroom is read again once it was short.
_ROOM_RETRY_S = 5.0

#: ``register(address, nbytes)``: a device registration of host memory, and what undoes it.
Register = Callable[[int, int], "Callable[[], None] | None"]


@functools.cache
def huge_pages_available() -> bool:
    """Whether this kernel takes ``MADV_HUGEPAGE`` (asked once per process)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    probe = mmap.mmap(-1, HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        probe.madvise(advice)
    except OSError as exc:  # a kernel built without transparent huge pages
        _log.debug("no transparent huge pages for chunk buffers: %s", exc)
        return False
    finally:
        probe.close()
    return True


@dataclass(eq=False)
class _Slab:
    """One mapping chunk buffers are carved from: its free ranges and device registration."""

    region: mmap.mmap
    address: int
    size: int
    #: Free ``(offset, length)`` ranges, sorted and merged.
    free: list[tuple[int, int]]
    #: What ends its device registration; None: not registered (yet, or refused).
    undo: list[Callable[[], None]] | None = None
    #: The preparing thread is registering it (without the lock): not unmapped meanwhile.
    registering: bool = False
    #: Mapped on a take's path, past the bound: unmapped again once wholly free.
    extra: bool = False
    #: Buffers carved from it that the pool still lists.
    views: int = 0

    def carve(self, nbytes: int) -> int | None:
        """Take ``nbytes`` from the first free range that holds them; its offset, or None."""
        for i, (offset, length) in enumerate(self.free):
            if length >= nbytes:
                if length == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = (offset + nbytes, length - nbytes)
                return offset
        return None

    def give_back(self, offset: int, nbytes: int) -> None:
        """Return a range to the free list, merged with its neighbours."""
        i = bisect.bisect(self.free, (offset, nbytes))
        self.free.insert(i, (offset, nbytes))
        if i + 1 < len(self.free) and offset + nbytes == self.free[i + 1][0]:
            self.free[i] = (offset, nbytes + self.free.pop(i + 1)[1])
        if i and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            start, length = self.free.pop(i - 1)
            self.free[i - 1] = (start, length + self.free[i - 1][1])

    def free_bytes(self) -> int:
        return sum(length for _, length in self.free)


class HostBufferPool:
    """Slabs of host memory, carved into chunk buffers that are reused once nothing uses them.

    A buffer is ``torch.frombuffer`` over a ``memoryview`` of a slab (an ``mmap``). The
    tensor's storage holds that view through the buffer protocol, one reference for as
    long as any tensor or view of it lives, so a view only the pool references is idle:
    no tensor can reach its bytes. Each view is indexed to its slab and offset, so
    giving it back is a dict lookup.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._slabs: list[_Slab] = []
        #: The slabs with free space, in the order they were mapped.
        self._roomy: list[_Slab] = []
        #: Buffers by size, as views of slabs; ``_hand`` is where the last search ended.
        self._views: dict[int, list[memoryview]] = {}
        self._hand: dict[int, int] = {}
        #: id(view) -> the slab it was carved from and its offset there.
        self._where: dict[int, tuple[_Slab, int]] = {}
        #: Slabs whose registration could not be ended: never unmapped (see :meth:`_unmap`).
        self._kept: list[_Slab] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self._register: Callable[[], Register | None] = lambda: None
        #: What :meth:`prepare` asked: the bound, ahead or eager.
        self._limit = 0
        self._ahead = 0
        self._largest = 0  # the largest chunk size asked for: slabs hold at least one
        self._eager = False
        self._said = False  # the preparing thread's outcome is logged once
        self._room_retry_at = 0.0
        self._since = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- the request path --------------------------------------------------------------

    def take(self, nbytes: int) -> torch.Tensor:
        """An uninitialised 1-D uint8 tensor of ``nbytes``: a free buffer, carved, or fresh."""
        import torch

        with self._lock:
            self._counts["takes"] += 1
            view = self._idle_view(nbytes)
            if view is None:
                view = self._carve(nbytes)
            if view is None:
                self._dissolve_idle(keep=nbytes)
                view = self._carve(nbytes)
            if view is None:  # the slabs are spent: mapped on the caller's path, pages fault on use
                self._counts["slow_takes"] += 1
                slab = _new_slab(nbytes, extra=self._mapped_bytes() + nbytes > self._limit)
                self._slabs.append(slab)
                self._roomy.append(slab)
                view = self._carve(nbytes, only=slab)
                assert view is not None
            self._wake.notify_all()  # the preparer tops ready memory up again, registers new slabs
            return torch.frombuffer(view, dtype=torch.uint8)  # the storage holds the view

    def _idle_view(self, nbytes: int) -> memoryview | None:
        views = self._views.get(nbytes, [])
        start = self._hand.get(nbytes, 0)
        for k in range(len(views)):
            i = (start + k) % len(views)
            if _idle(views, i):
                self._hand[nbytes] = i + 1
                return views[i]
        return None

    def _carve(self, nbytes: int, only: _Slab | None = None) -> memoryview | None:
        """A new buffer from the first slab with room (registered ones first). Lock held.

        Only slabs with free space are looked at (``_roomy``): once the pool is carved, a
        take costs the same whatever the bound.
        """
        slabs = [only] if only is not None else sorted(self._roomy, key=lambda s: s.undo is None)
        for slab in slabs:
            offset = slab.carve(_footprint(nbytes))
            if not slab.free and slab in self._roomy:
                self._roomy.remove(slab)
            if offset is not None:
                view = memoryview(slab.region)[offset : offset + nbytes]
                slab.views += 1
                self._views.setdefault(nbytes, []).append(view)
                self._where[id(view)] = (slab, offset)
                return view
        return None

    def _dissolve_idle(self, keep: int) -> None:
        """Give the idle buffers of every size but ``keep`` back to their slabs' free space;
        unmap extra slabs left wholly free. Lock held."""
        for nbytes, views in self._views.items():
            if nbytes == keep:
                continue
            for i in reversed(range(len(views))):
                if _idle(views, i):
                    self._drop_view(views.pop(i), nbytes)
            self._hand[nbytes] = 0
        for slab in [s for s in self._slabs if s.extra and not s.views and not s.registering]:
            self._slabs.remove(slab)
            self._roomy.remove(slab)
            self._unmap(slab)

    def _drop_view(self, view: memoryview, nbytes: int) -> None:
        slab, offset = self._where.pop(id(view))
        view.release()
        slab.views -= 1
        slab.give_back(offset, _footprint(nbytes))
        if slab not in self._roomy:
            self._roomy.append(slab)

    # -- preparing ---------------------------------------------------------------------

    def prepare(
        self,
        nbytes: int = 0,
        *,
        limit: int,
        ahead: int = DEFAULT_AHEAD_BYTES,
        eager: bool = False,
    ) -> None:
        """Keep host memory mapped and faulted in ahead of :meth:`take`, off its path.

        A background thread (started on the first call) maps slabs and populates their
        pages until ``ahead`` bytes are ready (free in slabs or idle; at least one
        ``nbytes`` buffer), or, ``eager``, until the pool holds ``limit``; never past
        ``limit``, nor into the last :data:`HEADROOM_RESERVE_BYTES` of the host's memory.
        ``nbytes``, a chunk size if known, sets the least ready memory, and the least size of
        the slabs mapped from then on (a chunk never spans two). Never blocks.
        """
        with self._lock:
            self._limit, self._ahead, self._eager = limit, max(ahead, nbytes), eager
            self._largest = max(self._largest, nbytes)
            if self._thread is None:
                self._since = time.monotonic()
                self._start_thread()
            self._wake.notify_all()

    def use_device(self, register: Register) -> None:
        """Have every slab registered with a device by ``register(address, nbytes)``, once.

        The first caller's ``register`` is kept (a portable registration serves every
        device); the preparing thread registers the slabs mapped so far and each new one.
        What ``register`` returns is called before a slab is unmapped. A ``register`` that
        raises leaves that slab pageable (copies work, slower): logged, counted
        (``register_failures``) and not tried again.
        """
        with self._lock:
            if self._registrar() is not None:
                return
            # Weakly, when a context's method: the pool must not keep a closed context alive
            # (the next device context takes over once it is gone).
            self._register = weakref.WeakMethod(register) if inspect.ismethod(register) else lambda: register
            if self._thread is None:  # no preparing asked for: a thread to register what is mapped
                self._start_thread()
            self._wake.notify_all()

    def _start_thread(self) -> None:
        """The preparing thread, stopped at exit (:meth:`stop`). Lock held."""
        self._thread = threading.Thread(target=self._prepare_loop, name="lmcache-host-arena", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop preparing and wait for the thread (it ends the slab under way first).

        Run at exit: a daemon thread still inside ``madvise`` when the interpreter finalizes
        is ended as it comes back for the GIL, which aborts the process (``serve`` stopped
        while its memory was being prepared exited with SIGABRT). Idempotent.
        """
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait_registered(self, timeout: float) -> bool:
        """Until every slab is registered (or refused); False on timeout. For tests and tools."""
        with self._lock:
            return self._wake.wait_for(lambda: self._unregistered() is None, timeout)

    def _prepare_loop(self) -> None:
        # At the default priority: a lower one would let the scheduler leave this thread
        # waiting while it holds the GIL between slabs, stalling the server's own threads
        # (a priority inversion: hundreds of ms on a loaded 2-vCPU VM). Its CPU is the
        # kernel's, backing fresh pages, inside one GIL-free madvise call per slab.
        while True:
            with self._lock:
                while True:
                    if self._stopping:
                        return
                    register = self._registrar()
                    slab = self._unregistered() if register is not None else None
                    if slab is not None:
                        slab.registering = True
                        break
                    nbytes = self._next_slab()
                    if nbytes:
                        break
                    self._wake.wait(1.0)
            if slab is not None:
                assert register is not None
                self._register_slab(slab, register)
                continue
            slab = _new_slab(nbytes, extra=False)  # mapped and faulted in without the lock
            _populate(slab)
            with self._lock:
                self._slabs.append(slab)
                self._roomy.append(slab)
                self._counts["prepared_bytes"] += nbytes
                self._wake.notify_all()
                if self._eager and self._limit - self._mapped_bytes() < HUGE_PAGE_BYTES:
                    self._say_prepared("")

    def _registrar(self) -> Register | None:
        return self._register()

    def _unregistered(self) -> _Slab | None:
        """A slab to register now, or None. Lock held."""
        if self._registrar() is None:
            return None
        return next((s for s in self._slabs if s.undo is None and not s.registering), None)

    def _register_slab(self, slab: _Slab, register: Register) -> None:
        try:
            undo = register(slab.address, slab.size)
        except Exception as exc:  # the copies still work, from pageable memory
            why = f"{type(exc).__name__}: {exc}"  # as text: the frames would keep the slab alive
            _log.warning("a %d-byte host slab stays unregistered: %s", slab.size, why)
            done: list[Callable[[], None]] = []
            failed = True
        else:
            done = [undo] if undo is not None else []
            failed = False
        with self._lock:
            slab.undo, slab.registering = done, False
            self._counts["register_failures" if failed else "registered_bytes"] += 1 if failed else slab.size
            self._wake.notify_all()

    def _next_slab(self) -> int:
        """Bytes of the next slab to prepare now, or 0. Lock held."""
        total = self._mapped_bytes()
        size = min(max(SLAB_BYTES, self._largest), self._limit - total)
        if size < HUGE_PAGE_BYTES:
            return 0
        if not self._eager:
            ready = sum(s.free_bytes() for s in self._slabs if not s.extra)
            ready += sum(n for n, views in self._views.items() for i in range(len(views)) if _idle(views, i))
            if ready >= self._ahead:
                return 0
        return size if self._room(size) else 0

    def _room(self, size: int) -> bool:
        """Whether the host has ``size`` more bytes to spare beyond the reserve (said once if not).

        Short, it is asked again after :data:`_ROOM_RETRY_S` (memory may be freed), not on
        every take that wakes the preparing thread.
        """
        from .._headroom import memory_headroom

        now = time.monotonic()
        if now < self._room_retry_at:
            return False
        room = memory_headroom()
        if room is None or room.free - size >= HEADROOM_RESERVE_BYTES:
            return True
        self._room_retry_at = now + _ROOM_RETRY_S
        self._say_prepared(f"; stopped {HEADROOM_RESERVE_BYTES >> 20} MiB short of {room.limit}'s limit")
        return False

    def _say_prepared(self, short: str) -> None:
        """Log, once, that the preparing thread reached its goal (or the host's limit). Lock held."""
        if self._said:
            return
        self._said = True
        nbytes, seconds = self._mapped_bytes(), round(time.monotonic() - self._since, 3)
        _log.info(
            f"host memory prepared: {nbytes >> 20} MiB of {self._limit >> 20} MiB in {seconds:.1f} s{short}",
            extra={
                "event": "host_memory",
                "fields": {"bytes": nbytes, "limit": self._limit, "seconds": seconds},
            },
        )

    # -- accounting --------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Buffers the pool holds, how many nothing uses now, its bytes, and the counters.

        ``bytes``: mapped (slabs, kept ones included); ``ready_bytes``: of those, free to
        hand out now (slab space no buffer holds, idle buffers); ``target_bytes``: what
        the preparing thread aims at; ``takes``: buffers handed out; ``slow_takes``: of
        those, mapped on the caller's path; ``prepared_bytes``: mapped and faulted in by
        the preparing thread; ``registered_bytes``: registered with a device;
        ``register_failures``: slabs a device refused (left pageable); ``kept_mapped``:
        slabs never unmapped because ending their registration failed.
        """
        with self._lock:
            lists = list(self._views.values())
            idle = [(len(v[i]), _idle(v, i)) for v in lists for i in range(len(v))]
            return {
                "mappings": len(idle),
                "idle": sum(flag for _, flag in idle),
                "bytes": self._mapped_bytes(),
                "ready_bytes": sum(s.free_bytes() for s in self._slabs) + sum(n for n, f in idle if f),
                "target_bytes": self._limit if self._eager else min(self._limit, self._ahead),
                **{k: self._counts[k] for k in _COUNTERS},
            }

    def server_counters(self) -> dict[str, int]:
        """:meth:`stats` as a server reports them (``status``, ``/metrics``): ``host_`` names."""
        stats = self.stats()
        names = {"bytes": "mapped_bytes", "target_bytes": "prepare_target_bytes"}
        keys = ("bytes", "ready_bytes", "target_bytes", *(k for k in _COUNTERS if k != "takes"))
        return {f"host_{names.get(k, k)}": stats[k] for k in keys}

    def _mapped_bytes(self) -> int:
        """Bytes the pool holds mapped, kept ones included (they count against the bound)."""
        return sum(s.size for s in self._slabs) + sum(s.size for s in self._kept)

    def _unmap(self, slab: _Slab) -> None:
        """Unmap ``slab`` once its device registration ended; a failure keeps it mapped.

        A device may still copy into memory it holds registered, so memory whose
        registration did not end is never unmapped (nor handed out again): it stays
        with the pool, counted (``kept_mapped``), until the process exits.
        """
        for undo in slab.undo or ():
            try:
                undo()
            except Exception:
                what = "ending a device registration of a %d-byte host slab failed: it stays mapped"
                _log.exception(what, slab.size)
                self._kept.append(slab)
                self._counts["kept_mapped"] += 1
                return
        slab.region.close()


def _footprint(nbytes: int) -> int:
    """Bytes a buffer of ``nbytes`` takes in a slab: whole pages, so every buffer is page aligned."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _new_slab(nbytes: int, *, extra: bool) -> _Slab:
    nbytes = _footprint(nbytes)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_available():
        region.madvise(mmap.MADV_HUGEPAGE)
    return _Slab(region, _address(region), nbytes, [(0, nbytes)], extra=extra)


def _address(region: mmap.mmap) -> int:
    """Where ``region`` is mapped (the temporary view is gone before this returns)."""
    import ctypes

    holder = ctypes.c_char.from_buffer(region)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def _populate(slab: _Slab) -> None:
    """Fault every page of ``slab`` in now, in one ``madvise`` call without the GIL.

    One call, not one per piece: the thread holds the GIL only between slabs, so the
    server's own threads hardly wait for it. A kernel without ``MADV_POPULATE_WRITE``
    (before 5.14): the pages are written instead.
    """
    import ctypes

    from .._libc import MADV_POPULATE_WRITE, _libc

    if _libc().madvise(slab.address, slab.size, MADV_POPULATE_WRITE) == 0:
        return
    _log.debug("madvise(MADV_POPULATE_WRITE): %s; writing the pages", os.strerror(ctypes.get_errno()))
    for offset in range(0, slab.size, mmap.PAGESIZE):
        slab.region[offset] = 0


def _refs(items: list[Any], i: int) -> int:
    return sys.getrefcount(items[i])


#: What :func:`_refs` counts for an item only its list references (measured, not assumed:
#: interpreters differ in the references a call's argument adds).
_ONLY_LISTED = _refs([bytearray()], 0)


def _idle(views: list[memoryview], i: int) -> bool:
    """Whether only ``views`` references buffer ``i``: no tensor can reach its bytes."""
    return _refs(views, i) == _ONLY_LISTED


#: The process's pool of chunk buffers.
POOL = HostBufferPool()


def host_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D uint8 host tensor of ``nbytes``, page aligned from 2 MiB on.

    ``pin``: page-locked, for a device's asynchronous copies. Otherwise, from
    :data:`HUGE_PAGE_BYTES` on, a buffer from :data:`POOL` (reused once no tensor uses
    it; carved from prepared slabs).
    """
    import torch

    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes < HUGE_PAGE_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    return POOL.take(nbytes)

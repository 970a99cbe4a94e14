"""The store protocols: what a host-memory backend writes, and the two optional abilities.

:class:`HostMemoryStore` is required; :class:`InPlaceStore` (share a large allocation
where it lies) and :class:`SideBySideStore` (map separate exports in one range) are
optional. The kit tells which a store has with ``isinstance`` on these
``runtime_checkable`` protocols, once, when a wrapper class names the store.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from .._ipc_wrapper import Primitive, WireField

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

    Two optional protocols add abilities: :class:`InPlaceStore` (share a large
    allocation where it lies instead of copying it) and :class:`SideBySideStore` (map a
    context's separate exports in one address range).

    **Sizes and pages.** ``nbytes`` is what the kit needs, and what the descriptor
    carries. A store may make the memory larger: its ``create`` may round ``nbytes`` up
    to its page size (hugetlbfs maps whole huge pages only), as long as its
    ``open_existing`` checks the size as it rounds it. The kit maps and touches only
    ``nbytes`` bytes, and reads an export's page size from the export itself (its
    file's ``st_blksize``, the huge page size on hugetlbfs): it shares in place only
    an allocation whose bounds are whole pages of it, and places each export mapped
    side by side on a boundary of its own pages.

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
        """The handle's schema, field name -> bounds (a class attribute in practice)."""
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
        """Create memory of ``nbytes`` or more; return its handle and a read-write mapping.

        Exclusive creation, mode 0600, space reserved up front (a full store raises
        here, not as a SIGBUS later). The store may round ``nbytes`` up to its pages.
        This process owns the handle until :meth:`release`. On failure nothing is
        left behind.
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


@runtime_checkable
class InPlaceStore(Protocol):
    """Optional: a store that lets the kit share a large allocation where it lies.

    The kit maps the new memory over the allocation's own pages a slice at a time, so
    nothing moves and peak memory grows by one slice (see the backend-author guide).
    A store without both members migrates by copy. Both are needed: a store with one
    of them is refused when a wrapper class names it.
    """

    def create_in_place(self, nbytes: int) -> tuple[Handle, int]:
        """Like :meth:`HostMemoryStore.create`, with no pages reserved and no mapping.

        Returns the handle and a new file descriptor of the memory, which the kit
        closes. The memory may be larger than ``nbytes`` (rounded up to the store's
        pages); the kit shares in place only when the allocation's bounds are whole
        pages of the export's page size, and otherwise releases the handle and copies.
        """
        ...

    def reserve(self, fd: int, offset: int, nbytes: int) -> None:
        """Reserve pages ``[offset, offset + nbytes)`` of memory from :meth:`create_in_place`.

        ``posix_fallocate`` in practice; raises the store's capacity error when they do
        not fit. The kit reserves each slice before it copies into it.
        """
        ...


@runtime_checkable
class SideBySideStore(Protocol):
    """Optional: a store that lets a cache context map separate exports in one address range.

    :meth:`~lmcache_platform.hostmem.HostMemoryIPCWrapper.to_tensors` then places
    them at equal steps in one storage, where the layers stack. Without it each
    export is mapped on its own.
    """

    def open_fd(self, handle: Handle, nbytes: int) -> int:
        """:meth:`HostMemoryStore.open_existing` without the mapping: the same checks, then a new fd.

        The kit keeps the descriptor while the memory is mapped (for the shrink check)
        and closes it after.
        """
        ...


#: The members a store must have (see :class:`HostMemoryStore`).
STORE_MEMBERS = ("handle_fields", "check_handle", "check_capacity", "create", "open_existing", "release")
#: The optional protocols and their members: a store has all of a protocol's, or none.
OPTIONAL_PROTOCOLS: dict[type, tuple[str, ...]] = {
    InPlaceStore: ("create_in_place", "reserve"),
    SideBySideStore: ("open_fd",),
}
EMPTY: dict[type, Primitive] = {int: 0, str: "", bytes: b"", list: []}


def empty_handle(store: HostMemoryStore) -> dict[str, Primitive]:
    """The handle of an empty tensor: each field's empty value."""
    return {name: [] if spec.kind is list else EMPTY[spec.kind] for name, spec in store.handle_fields.items()}


def partial_protocols(store: object) -> list[str]:
    """What ``store`` lacks of each optional protocol it started on: one line each, none if whole."""
    out = []
    for protocol, members in OPTIONAL_PROTOCOLS.items():
        present = [m for m in members if getattr(store, m, None) is not None]
        wrong = [m for m in members if not callable(getattr(store, m, None))]
        if present and wrong:
            out.append(
                f"{protocol.__name__} needs the methods {', '.join(members)}: {', '.join(wrong)} missing"
            )
    return out

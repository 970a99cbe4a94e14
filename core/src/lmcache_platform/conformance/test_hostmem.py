"""Conformance: what a host-memory backend (a ``HostMemoryIPCWrapper`` subclass) owes.

The kit does the migrating and reopening, but the store decides what survives a fork,
what an empty tensor costs, how views of one allocation are exported and whether a
capacity error leaves anything behind. A store's optional abilities are checked
through what the kit does with them: an :class:`~lmcache_platform.hostmem.InPlaceStore`
shares a KV cache where it lies, a :class:`~lmcache_platform.hostmem.SideBySideStore`
reopens separate exports in one range; a store without them must give the same bytes
by copying and by mapping each export on its own. Backends whose wrapper is not built
on :mod:`lmcache_platform.hostmem` skip these checks.
"""

from __future__ import annotations

import errno
import gc
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import wire
from lmcache_platform.conformance._kv import random_bits, to_bytes
from lmcache_platform.conformance._peer import Peer
from lmcache_platform.conformance._target import Target
from lmcache_platform.hostmem import HostMemoryIPCWrapper, HostMemoryStore, InPlaceStore, SideBySideStore

#: What a store may say when memory does not fit (ENOSPC for file systems, ENOMEM for
#: anonymous memory, EDQUOT for quotas, EFBIG for a file-size limit).
CAPACITY_ERRNOS = {errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG}
#: A size no host can give: 64 TiB.
ABSURD = 1 << 46
#: A KV cache above glibc's largest mmap threshold (32 MiB), so its pages are its own.
BIG = 40 << 20


@pytest.fixture
def hostmem_class(lmcache_backend: Target, lmcache_device: torch.device) -> type[HostMemoryIPCWrapper]:
    cls = lmcache_backend.wrapper_class
    if not (isinstance(cls, type) and issubclass(cls, HostMemoryIPCWrapper)):
        pytest.skip(
            f"{lmcache_backend.name} is not a host-memory backend (its wrapper is not a "
            "lmcache_platform.hostmem.HostMemoryIPCWrapper)"
        )
    return cls


def footprint() -> tuple[int, int]:
    """(open fds, mappings) of this process, as the kernel counts them."""
    with open("/proc/self/maps") as f:
        return len(os.listdir("/proc/self/fd")), sum(1 for _ in f)


def exports(
    wrappers: list[lp.DeviceIPCWrapper], cls: type[HostMemoryIPCWrapper]
) -> list[HostMemoryIPCWrapper]:
    """``wrappers``, checked to be of the backend's host-memory class."""
    assert all(type(w) is cls for w in wrappers), [type(w) for w in wrappers]
    return [w for w in wrappers if isinstance(w, HostMemoryIPCWrapper)]


def test_an_empty_tensor_needs_no_memory(
    hostmem_class: type[HostMemoryIPCWrapper], lmcache_peer: Peer
) -> None:
    tensors = [torch.empty(0, 4, dtype=torch.float16), torch.empty(6, 0, dtype=torch.int8)[1:]]
    before = footprint()
    wrappers = exports(lp.wrap_kv_caches(tensors), hostmem_class)
    assert footprint() == before, "wrapping an empty tensor opened or mapped something"
    try:
        for w in wrappers:
            assert w.memory_nbytes == 0
            store_fields = hostmem_class.store.handle_fields
            assert all(not value for value in w.handle.values()) and set(w.handle) == set(store_fields)
        opened = lmcache_peer.call("open", wire=wire.encode(wrappers))
        assert [(lay["shape"], lay["stride"], lay["dtype"]) for lay in opened["layouts"]] == [
            (list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")) for t in tensors
        ]
        lmcache_peer.call("close", handle=opened["handle"])
    finally:
        for w in wrappers:
            w.close()


def test_views_of_one_allocation_share_one_export(
    hostmem_class: type[HostMemoryIPCWrapper], lmcache_peer: Peer
) -> None:
    """vLLM cuts every layer's KV cache out of one flat buffer: one export for all of them."""
    flat = random_bits((4 * 512,), torch.uint8, seed=30)
    layers = [flat[i * 512 : (i + 1) * 512].view(torch.float16).view(16, 16) for i in range(4)]
    contents = [to_bytes(t) for t in layers]
    wrappers = exports(lp.wrap_kv_caches(layers), hostmem_class)
    try:
        assert len({tuple(sorted(w.handle.items(), key=str)) for w in wrappers}) == 1, (
            "views of one storage were exported as separate memory"
        )
        assert {w.memory_nbytes for w in wrappers} == {flat.untyped_storage().nbytes()}
        assert len({t.untyped_storage().data_ptr() for t in layers}) == 1, "the views stopped sharing memory"
        assert [w.storage_offset for w in wrappers] == [i * 256 for i in range(4)]
        opened = lmcache_peer.call("open", wire=wire.encode(wrappers))
        assert opened["data"] == contents
        lmcache_peer.call("close", handle=opened["handle"])
    finally:
        for w in wrappers:
            w.close()


#: A producer that forks: the child closes its copy of the export, wraps memory of its
#: own and exits normally (its atexit handlers run); the parent then hands its export on.
FORKING_PRODUCER = """
import os, sys
import torch
import lmcache_platform as lp
from lmcache_platform import wire

tensor = torch.arange(4096, dtype=torch.int32)
(exported,) = lp.wrap_kv_caches([tensor])
pid = os.fork()
if pid == 0:
    exported.close()
    own = torch.full((1024,), 7, dtype=torch.int32)
    (mine,) = lp.wrap_kv_caches([own])
    mine.close()
    del own, mine
    tensor.add_(0)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), wire.encode([exported]).hex(), flush=True)
sys.stdin.readline()
"""


def test_a_forked_child_never_releases_its_parents_memory(
    hostmem_class: type[HostMemoryIPCWrapper], lmcache_device: torch.device
) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING_PRODUCER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline().split()
        assert len(line) == 2, f"the producer failed: {proc.communicate(timeout=60)[1]}"
        assert line[0] == "0", "the forked child failed"
        (reopened,) = wire.decode(bytes.fromhex(line[1]))
        assert type(reopened) is hostmem_class
        view = reopened.to_tensor()  # this process is neither the parent nor the child
        assert torch.equal(view, torch.arange(4096, dtype=torch.int32)), "the parent's memory changed"
        del view
        reopened.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def test_a_capacity_error_creates_nothing(hostmem_class: type[HostMemoryIPCWrapper]) -> None:
    store = hostmem_class.store
    before = footprint()
    with pytest.raises(OSError) as info:
        store.check_capacity(ABSURD)
    assert info.value.errno in CAPACITY_ERRNOS, (
        f"check_capacity raised errno {info.value.errno}: {info.value}"
    )
    with pytest.raises(OSError) as info:
        store.create(ABSURD)
    assert info.value.errno in CAPACITY_ERRNOS, f"create raised errno {info.value.errno}: {info.value}"
    assert footprint() == before, "a refused create left an fd or a mapping behind"


@pytest.fixture
def engine_tensor() -> Iterator[torch.Tensor]:
    yield random_bits((64, 32), torch.float32, seed=31)


def test_closing_every_export_keeps_the_engine_tensor_and_a_new_export_works(
    hostmem_class: type[HostMemoryIPCWrapper], lmcache_peer: Peer, engine_tensor: torch.Tensor
) -> None:
    contents = to_bytes(engine_tensor)
    (first,) = lp.wrap_kv_caches([engine_tensor])
    first.close()
    assert to_bytes(engine_tensor) == contents, "closing the export changed the engine's tensor"
    engine_tensor.mul_(2)  # the engine keeps writing to it
    (again,) = lp.wrap_kv_caches([engine_tensor])
    try:
        opened = lmcache_peer.call("open", wire=wire.encode([again]))
        assert opened["data"] == [to_bytes(engine_tensor)]
        lmcache_peer.call("close", handle=opened["handle"])
    finally:
        again.close()


def test_a_large_allocation_is_shared_in_place_or_copied_whole(
    hostmem_class: type[HostMemoryIPCWrapper], lmcache_peer: Peer
) -> None:
    """A KV cache's views, wrapped: the peer reads every byte and its writes reach the engine.

    An ``InPlaceStore`` shares the cache where it lies when glibc gave it pages of its
    own (the views keep their addresses, and the peer's writes reach a view the engine
    cut itself and never wrapped); otherwise the kit copies it whole. Whether it shares
    in place depends on the allocator, so an ``InPlaceStore``'s members are also checked
    directly: the memory behind ``create_in_place``'s fd is the memory its handle names.
    """
    store = hostmem_class.store
    flat = random_bits((BIG,), torch.uint8, seed=32)
    quarter = BIG // 4
    layers = [flat[i * quarter : (i + 1) * quarter].view(-1, 1024) for i in range(4)]
    derived = flat[quarter + 4096 : quarter + 8192]  # inside layer 1; never passed to wrap
    address, contents = layers[1].data_ptr(), [to_bytes(t) for t in layers]
    wrappers = exports(lp.wrap_kv_caches(layers), hostmem_class)
    try:
        in_place = layers[1].data_ptr() == address
        assert not in_place or isinstance(store, InPlaceStore), "copied, yet the views kept their address"
        assert [to_bytes(t) for t in layers] == contents, "wrapping changed the engine's bytes"
        opened = lmcache_peer.call("open", wire=wire.encode(wrappers))
        assert opened["data"] == contents, "the peer does not read what the engine holds"
        written = random_bits(tuple(layers[1].shape), torch.uint8, seed=33)
        lmcache_peer.call("write", handle=opened["handle"], index=1, data=to_bytes(written))
        assert torch.equal(layers[1], written), "the peer's write did not reach the engine's tensor"
        if in_place:
            assert torch.equal(derived, written.view(-1)[4096:8192]), (
                "shared in place, yet a view the engine cut itself does not see the peer's write"
            )
        lmcache_peer.call("close", handle=opened["handle"])
    finally:
        for w in wrappers:
            w.close()
    if isinstance(store, InPlaceStore):
        in_place_memory_is_what_its_handle_names(store, store)


def in_place_memory_is_what_its_handle_names(store: HostMemoryStore, in_place: InPlaceStore) -> None:
    """``create_in_place``'s fd and handle name one memory, and nothing stays open after release."""
    nbytes = 1 << 20
    payload = bytes(random_bits((4096,), torch.uint8, seed=34).numpy())
    before = footprint()
    handle, fd = in_place.create_in_place(nbytes)
    try:
        in_place.reserve(fd, 0, nbytes)
        with mmap.mmap(fd, nbytes) as window:  # the kit copies in through such a window
            window[8192 : 8192 + len(payload)] = payload
        with store.open_existing(dict(handle), nbytes) as mapped:
            assert mapped[8192 : 8192 + len(payload)] == payload, (
                "the memory behind create_in_place's fd is not the memory its handle names"
            )
    finally:
        os.close(fd)
        assert store.release(handle), "release() of memory create_in_place made here did nothing"
    assert footprint() == before, "create_in_place left an fd or a mapping behind"


def test_separate_exports_reopen_side_by_side_or_one_by_one(
    hostmem_class: type[HostMemoryIPCWrapper],
) -> None:
    """An older engine's per-layer allocations, reopened together as a cache context does.

    A ``SideBySideStore`` maps them in one range (one storage), any store maps the same
    bytes, writes go both ways, and once the tensors die every fd and mapping
    ``to_tensors`` made is gone.
    """
    layers = [random_bits((64, 32), torch.float32, seed=40 + i) for i in range(3)]
    wrappers = exports(lp.wrap_kv_caches(layers), hostmem_class)
    try:
        gc.collect()
        before = footprint()
        decoded = wire.decode(wire.encode(wrappers))
        tensors = hostmem_class.to_tensors(decoded)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        together = isinstance(hostmem_class.store, SideBySideStore)
        assert len(storages) == (1 if together else len(layers)), (
            f"{len(storages)} storages for {len(layers)} exports "
            f"({'a' if together else 'not a'} SideBySideStore)"
        )
        assert [to_bytes(t) for t in tensors] == [to_bytes(t) for t in layers]
        layers[0][1, 2] = -1.0
        tensors[2][3, 4] = -2.0
        assert tensors[0][1, 2].item() == -1.0 and layers[2][3, 4].item() == -2.0, (
            "writes do not go both ways"
        )
        del tensors
        for w in decoded:
            w.close()
        del decoded
        gc.collect()
        assert footprint() == before, "reopened exports left an fd or a mapping behind"
    finally:
        for w in wrappers:
            w.close()

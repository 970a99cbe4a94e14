"""File descriptors beside the protocol's frames: descriptors whose memory is named by fds.

A CUDA VMM allocation is shared as a POSIX fd, which must travel with the registration
(``SCM_RIGHTS``); no GPU is needed to test the transport, so a memfd stands in for the
allocation here (the logic is the same: an fd the receiver maps). Everything is real:
sockets, fds, ``/proc/self/fd`` counts, the reference server.
"""

from __future__ import annotations

import gc
import mmap
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch

import lmcache_platform
from lmcache_platform import (
    DescriptorError,
    DeviceIPCWrapper,
    KVFormat,
    LayoutHints,
    WireField,
    WireFormatError,
    wire,
)
from lmcache_platform.protocol import _frames
from lmcache_platform.server import ServerClient, ServerError, cache_namespace
from lmcache_platform.testing import RegistryFixture, fake_backend
from lmcache_platform_cpu import CPUCacheContext
from support.serve import InProcess

DEVICE_UUID = "cpu"


def open_fds(name: str = "") -> int:
    """This process's fds on memfds whose name starts with ``name``: sockets of other tests'
    servers may close meanwhile, so only the memory files these tests pass are counted."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # closed between the listing and the read (the listing's own fd)
            continue
        count += target.startswith(f"/memfd:{name}")
    return count


class FdWrapper(DeviceIPCWrapper):
    """Host memory in a memfd, named by the fd itself (which travels beside the message)."""

    device_type: ClassVar[str] = "cpu"
    wire_tag: ClassVar[str] = "test.fdpass/1"
    wire_fields: ClassVar[dict[str, WireField]] = {
        "memfd": WireField(int, fds=True),
        "size": WireField(int, lo=1, hi=1 << 40),
    }
    #: Engine side: storage address -> (memfd, bytes) of the memory made by :meth:`empty`.
    made: ClassVar[dict[int, tuple[int, int]]] = {}

    def __init__(self, *, memfd: int, size: int, **base: Any) -> None:
        super().__init__(**base)
        self.memfd = memfd
        self.size = size

    @classmethod
    def empty(cls, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in a fresh memfd (the engine's KV memory)."""
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        fd = os.memfd_create("lmcache-test-fdpass", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        flat = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        cls.made[flat.data_ptr()] = (fd, nbytes)
        return flat.view(dtype).view(*shape)

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> FdWrapper:
        fd, nbytes = cls.made[tensor.untyped_storage().data_ptr()]
        return cls.describe(tensor, device_uuid=DEVICE_UUID, memfd=fd, size=nbytes)

    def to_tensor(self) -> torch.Tensor:
        flat = torch.frombuffer(mmap.mmap(self.memfd, self.size), dtype=torch.uint8)
        return flat.view(self.dtype).as_strided(self.shape, self.stride, self.storage_offset)


def fd_of(wrapper: DeviceIPCWrapper) -> int:
    assert isinstance(wrapper, FdWrapper)
    return wrapper.memfd


@pytest.fixture
def fd_backend(lmcache_registry: RegistryFixture) -> Iterator[None]:
    """``cpu`` served by the cpu backend's context, with :class:`FdWrapper` on the wire."""
    plugin = fake_backend(
        "cpu", context_class=CPUCacheContext, wrapper_class=FdWrapper, wire_classes=[FdWrapper]
    )
    lmcache_registry.install("cpu", plugin)
    yield
    for fd, _ in FdWrapper.made.values():
        os.close(fd)
    FdWrapper.made.clear()


# -- frames ------------------------------------------------------------------------------------

SocketPair = tuple[socket.socket, socket.socket]


@pytest.fixture
def sockets() -> Iterator[SocketPair]:
    """Two connected UNIX sockets, closed after the test."""
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def test_a_frame_carries_hundreds_of_fds_that_reach_the_same_memory(sockets: SocketPair) -> None:
    a, b = sockets
    memfds = [os.memfd_create(f"f{i}", os.MFD_CLOEXEC) for i in range(600)]  # > one message's 253
    try:
        for i, fd in enumerate(memfds):
            os.write(fd, i.to_bytes(4, "little"))
        sender = threading.Thread(target=_frames.send_frame, args=(a, b"x" * 1000, memfds))
        sender.start()
        got: list[int] = []
        assert _frames.recv_frame(b, fds=got) == b"x" * 1000
        sender.join()
        assert len(got) == 600 and not set(got) & set(memfds)  # the receiver's own fds
        assert [int.from_bytes(os.pread(fd, 4, 0), "little") for fd in got] == list(range(600))
        assert all(os.get_inheritable(fd) is False for fd in got)  # close-on-exec
        _frames.close_fds(got)
    finally:
        _frames.close_fds(memfds)


def test_a_receiver_that_takes_no_fds_lets_the_kernel_close_them(sockets: SocketPair) -> None:
    a, b = sockets
    fd = os.memfd_create("one", os.MFD_CLOEXEC)
    try:
        before = open_fds()
        _frames.send_frame(a, b"payload", [fd])
        assert _frames.recv_frame(b) == b"payload"
        assert open_fds() == before
    finally:
        os.close(fd)


def test_too_many_fds_for_a_frame_are_refused_before_sending(sockets: SocketPair) -> None:
    a, _ = sockets
    with pytest.raises(WireFormatError, match="exceed the limit"):
        _frames.send_frame(a, b"x", list(range(_frames.MAX_FRAME_FDS + 1)))


# -- the wire format ---------------------------------------------------------------------------


def two_layer_views() -> list[torch.Tensor]:
    whole = FdWrapper.empty((2, 64), torch.float32)
    return [whole[0], whole[1]]


def test_fd_fields_travel_as_indices_and_come_back_as_the_receivers_fds(fd_backend: None) -> None:
    views = two_layer_views()
    wrappers = lmcache_platform.wrap_kv_caches(views)
    with pytest.raises(WireFormatError, match="file descriptor"):
        wire.encode(wrappers)  # bytes alone cannot carry an fd
    data, fds = wire.encode_with_fds(wrappers)
    assert fds == [fd_of(wrappers[0])]  # two views of one export: one record, one fd
    received = [os.dup(fd) for fd in fds]
    before = open_fds()
    decoded = wire.decode(data, fds=received)
    assert [type(w) for w in decoded] == [FdWrapper, FdWrapper]
    assert fd_of(decoded[0]) == fd_of(decoded[1]) == received[0]  # the export's fd, shared
    views[1].fill_(7.0)
    assert torch.equal(decoded[1].to_tensor(), views[1])
    decoded[0].close()
    assert open_fds() == before  # still held by the export's other wrapper
    decoded[1].close()
    assert open_fds() == before - 1  # closed with the last one


@pytest.mark.parametrize(
    ("index", "sent", "match"),
    [
        (1, 1, "index 1 names none of the 1"),
        (-1, 1, "index -1"),
        ("0", 1, "index '0'"),
        (0, 0, "names none of the 0"),
    ],
)
def test_hostile_fd_indices_are_refused_and_every_received_fd_closed(
    fd_backend: None, index: object, sent: int, match: str
) -> None:
    wrappers = lmcache_platform.wrap_kv_caches(two_layer_views())
    data, fds = wire.encode_with_fds(wrappers)
    forged = _replace_fd_index(data, index)
    received = [os.dup(fds[0]) for _ in range(sent)]
    before = open_fds()
    with pytest.raises(WireFormatError, match=match):
        wire.decode(forged, fds=received)
    assert open_fds() == before - sent


def test_fds_nobody_names_are_closed_and_repeats_get_their_own_fd(fd_backend: None) -> None:
    a, b = two_layer_views(), two_layer_views()
    wrappers = lmcache_platform.wrap_kv_caches([a[0], b[0]])
    data, fds = wire.encode_with_fds(wrappers)
    assert len(fds) == 2
    forged = _replace_fd_index(data, 0)  # both records name fd 0; fd 1 is left over
    received = [os.dup(fd) for fd in fds]
    before = open_fds()
    decoded = wire.decode(forged, fds=received)
    assert open_fds() == before  # fd 1 closed, a duplicate of fd 0 made for the second record
    assert fd_of(decoded[0]) != fd_of(decoded[1])
    for w in decoded:
        w.close()
    assert open_fds() == before - 2


def test_a_wire_field_of_fds_is_an_int_or_a_list() -> None:
    with pytest.raises(TypeError, match="fds=True"):
        WireField(str, fds=True)
    assert WireField(list, fds=True, max_len=8).check("W", "fds", [3, 4]) == [3, 4]
    with pytest.raises(DescriptorError):
        WireField(int, fds=True).check("W", "fd", -1)


def _replace_fd_index(data: bytes, index: object) -> bytes:
    """The message with every record's ``memfd`` field set to ``index``."""
    import msgpack

    records = msgpack.unpackb(data[5:], raw=False)
    for record in records:
        record[2]["memfd"] = index
    return data[:5] + msgpack.packb(records, use_bin_type=True)


# -- the server --------------------------------------------------------------------------------

LAYERS, BLOCKS, BLOCK, HEADS, HEAD, CHUNK = 2, 8, 4, 2, 8, 8


@pytest.fixture
def server(fd_backend: None) -> Iterator[InProcess]:
    s = InProcess(max_host_bytes=1 << 24)
    yield s
    s.close()


def engine_layers() -> list[torch.Tensor]:
    whole = FdWrapper.empty((LAYERS, 2, BLOCKS, BLOCK, HEADS, HEAD), torch.float32)
    return [whole[i] for i in range(LAYERS)]


def register(client: ServerClient, wrappers: list[DeviceIPCWrapper]) -> int:
    ns = cache_namespace(model="fd", kv_layout="x", dtype="float32", block_size=BLOCK, chunk_size=CHUNK)
    hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=BLOCK, num_kv_heads=HEADS)
    return client.register(wrappers, namespace=ns, lmcache_tokens_per_chunk=CHUNK, layout_hints=hints).context


def test_a_registration_passes_its_fds_and_the_server_moves_bytes_through_them(server: InProcess) -> None:
    src, dst = engine_layers(), engine_layers()
    for i, t in enumerate(src):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i)
    with server.client() as c:
        a = register(c, lmcache_platform.wrap_kv_caches(src))
        b = register(c, lmcache_platform.wrap_kv_caches(dst))
        assert c.put(a, [(b"k" * 32, [[0, 1]])]).stored == 1
        assert c.get(b, [(b"k" * 32, [[5, 6]])]).retrieved == 1
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, [5, 6]], s[:, [0, 1]])  # moved through the fds the server received
        assert not d[:, [0, 1, 2, 3, 4, 7]].any()


def test_the_server_closes_every_fd_it_received_when_the_context_closes(server: InProcess) -> None:
    wrappers = lmcache_platform.wrap_kv_caches(engine_layers())
    with server.client() as c:
        before = open_fds("lmcache-test-fdpass")
        ctx = register(c, wrappers)
        # the export's fd, received by the server, and the duplicate each layer's mapping keeps
        assert open_fds("lmcache-test-fdpass") == before + 1 + LAYERS
        c.unregister(ctx)
        gc.collect()
        assert open_fds("lmcache-test-fdpass") == before


def test_fds_with_any_other_request_are_refused_and_closed(server: InProcess) -> None:
    from lmcache_platform.protocol import _messages as _protocol

    fd = os.memfd_create("stray", os.MFD_CLOEXEC)
    try:
        with server.client() as c:
            c.ping()
            before = open_fds()
            _frames.send_frame(c._sock, _protocol.encode_request("ping", 9), [fd])
            reply = c.recv_reply()
            assert (reply.ok, reply.error_type) == (False, "WireFormatError")
            assert "only register takes file descriptors" in reply.error_message
            assert open_fds() == before
            assert c.ping().pid == os.getpid()  # still serving
    finally:
        os.close(fd)


def test_fds_from_another_user_are_refused_before_decoding(
    server: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only root could connect as another user to a 0700 socket directory; the server's own
    # uid is what it compares the peer's (SO_PEERCRED) with, so that is what changes here.
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    wrappers = lmcache_platform.wrap_kv_caches(engine_layers())
    with server.client() as c:
        c.ping()
        before = open_fds()
        with pytest.raises(ServerError, match="another user") as info:
            register(c, wrappers)
        assert info.value.remote_type == "DescriptorError"
        assert open_fds() == before
        assert server.counters()["contexts"] == 0

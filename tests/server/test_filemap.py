"""``FileMapIPCWrapper``: a file mapping another process made, shared with the server by its fd.

vLLM's native offloading region is such a file; the server maps the same pages and moves
rows in place. Real /dev/shm files, a real server on a thread, the installed cpu backend.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from lmcache_platform import DescriptorError, KVFormat, LayoutHints
from lmcache_platform.hostmem import FileMapIPCWrapper
from lmcache_platform.server import ServerClient, ServerError, cache_namespace
from support.serve import InProcess

ROWS, ROW = 16, 8192


@pytest.fixture
def region() -> Iterator[tuple[int, torch.Tensor]]:
    """A /dev/shm file of ROWS rows, mapped here (like vLLM's), and its fd; unlinked at once."""
    path = f"/dev/shm/lmcache-test-filemap-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    os.ftruncate(fd, ROWS * ROW)
    rows = torch.frombuffer(mmap.mmap(fd, ROWS * ROW), dtype=torch.uint8).view(ROWS, 1, ROW)
    yield fd, rows
    os.close(fd)


def register(c: ServerClient, wrapper: FileMapIPCWrapper) -> int:
    ns = cache_namespace(model="filemap", kv_layout="rows", dtype="uint8", block_size=1, chunk_size=1)
    hints = LayoutHints(kv_format=KVFormat.MLA, block_size=1, num_kv_heads=1)
    reg = c.register(
        [wrapper], namespace=ns, lmcache_tokens_per_chunk=1, layout_hints=hints, chunk_format="blocks"
    )
    return reg.context


def test_the_server_moves_rows_of_the_file_in_place(region: tuple[int, torch.Tensor]) -> None:
    fd, rows = region
    for i in range(ROWS):
        rows[i].fill_(i + 1)
    server = InProcess(max_host_bytes=1 << 22)
    try:
        with server.client() as c:
            ctx = register(c, FileMapIPCWrapper.over(rows, fd))
            assert c.put(ctx, [(b"k%d" % i, [[i]]) for i in range(4)]).stored == 4
            rows[:4].zero_()
            assert c.get(ctx, [(b"k%d" % i, [[8 + i]]) for i in range(4)]).retrieved == 4
    finally:
        server.close()
    assert [int(rows[i, 0, 0]) for i in range(8, 12)] == [1, 2, 3, 4]
    assert all(bool((rows[i] == rows[i, 0, 0]).all()) for i in range(8, 12))


def test_a_size_that_is_not_the_files_is_refused(region: tuple[int, torch.Tensor]) -> None:
    fd, rows = region
    lying = FileMapIPCWrapper.describe(rows, device_uuid="cpu", map_fd=fd, map_nbytes=2 * ROWS * ROW)
    server = InProcess(max_host_bytes=1 << 22)
    try:
        with server.client() as c, pytest.raises(ServerError, match="the file holds") as info:
            register(c, lying)
        assert info.value.remote_type == "DescriptorError"
    finally:
        server.close()


def test_a_view_past_the_file_and_wrap_without_an_fd_are_refused(region: tuple[int, torch.Tensor]) -> None:
    fd, rows = region
    with pytest.raises(DescriptorError, match="holds only"):
        FileMapIPCWrapper.describe(rows, device_uuid="cpu", map_fd=fd, map_nbytes=ROW)
    with pytest.raises(DescriptorError, match="by its fd"):
        FileMapIPCWrapper.wrap(rows)


def test_a_row_outside_the_file_is_refused_before_anything_moves(region: tuple[int, torch.Tensor]) -> None:
    fd, rows = region
    server = InProcess(max_host_bytes=1 << 22)
    try:
        with server.client() as c:
            ctx = register(c, FileMapIPCWrapper.over(rows, fd))
            with pytest.raises(ServerError, match="out of range"):
                c.put(ctx, [(b"k0", [[0]]), (b"k1", [[ROWS]])])
            assert c.lookup(cache_namespace(model="filemap", kv_layout="rows", dtype="uint8", block_size=1,
                                            chunk_size=1), [b"k0"]) == 0  # fmt: skip
    finally:
        server.close()

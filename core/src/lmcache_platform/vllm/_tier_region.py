"""vLLM's primary region as the tier sees it: its file, its rows, and whose bytes they are.

vLLM's native offloading keeps its primary tier in one file mapping
(``/dev/shm/vllm_offload_<engine>.mmap``, unlinked once every worker mapped it) and hands
a secondary tier only a memoryview of it. The server path needs the file itself, so the
tier finds the descriptor vLLM's scheduler holds open on the mapping under that view
(``/proc/self/maps`` names the file's inode) and shares a duplicate of it; nothing is
copied in the engine's process.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from .._errors import DescriptorError
from ..protocol import cache_namespace

#: Longest content key the server takes (``MAX_KEY_LEN``); vLLM's offload keys fit.
_MAX_KEY = 64


@dataclass(frozen=True)
class Rows:
    """Where the primary rows lie: the file (a duplicate fd, ours to close) and their geometry."""

    fd: int
    file_bytes: int
    #: Offset of row 0 in the file.
    offset: int
    rows: int
    #: Bytes from one row to the next, and the bytes of a row that hold KV.
    stride: int
    row_bytes: int


def view_address(view: memoryview) -> int:
    """The address of a memoryview's first byte (holding no export of it afterwards)."""
    import numpy as np

    array = np.asarray(view)
    try:
        return int(array.__array_interface__["data"][0])
    finally:
        del array


def find_rows(view: memoryview) -> Rows:
    """The file mapped under ``view`` (vLLM's ``(rows, stride)`` primary view), opened anew.

    Raises :class:`DescriptorError` when the view is not a shared file mapping or no
    descriptor of that file is open in this process (then the server path cannot share it).
    """
    shape, strides = view.shape or (), view.strides or ()
    if len(shape) != 2 or strides[1] != 1 or strides[0] < shape[1]:
        raise DescriptorError(f"the primary view must be (rows, bytes) row-major, got {shape} {strides}")
    address = view_address(view)
    start, offset, dev, inode, path = _mapping_at(address)
    fd = _open_same_file(dev, inode, path)
    rows, stride = shape[0], strides[0]
    file_offset = offset + (address - start)
    size = os.fstat(fd).st_size
    if file_offset + (rows - 1) * stride + shape[1] > size:
        os.close(fd)
        raise DescriptorError(f"the primary view runs past the end of {path!r} ({size} bytes)")
    return Rows(fd, size, file_offset, rows, stride, shape[1])


def _mapping_at(address: int) -> tuple[int, int, int, int, str]:
    """``(start, file offset, dev, inode, path)`` of this process's mapping holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                inode = int(parts[4])
                if inode == 0 or "s" not in parts[1]:
                    raise DescriptorError("the primary view is not a shared file mapping")
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                path = parts[5].strip() if len(parts) > 5 else ""
                return lo, int(parts[2], 16), os.makedev(major, minor), inode, path
    raise DescriptorError("the primary view's memory is not mapped in this process")


def _open_same_file(dev: int, inode: int, path: str) -> int:
    """A new read-write fd of the file ``(dev, inode)``: a duplicate of one this process holds."""
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if st.st_ino == inode and st.st_dev == dev:
            try:
                return os.open(f"/proc/self/fd/{name}", os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
    name = path.removesuffix(" (deleted)")
    if name and not path.endswith(" (deleted)"):
        fd = os.open(name, os.O_RDWR | os.O_CLOEXEC)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (dev, inode):
            return fd
        os.close(fd)
    raise DescriptorError(f"no open descriptor of the primary region {path!r} in this process")


def rows_wrapper(rows: Rows) -> Any:
    """The region as one ``uint8`` layer ``[rows, 1, row_bytes]``: a block is a row (an MLA-shaped view)."""
    import torch

    from ..hostmem import FileMapIPCWrapper

    return FileMapIPCWrapper(
        dtype=torch.uint8,
        shape=(rows.rows, 1, rows.row_bytes),
        stride=(rows.stride, rows.row_bytes, 1),
        storage_offset=rows.offset,
        device_uuid="cpu",
        map_fd=rows.fd,
        map_nbytes=rows.file_bytes,
    )


def tier_namespace(config: Any, row_bytes: int, model_id: str | None = None) -> bytes:
    """The namespace of rows interchangeable with this engine's (``config``: vLLM's ``OffloadingConfig``).

    Model, KV dtype, bytes per row, each group's tokens per block and layer names,
    blocks per chunk, tokens per hash, the KV layout, and the parallel layout unless
    vLLM marks the bytes parallelism-agnostic; the prefix-hash algorithm where the
    config carries one.
    """
    par = config.parallel
    layout = "agnostic" if par.is_parallelism_agnostic else (
        f"tp{par.tp_size} pp{par.pp_size} pcp{par.pcp_size} dcp{par.dcp_size} world{par.world_size}"
    )  # fmt: skip
    extra: dict[str, str | int] = {
        "format": "vllm-offload-rows/1",
        "row_bytes": row_bytes,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "parallel": layout,
        "kv_cache_layout": str(getattr(config, "kv_cache_layout", None)),
        "canonical": int(bool(getattr(config, "canonical_layout", False))),
        "replicated": int(bool(getattr(config, "replicated_layout", False))),
    }
    for name in ("hash_algo", "prefix_caching_hash_algo"):
        for holder in (config, config.cache, config.model):
            value = getattr(holder, name, None)
            if value is not None:
                extra["hash_algo"] = str(value)
    groups = ";".join(f"{g.tokens_per_block}:{','.join(g.layer_names)}" for g in config.groups)
    return cache_namespace(
        model=model_id or config.model.name,
        kv_layout=f"vllm offload rows [{groups}]",
        dtype=str(config.model.dtype),
        block_size=max(1, config.groups[0].tokens_per_block if config.groups else 1),
        chunk_size=max(1, config.cache.blocks_per_chunk),
        extra=extra,
    )


def content_key(key: bytes) -> bytes:
    """A vLLM offload key (block hash + group) as the server's content key (hashed if too long)."""
    key = bytes(key)
    if 0 < len(key) <= _MAX_KEY:
        return key
    return b"h" + hashlib.blake2b(key, digest_size=32).digest()

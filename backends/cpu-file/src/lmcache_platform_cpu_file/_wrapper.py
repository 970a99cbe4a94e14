"""``CpuFileIPCWrapper``: CPU tensors shared through files in the operator's directory.

The generic host-memory machinery of :mod:`lmcache_platform.hostmem` (migration of
the engine's own tensor, zero-copy reopening, lifetimes tied to torch's reference
counting, one file per storage) over the store of :mod:`._store`, whose handle is
the file's name.
"""

from __future__ import annotations

from typing import ClassVar

from lmcache_platform.hostmem import HostMemoryIPCWrapper

from ._store import FileStore


class CpuFileIPCWrapper(HostMemoryIPCWrapper):
    """Descriptor of a CPU tensor living in a KV file.

    ``file_name`` is a bare name in ``LMCACHE_PLATFORM_CPU_FILE_DIR`` (empty for an
    empty tensor) and ``file_nbytes`` the storage's exact size.
    """

    wire_tag: ClassVar[str] = "cpu.file/1"
    store = FileStore()
    nbytes_field = "file_nbytes"

    file_name: str
    file_nbytes: int

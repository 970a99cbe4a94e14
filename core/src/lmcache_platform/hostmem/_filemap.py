"""``FileMapIPCWrapper``: a tensor over a file mapping another process made, shared by its fd.

Some engines keep host memory in a file they map themselves (vLLM's native offloading
keeps its primary tier in ``/dev/shm/vllm_offload_<engine>.mmap``, which its workers map
too). That memory must stay where it is: re-homing it in a store's memfd, as
:class:`~lmcache_platform.hostmem.HostMemoryIPCWrapper` does, would cut the engine's
own processes off from it. So the file's descriptor itself travels beside the
registration (``SCM_RIGHTS``) and the consumer maps the same pages.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import TYPE_CHECKING, Any, ClassVar

from .._errors import DescriptorError
from .._ipc_wrapper import MAX_EXTENT, DeviceIPCWrapper, WireField

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

#: ``device_uuid`` of a file mapping: there is one host.
_HOST = "cpu"


class FileMapIPCWrapper(DeviceIPCWrapper):
    """Descriptor of a CPU tensor over a regular file mapped ``MAP_SHARED`` (tmpfs or disk).

    ``map_fd`` is an open read-write descriptor of the file (an index on the wire; the
    receiver's own fd once decoded) and ``map_nbytes`` its exact size, checked against
    the file before mapping. The producer keeps its fd open while the wrapper may be
    sent; the consumer closes the one it received with its last wrapper.
    """

    device_type: ClassVar[str] = "cpu"
    wire_tag: ClassVar[str] = "cpu.filemap/1"
    wire_fields: ClassVar[dict[str, WireField]] = {
        "map_fd": WireField(int, fds=True),
        "map_nbytes": WireField(int, lo=1, hi=MAX_EXTENT),
    }

    def __init__(self, *, map_fd: int, map_nbytes: int, **base: Any) -> None:
        super().__init__(**base)
        if base["device_uuid"] != _HOST:
            raise DescriptorError(
                f"FileMapIPCWrapper: device_uuid must be {_HOST!r}, got {base['device_uuid']!r}"
            )
        if self.nbytes > map_nbytes:
            raise DescriptorError(
                f"FileMapIPCWrapper: the view spans {self.nbytes} bytes but the file holds only {map_nbytes}"
            )
        self.map_fd = map_fd
        self.map_nbytes = map_nbytes

    @classmethod
    def over(cls, tensor: torch.Tensor, fd: int) -> Self:
        """Describe ``tensor``, a view of the mapping of the whole file ``fd`` (from its start)."""
        return cls.describe(tensor, device_uuid=_HOST, map_fd=fd, map_nbytes=os.fstat(fd).st_size)

    @classmethod
    def wrap(cls, tensor: torch.Tensor) -> Self:
        """Refused: only the code that mapped the file knows its fd (use :meth:`over`)."""
        raise DescriptorError(
            "FileMapIPCWrapper describes a file mapping by its fd: use FileMapIPCWrapper.over"
        )

    def to_tensor(self) -> torch.Tensor:
        """Map the file (after checking it is a regular file of the stated size) and view it."""
        import torch

        st = os.fstat(self.map_fd)
        if not stat.S_ISREG(st.st_mode):
            raise DescriptorError("FileMapIPCWrapper: the descriptor is not a regular file")
        if st.st_size != self.map_nbytes:
            raise DescriptorError(
                f"FileMapIPCWrapper: the file holds {st.st_size} bytes, the descriptor says {self.map_nbytes}"
            )
        mm = mmap.mmap(self.map_fd, self.map_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        return flat.view(self.dtype).as_strided(self.shape, self.stride, self.storage_offset)

    def verify(self) -> None:
        """The file must still hold every byte the view spans (a truncated file would fault)."""
        size = os.fstat(self.map_fd).st_size
        if size < self.nbytes:
            raise DescriptorError(
                f"FileMapIPCWrapper: the file shrank to {size} bytes; the view needs {self.nbytes}"
            )

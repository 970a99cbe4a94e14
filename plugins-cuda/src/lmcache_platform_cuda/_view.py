"""Descriptor helpers shared by the CUDA wrapper kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_platform import DescriptorError, DeviceIPCWrapper

if TYPE_CHECKING:
    import torch

#: Upper bound for any byte count or offset in a descriptor: 2**56 (64 PiB).
MAX_BYTES = 1 << 56


def require_cuda(cls: type, tensor: torch.Tensor) -> int:
    """The tensor's device ordinal, or a clear error if it is not a CUDA tensor."""
    if tensor.device.type != "cuda" or tensor.device.index is None:
        raise DescriptorError(f"{cls.__name__} exports CUDA tensors, got one on {tensor.device}")
    return tensor.device.index


def check_view_fits(wrapper: DeviceIPCWrapper, storage_nbytes: int) -> None:
    """Refuse a view that reaches past the bytes its storage has."""
    need = wrapper.nbytes
    if need > storage_nbytes:
        raise DescriptorError(
            f"{type(wrapper).__name__}: the view needs {need} bytes "
            f"(shape {wrapper.shape}, stride {wrapper.stride}, offset {wrapper.storage_offset}) "
            f"but its storage has {storage_nbytes}"
        )


def empty_view(wrapper: DeviceIPCWrapper, ordinal: int) -> torch.Tensor:
    """A tensor with no elements needs no memory: build it locally."""
    import torch

    return torch.empty_strided(
        wrapper.shape, wrapper.stride, dtype=wrapper.dtype, device=torch.device("cuda", ordinal)
    )


def view_over(wrapper: DeviceIPCWrapper, flat: torch.Tensor) -> torch.Tensor:
    """Replay ``wrapper``'s view on ``flat``, the 1-D uint8 bytes its storage starts with.

    How the kinds that map memory themselves (raw, VMM) build their tensors: a whole
    number of elements as ``wrapper.dtype``, then the shape, stride and offset. Works
    for every dtype, bf16 and fp8 included.
    """
    usable = flat.numel() - flat.numel() % wrapper.dtype.itemsize
    return flat[:usable].view(wrapper.dtype).as_strided(wrapper.shape, wrapper.stride, wrapper.storage_offset)

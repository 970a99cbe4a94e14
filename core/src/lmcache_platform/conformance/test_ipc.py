"""Conformance: IPC wrappers alias the engine's memory from another process.

The test process is the engine: it allocates on ``torch.device(device_type)``, wraps
through the facade and sends :func:`lmcache_platform.wire.encode` bytes to a spawned
peer, which decodes with its own allow-list and reopens with ``to_tensor()``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import DescriptorError, wire
from lmcache_platform.conformance._kv import (
    random_bits,
    storage_image,
    synchronize,
    to_bytes,
    view_in,
)
from lmcache_platform.conformance._peer import Peer
from lmcache_platform.conformance._target import Target

#: (dtype, allocated shape, the view the engine wraps)
CASES: dict[str, tuple[torch.dtype, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]] = {
    "float16-contiguous": (torch.float16, (4, 8, 16), lambda t: t),
    "bfloat16-interior-strided": (torch.bfloat16, (6, 8, 16), lambda t: t[1:5, ::2, 3:11]),
    "float32-transposed": (torch.float32, (8, 16), lambda t: t.t()),
    "int8-offset": (torch.int8, (3, 64), lambda t: t[1:]),
    "uint8-layer-of-a-stack": (torch.uint8, (2, 4, 32), lambda t: t[1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_spawned_process_aliases_the_engine_tensor_both_ways(
    case: str, lmcache_backend: Target, lmcache_device: torch.device, lmcache_peer: Peer
) -> None:
    dtype, shape, make_view = CASES[case]
    base = random_bits(shape, dtype, seed=1).to(lmcache_device)
    tensor = make_view(base)
    contents = to_bytes(tensor)

    (wrapper,) = lp.wrap_kv_caches([tensor])
    assert type(wrapper) in lmcache_backend.wire_classes.values(), type(wrapper)
    assert to_bytes(tensor) == contents, "wrap() must keep the tensor's contents"
    assert (wrapper.dtype, wrapper.shape, wrapper.stride, wrapper.storage_offset) == (
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.storage_offset(),
    )
    whole = storage_image(tensor)  # everything the engine's storage holds, neighbours included

    opened = lmcache_peer.call("open", wire=wire.encode([wrapper]))
    handle, (layout,), (seen,) = opened["handle"], opened["layouts"], opened["data"]
    assert layout == {
        "dtype": str(dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "storage_offset": tensor.storage_offset(),
        "device_type": lmcache_device.type,
    }
    assert seen == contents, "to_tensor() in the peer must show the engine's bytes"

    # The peer writes: the engine sees it in its own tensor, and nothing else changed.
    peer_values = random_bits(tuple(tensor.shape), dtype, seed=2)
    lmcache_peer.call("write", handle=handle, index=0, data=to_bytes(peer_values))
    synchronize(lmcache_device)
    assert to_bytes(tensor) == to_bytes(peer_values), "the peer's write is not visible to the engine"
    view_in(whole, tensor).copy_(peer_values)
    assert torch.equal(storage_image(tensor), whole), "the peer's write reached outside the view"

    # The engine writes: the peer sees it.
    engine_values = random_bits(tuple(tensor.shape), dtype, seed=3)
    tensor.copy_(engine_values.to(lmcache_device))
    synchronize(lmcache_device)
    assert lmcache_peer.call("read", handle=handle, index=0) == to_bytes(engine_values)

    assert lmcache_peer.call("close", handle=handle) == [True]  # closed twice there
    wrapper.close()
    wrapper.close()
    assert wrapper.closed


def test_descriptors_round_trip_as_equal_hashable_values(
    lmcache_backend: Target, lmcache_device: torch.device
) -> None:
    tensor = random_bits((4, 16), torch.float16, seed=4).to(lmcache_device)
    (wrapper,) = lp.wrap_kv_caches([tensor])
    try:
        cls = type(wrapper)
        copy = cls.from_fields(wrapper.fields())
        assert copy == wrapper and hash(copy) == hash(wrapper)
        (decoded,) = wire.decode(wire.encode([wrapper]))  # default allow-list: this process's backend
        assert type(decoded) is cls and decoded == wrapper
        for w in (copy, decoded):
            w.close()
            w.close()
    finally:
        wrapper.close()


def test_to_tensor_after_close_is_refused(lmcache_backend: Target, lmcache_device: torch.device) -> None:
    tensor = random_bits((8,), torch.float32, seed=5).to(lmcache_device)
    (wrapper,) = lp.wrap_kv_caches([tensor])
    try:
        copy = type(wrapper).from_fields(wrapper.fields())
        copy.close()
        with pytest.raises(DescriptorError):
            copy.to_tensor()
    finally:
        wrapper.close()

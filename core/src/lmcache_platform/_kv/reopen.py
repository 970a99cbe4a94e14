"""Reopening an engine's IPC wrappers as layer tensors: a cache context's first step.

Kept apart from the context so the one rule a backend relies on is in one place:
each wrapper class gets one ``to_tensors`` call with its wrappers in layer order
(a backend can then place separate exports where the layers stack), and every
wrapper tried is closed again if anything fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import LayoutError

if TYPE_CHECKING:
    import torch

    from .._ipc_wrapper import DeviceIPCWrapper
    from .layout import LayerTensors


def reopen_layers(
    layer_wrappers: Sequence[tuple[DeviceIPCWrapper, ...]], attempted: list[DeviceIPCWrapper]
) -> list[LayerTensors]:
    """Per layer, its tensor or (K, V) pair, from its wrappers (one, or a pair).

    Appends each wrapper to ``attempted`` before its class's ``to_tensors`` runs, so a
    caller whose construction fails closes exactly those (:func:`close_all`).
    """
    if not layer_wrappers:
        raise LayoutError("a cache context needs a non-empty list of KV-cache wrappers")
    for entry in layer_wrappers:
        if len(entry) not in (1, 2):
            raise LayoutError(f"a layer is one wrapper or a (K, V) pair, got {len(entry)} wrappers")
    flat = [w for entry in layer_wrappers for w in entry]
    by_class: dict[type[DeviceIPCWrapper], list[int]] = {}
    for i, wrapper in enumerate(flat):
        by_class.setdefault(type(wrapper), []).append(i)
    tensors: dict[int, torch.Tensor] = {}
    for cls, indices in by_class.items():
        batch = [flat[i] for i in indices]
        attempted += batch
        got = cls.to_tensors(batch)
        if len(got) != len(indices):
            raise LayoutError(
                f"{cls.__name__}.to_tensors returned {len(got)} tensors for {len(indices)} wrappers"
            )
        tensors.update(zip(indices, got, strict=True))
    layers: list[LayerTensors] = []
    at = 0
    for entry in layer_wrappers:
        layers.append(tensors[at] if len(entry) == 1 else (tensors[at], tensors[at + 1]))
        at += len(entry)
    return layers


def one_device(tensors: Sequence[torch.Tensor], device_type: str, owner: str) -> torch.device:
    """The device every reopened tensor lives on, which must be of ``owner``'s ``device_type``."""
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) != 1:
        raise LayoutError(f"KV tensors must live on one device, got {devices}")
    device = tensors[0].device
    if device.type != device_type:
        raise LayoutError(f"{owner} serves {device_type!r} tensors, got tensors on {device}")
    return device


def tensors_of(layer: LayerTensors) -> tuple[torch.Tensor, ...]:
    """A layer's tensors: one, or its K and V."""
    return layer if isinstance(layer, tuple) else (layer,)


def close_all(wrappers: Sequence[DeviceIPCWrapper]) -> None:
    """Close every wrapper even if some fail; re-raise the first failure."""
    first: BaseException | None = None
    for wrapper in wrappers:
        try:
            wrapper.close()
        except Exception as exc:  # keep closing the rest; the first error is re-raised
            if first is None:
                first = exc
    if first is not None:
        raise first

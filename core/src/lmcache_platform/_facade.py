"""The engine-facing facade, with the names of upstream LMCache's discovery-era platform layer.

Code written against that stage ports with import changes only; upstream's 0.5.6 release
renamed its resolvers (``resolve_kv_wrapper_factory``, ``get_device_spec``), see the overview.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union, overload

from ._errors import WrapError
from ._ipc_wrapper import DeviceIPCWrapper
from ._plugins.registry import REGISTRY, TableState, WrapperFactory
from ._types import CacheContextConfig, EngineGroupInfo, EngineType, LayoutHints

if TYPE_CHECKING:
    import torch

    from ._events import DeviceEvent
    from ._kv.context import BaseCacheContext, KVCacheEntry

#: The device type that is always available: every host has CPU memory, and the ``cpu``
#: backend serves it. Engines fall back to it when they know no better (upstream's name).
DEFAULT_BACKEND = "cpu"

# The hot path reads this dict directly; the registry mutates it in place, never rebinds it.
_WRAPPER_FACTORIES: dict[str, WrapperFactory] = REGISTRY.wrappers.entries


def get_kv_wrapper_factory(device_type: str) -> WrapperFactory:
    """Return the callable that wraps a ``device_type`` tensor into an IPC wrapper.

    After the first call for a device type this is a dict lookup.
    """
    try:
        return _WRAPPER_FACTORIES[device_type]
    except KeyError:
        return REGISTRY.wrapper_factory(device_type)


def register_kv_wrapper(device_type: str, factory: WrapperFactory) -> None:
    """Use ``factory`` to wrap ``device_type`` tensors in this process, over any backend."""
    REGISTRY.register_kv_wrapper(device_type, factory)


#: One layer as an engine hands it over: a tensor, or SGLang's (K, V) pair of tensors.
LayerKV = Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]


@overload
def wrap_kv_caches(kv_caches: Mapping[str, torch.Tensor]) -> dict[str, DeviceIPCWrapper]: ...
@overload
def wrap_kv_caches(kv_caches: Mapping[str, LayerKV]) -> dict[str, KVCacheEntry]: ...
@overload
def wrap_kv_caches(kv_caches: Sequence[torch.Tensor]) -> list[DeviceIPCWrapper]: ...
@overload
def wrap_kv_caches(kv_caches: Sequence[LayerKV]) -> list[KVCacheEntry]: ...
def wrap_kv_caches(
    kv_caches: Mapping[str, LayerKV] | Sequence[LayerKV],
) -> dict[str, KVCacheEntry] | list[KVCacheEntry] | dict[str, DeviceIPCWrapper] | list[DeviceIPCWrapper]:
    """Wrap per-layer KV tensors, each with the factory of its device type.

    Takes what engines pass: vLLM's ``dict[layer_name, Tensor]`` (order kept; the
    result is a dict with the same keys, ready for :func:`create_cache_context`, and
    every error names the engine's layer), or a sequence (the result is a list). A
    layer may be a (K, V) pair of tensors (SGLang); it becomes a pair of wrappers.
    Layers that are views of one allocation share one export (the backend's wrapper
    decides how; see the backend-author guide).

    Each tensor is wrapped by the class its backend picks for it
    (:meth:`DeviceIPCWrapper.wrapper_class_for`; one class for most backends). All or
    nothing: each wrapper class first checks its whole batch
    (:meth:`DeviceIPCWrapper.preflight`, e.g. shared-memory capacity); then, if a layer
    fails, the wrappers already made are closed and :class:`WrapError` names the layer
    (index and engine name; the original error is its ``__cause__``).
    """
    names: list[str] | None = None
    if isinstance(kv_caches, Mapping):
        names = [str(k) for k in kv_caches]
        layers = list(kv_caches.values())
    else:
        layers = list(kv_caches)
    flat = [(i, t) for i, one in enumerate(layers) for t in (one if isinstance(one, tuple) else [one])]
    owners: dict[str, type[DeviceIPCWrapper] | None] = {}  # per device type; None: a plain factory
    for _, tensor in flat:
        if tensor.device.type not in owners:
            owners[tensor.device.type] = _owner(get_kv_wrapper_factory(tensor.device.type))
    chosen: list[type[DeviceIPCWrapper] | None] = []  # the class that wraps each tensor
    for index, tensor in flat:
        owner = owners[tensor.device.type]
        try:
            chosen.append(None if owner is None else _chosen_class(owner, tensor))
        except Exception as exc:
            raise _wrap_error(index, names, tensor, exc) from exc
    batches: dict[type[DeviceIPCWrapper], list[torch.Tensor]] = {}
    for (_, tensor), cls in zip(flat, chosen, strict=True):
        if cls is not None:
            batches.setdefault(cls, []).append(tensor)
    for cls, batch in batches.items():
        cls.preflight(batch)
    wrappers: list[DeviceIPCWrapper] = []
    for (index, tensor), cls in zip(flat, chosen, strict=True):
        try:
            wrap = get_kv_wrapper_factory(tensor.device.type) if cls is None else cls.wrap
            wrappers.append(wrap(tensor))
        except Exception as exc:
            for made in reversed(wrappers):
                made.close()
            raise _wrap_error(index, names, tensor, exc) from exc
    entries: list[KVCacheEntry] = []
    made_iter = iter(wrappers)
    for layer in layers:
        entries.append((next(made_iter), next(made_iter)) if isinstance(layer, tuple) else next(made_iter))
    return dict(zip(names, entries, strict=True)) if names is not None else entries


def _owner(factory: WrapperFactory) -> type[DeviceIPCWrapper] | None:
    """The wrapper class whose ``wrap`` ``factory`` is, or None for another callable
    (one given to :func:`register_kv_wrapper`, which is called as it is)."""
    owner = getattr(factory, "__self__", None)
    return owner if isinstance(owner, type) and issubclass(owner, DeviceIPCWrapper) else None


def _chosen_class(owner: type[DeviceIPCWrapper], tensor: torch.Tensor) -> type[DeviceIPCWrapper]:
    cls: object = owner.wrapper_class_for(tensor)  # a backend's answer: checked
    if not (isinstance(cls, type) and issubclass(cls, DeviceIPCWrapper)):
        where = f"{owner.__qualname__}.wrapper_class_for"
        raise TypeError(f"{where} returned {cls!r}, not a DeviceIPCWrapper class")
    return cls


def _wrap_error(index: int, names: list[str] | None, tensor: torch.Tensor, exc: Exception) -> WrapError:
    name = f" ({names[index]})" if names is not None else ""
    return WrapError(
        f"wrapping KV-cache layer {index}{name} ({tensor.device}, shape {tuple(tensor.shape)}) "
        f"failed: {type(exc).__name__}: {exc}",
        layer=index,
        layer_name=names[index] if names is not None else None,
    )


def _device_type_of(entry: KVCacheEntry) -> str:
    wrapper = entry[0] if isinstance(entry, tuple) else entry
    declared = getattr(type(wrapper), "device_type", "")
    return declared if declared else str(wrapper.to_tensor().device.type)


def create_cache_context(
    kv_caches: Mapping[str, KVCacheEntry] | Sequence[KVCacheEntry],
    lmcache_tokens_per_chunk: int = 256,
    layout_hints: LayoutHints | None = None,
    engine_group_infos: Sequence[EngineGroupInfo] = (),
    engine_type: EngineType = EngineType.VLLM,
    separate_object_groups: bool = True,
    full_sw_kv: bool = False,
    layer_names: Sequence[str] = (),
    chunk_format: str = "tokens",
) -> BaseCacheContext:
    """Build the cache context for one engine's per-layer wrappers (server side).

    ``kv_caches`` is what :func:`wrap_kv_caches` returned: a dict keyed by engine
    layer name (the names become ``layer_names``), or a list. The device type comes
    from the wrappers' classes; every wrapper must share it. The backend's class
    receives ``(kv_caches, config)`` with a frozen :class:`CacheContextConfig`.
    ``chunk_format`` ``"blocks"`` keeps chunks in the engine's own block order (see
    :class:`CacheContextConfig`).
    """
    if isinstance(kv_caches, Mapping):
        if layer_names:
            raise ValueError("pass layer names as the dict's keys or as layer_names, not both")
        layer_names = [str(k) for k in kv_caches]
        kv_caches = list(kv_caches.values())
    kv_caches = list(kv_caches)
    if not kv_caches:
        raise ValueError("create_cache_context needs a non-empty list of KV-cache wrappers")
    # One wrapper per class decides (a model has 32+ layers but one or two wrapper classes).
    device_types = sorted({_device_type_of(w) for w in {type(w): w for w in kv_caches}.values()})
    if len(device_types) != 1:
        raise ValueError(f"all KV-cache wrappers must share one device type, got {device_types}")
    cls = REGISTRY.cache_context_class(device_types[0])
    config = CacheContextConfig(
        lmcache_tokens_per_chunk=lmcache_tokens_per_chunk,
        layout_hints=layout_hints,
        engine_group_infos=tuple(engine_group_infos),
        engine_type=engine_type,
        separate_object_groups=separate_object_groups,
        full_sw_kv=full_sw_kv,
        layer_names=tuple(layer_names),
        chunk_format=chunk_format,
        device_event_class=REGISTRY.device_event_class(device_types[0]),
    )
    return cls(kv_caches, config)


def device_event_class(device_type: str) -> type[DeviceEvent] | None:
    """The :class:`DeviceEvent` class of the backend serving ``device_type``, or None.

    None means the device's copies complete before they return (the host): there is
    nothing to order, and no event to send.
    """
    return REGISTRY.device_event_class(device_type)


def record_event(device: torch.device | str) -> bytes | None:
    """Engine side: record an event on ``device``'s current stream; return its handle.

    Call it after the kernels a transfer depends on (a put: those that wrote its blocks;
    a get: those that last read the blocks it will overwrite) and send the handle with
    the request (``event=`` of ``ServerClient.put``/``get``): the server's copies wait on
    the device for it, and neither process synchronizes the device. Returns None for a
    device with no event class (the host): send nothing then.
    """
    import torch

    dev = torch.device(device)
    cls = REGISTRY.device_event_class(dev.type)
    return None if cls is None else cls.record(dev)


def register_backend(
    plugin: object, name: str, *, distribution: str | None = None, version: str | None = None
) -> None:
    """Register a backend plugin object under ``name`` in this process (validated at once)."""
    REGISTRY.register_backend(plugin, name, distribution=distribution, version=version)


def unregister_backend(name: str) -> None:
    """Remove backend ``name`` from this process (``KeyError`` if there is none).

    Its hooks are unregistered and its device type's selection is forgotten, so the
    next lookup selects again among the backends left. One read from installed
    metadata comes back with :func:`refresh`.
    """
    REGISTRY.unregister_backend(name)


def refresh() -> None:
    """Re-read installed metadata on next use (after installing a backend at run time)."""
    REGISTRY.refresh()


# -- test helpers with the upstream semantics ------------------------------------------


def snapshot_backends() -> TableState:
    """Snapshot of the cache-context table (device type -> class) and its discovered flag."""
    return REGISTRY.contexts.snapshot()


def restore_backends(state: TableState | Mapping[str, Any]) -> None:
    """Restore a :func:`snapshot_backends` state, or install a plain ``{type: class}`` table.

    A plain table counts as discovered, so fakes are not overwritten by a later scan;
    a snapshot restores its own flag, so one taken before discovery lets it run again.
    """
    REGISTRY.contexts.restore(state)


def snapshot() -> TableState:
    """Snapshot of the wrapper-factory table (device type -> factory) and its flag."""
    return REGISTRY.wrappers.snapshot()


def restore(state: TableState | Mapping[str, Any]) -> None:
    """Restore a :func:`snapshot` state, or install a plain ``{type: factory}`` table."""
    REGISTRY.wrappers.restore(state)


def reset_for_tests() -> None:
    """Empty the wrapper table and let the next lookup resolve again."""
    REGISTRY.wrappers.restore(TableState({}, False))

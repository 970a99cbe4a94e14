"""The backend under test: found among the installed entry points, then selected by core.

The suite checks a backend exactly as it is installed: the entry point is read from
metadata like any other, and core's own registry loads, validates and selects it
(``LMCACHE_PLATFORM_BACKEND`` names it, so a second backend for the same device
type does not make the choice ambiguous). No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import _env
from .._errors import BackendSelectionError
from .._facade import refresh
from .._plugins import discovery
from .._plugins.engine import Status
from .._plugins.registry import REGISTRY, BackendInfo
from .._types import KVFormat

if TYPE_CHECKING:
    from .._ipc_wrapper import DeviceIPCWrapper
    from .._kv.context import BaseCacheContext


class TargetError(Exception):
    """The backend named for the suite cannot be tested at all (not installed, say)."""


@dataclass
class Target:
    """What the suite knows about the backend it checks."""

    name: str
    device_type: str
    spec: discovery.BackendSpec
    info: BackendInfo
    #: Why the backend cannot serve on this host (its probe's answer), or "" if it can.
    unavailable: str = ""
    context_class: type[BaseCacheContext] | None = None
    wrapper_class: type[DeviceIPCWrapper] | None = None
    wire_classes: dict[str, type[DeviceIPCWrapper]] = field(default_factory=dict)

    @property
    def supported_formats(self) -> tuple[KVFormat, ...]:
        """KV formats the cache context claims (``supported_kv_formats``; default: all)."""
        claimed = getattr(self.context_class, "supported_kv_formats", None)
        return tuple(KVFormat) if claimed is None else tuple(claimed)

    def describe(self) -> str:
        dist = f"{self.info.distribution} {self.info.version}" if self.info.distribution else "manual"
        state = f"unavailable: {self.unavailable}" if self.unavailable else self.info.status.value
        return f"backend {self.name!r} ({dist}) for device type {self.device_type!r}: {state}"


def installed_names() -> list[str]:
    return [spec.name for spec in discovery.scan()]


@contextmanager
def selected(name: str) -> Iterator[Target]:
    """Select backend ``name`` for its device type in this process (and its children).

    Sets ``LMCACHE_PLATFORM_BACKEND`` to ``name`` (spawned processes inherit it),
    refreshes the registry, and restores both afterwards.
    """
    if not discovery.BACKEND_NAME_RE.match(name):
        raise TargetError(f"{name!r} is not a backend name ('<device_type>' or '<device_type>.<variant>')")
    specs = {spec.name: spec for spec in discovery.scan()}
    spec = specs.get(name)
    if spec is None:
        raise TargetError(
            f"no installed distribution advertises backend {name!r} under the entry-point group "
            f"{discovery.ENTRY_POINT_GROUP!r}; installed: {', '.join(sorted(specs)) or 'none'}"
        )
    if name in _env.disabled_backends():
        raise TargetError(f"backend {name!r} is disabled by {_env.DISABLE_ENV}; unset it to test it")
    saved = os.environ.get(_env.BACKEND_ENV)
    os.environ[_env.BACKEND_ENV] = name
    refresh()
    try:
        yield _resolve(spec)
    finally:
        if saved is None:
            os.environ.pop(_env.BACKEND_ENV, None)
        else:
            os.environ[_env.BACKEND_ENV] = saved
        refresh()


def _resolve(spec: discovery.BackendSpec) -> Target:
    device_type = spec.device_type
    unavailable = ""
    try:
        REGISTRY.selected_backend(device_type)
    except BackendSelectionError as exc:
        unavailable = str(exc)
    (info,) = [b for b in REGISTRY.backends() if b.name == spec.name]
    target = Target(name=spec.name, device_type=device_type, spec=spec, info=info)
    if info.status is Status.UNAVAILABLE:
        target.unavailable = info.reason
    elif info.status is Status.OK and not unavailable:
        target.context_class = REGISTRY.cache_context_class(device_type)
        factory = REGISTRY.wrapper_factory(device_type)
        owner = getattr(factory, "__self__", None)
        target.wrapper_class = owner if isinstance(owner, type) else None
        target.wire_classes = dict(REGISTRY.wire_classes_for(device_type))
    elif info.status is not Status.FAILED:
        target.unavailable = unavailable or f"status {info.status.value}"
    return target

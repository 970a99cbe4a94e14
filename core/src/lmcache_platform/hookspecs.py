"""The hook specifications every backend implements: the whole backend contract.

A backend is a module or object holding ``@hookimpl`` functions, advertised under
the entry-point group ``lmcache.platform``; the entry-point name is the backend name
(``<device_type>`` or ``<device_type>.<variant>``). Each hook receives the device
type being resolved, so one backend may serve several types and decline others by
returning ``None``. Hooks run once per device type per process; their results are
cached, so nothing here is on a data path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ._ipc_wrapper import DeviceIPCWrapper
    from ._kv.context import BaseCacheContext
    from ._types import Availability, DoctorFinding

PROJECT_NAME = "lmcache_platform"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for backend hook implementations: ``@hookimpl def lmcache_platform_...``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec(firstresult=True)
def lmcache_platform_api_version() -> int:  # type: ignore[empty-body]
    """Return the backend-API major version this backend was written against.

    Core compares it with :data:`lmcache_platform.API_VERSION` and refuses a backend
    targeting another major, naming both versions. Required.
    """


@hookspec(firstresult=True)
def lmcache_platform_cache_context_class(
    device_type: str,
) -> type[BaseCacheContext] | None:
    """Return the cache-context class serving ``device_type``, or ``None``.

    The class must subclass :class:`BaseCacheContext` and its ``device_type`` must
    equal the argument. Import heavy modules here, not at entry-point import time.
    """


@hookspec(firstresult=True)
def lmcache_platform_ipc_wrapper_class(
    device_type: str,
) -> type[DeviceIPCWrapper] | None:
    """Return the IPC-wrapper class used to export ``device_type`` tensors, or ``None``.

    Its ``wrap`` classmethod becomes the wrapper factory for the device type.
    """


@hookspec(firstresult=True)
def lmcache_platform_wire_classes(
    device_type: str,
) -> Sequence[type[DeviceIPCWrapper]] | None:
    """Return every wrapper class this backend can receive on the wire. Optional.

    Defaults to the class from :func:`lmcache_platform_ipc_wrapper_class`. A backend
    with several wrapper kinds (CUDA: torch IPC and raw IPC) lists them all so the
    decoder's allow-list accepts whichever kind the engine chose.
    """


@hookspec(firstresult=True)
def lmcache_platform_probe(device_type: str) -> Availability | None:
    """Say whether this host can serve ``device_type`` (driver and device present).

    Return :meth:`Availability.yes` or :meth:`Availability.no` with a reason an
    operator can act on. Optional: a backend without a probe counts as available.
    Must be cheap and must not raise; a probe that raises marks the backend failed.
    """


@hookspec
def lmcache_platform_gc(dry_run: bool) -> list[str] | None:
    """Reclaim resources left behind by dead producers; return what was (or would be) removed.

    Called on every loaded backend by ``lmcache-platform gc``. Only resources of the
    current user whose owner process is gone may be touched. With ``dry_run`` nothing
    is deleted. Optional.
    """


@hookspec(firstresult=True)
def lmcache_platform_doctor(device_type: str) -> Sequence[DoctorFinding] | None:
    """Add this backend's own lines to ``lmcache-platform doctor``. Optional.

    Doctor asks only the backend selected for each device type, after it loaded and its
    probe said yes, so the lines describe what actually serves the device type: where
    its memory lives, how much room is left there, a limit about to bite.

    Args:
        device_type: the device type this backend was selected for.

    Returns:
        :class:`~lmcache_platform.DoctorFinding` values, in the order to show them, or
        ``None`` for nothing to add (also the answer for a device type it does not
        serve). An ``error`` finding means the backend cannot serve as the host stands,
        and makes doctor exit 1; a ``warning`` or ``error`` message says what to do.

    Enforcement: doctor shows each finding with the backend's name. A hook that raises,
    or returns anything but a sequence of ``DoctorFinding``, becomes one ``warning``
    naming the backend and the problem; doctor itself never fails because of it. The
    hook must be cheap, must not change anything, and must not import torch unless the
    backend's classes already do.

    Required: no. Since backend API 1 (an optional hook added without a major bump).
    """

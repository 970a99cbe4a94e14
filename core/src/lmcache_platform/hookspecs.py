"""The hook specifications every backend implements: the whole backend contract.

A backend is a module or object holding ``@hookimpl`` functions, advertised under
the entry-point group ``lmcache.platform``; the entry-point name is the backend name
(``<device_type>`` or ``<device_type>.<variant>``). Each hook receives the device
type being resolved, so one backend may serve several types and decline others by
returning ``None``. Hooks run once per device type per process; their results are
cached, so nothing here is on a data path.

How core calls them: pluggy validates each backend at registration (hook names,
argument names), but core then calls *each backend's own implementation* directly,
one backend at a time, and checks that backend's answer; it never calls a hook across
all backends and never merges answers. So ``firstresult=True`` below documents that a
backend gives one answer; it is not what picks a backend (selection does that, see the
operator guide). Hook implementations may take any subset of a spec's arguments.

Each spec below says its arguments, what it returns, what core enforces on the result
(a violation marks the backend *failed*, logged once and reported when its device type
is asked for, while the other backends keep working), whether it is required, and the
backend-API version that introduced it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ._events import DeviceEvent
    from ._ipc_wrapper import DeviceIPCWrapper
    from ._kv.context import BaseCacheContext
    from ._types import Availability, DoctorFinding

__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "lmcache_platform_api_version",
    "lmcache_platform_cache_context_class",
    "lmcache_platform_device_event_class",
    "lmcache_platform_doctor",
    "lmcache_platform_gc",
    "lmcache_platform_ipc_wrapper_class",
    "lmcache_platform_probe",
    "lmcache_platform_wire_classes",
]

PROJECT_NAME = "lmcache_platform"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marker for backend hook implementations: ``@hookimpl def lmcache_platform_...``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec(firstresult=True)
def lmcache_platform_api_version() -> int:  # type: ignore[empty-body]
    """Say which backend-API major version this backend was written against.

    Returns:
        The major as a literal ``int`` written in the backend (``return 1``), never
        ``lmcache_platform.API_VERSION``: returning core's own constant would claim
        compatibility with every future major.

    Enforcement: the answer must equal :data:`lmcache_platform.API_VERSION`; otherwise
    the backend fails with :class:`~lmcache_platform.ApiVersionError` naming both
    versions. Called first; no other hook runs for a backend that fails it.

    Required: yes (a backend without it fails the same way). Since backend API 1.
    """


@hookspec(firstresult=True)
def lmcache_platform_cache_context_class(
    device_type: str,
) -> type[BaseCacheContext] | None:
    """Return the cache-context class that serves ``device_type`` on the server side.

    Args:
        device_type: the device type being resolved (the entry-point name's part
            before any ``.variant``).

    Returns:
        A subclass of :class:`~lmcache_platform.BaseCacheContext`, or ``None`` for a
        device type this backend does not serve. Import torch and the class's module
        here, not at the entry point's import.

    Enforcement: when this hook or :func:`lmcache_platform_ipc_wrapper_class` returns
    a class, both must: a subclass of the right base whose ``device_type`` equals the
    entry-point name's device type. When both return ``None`` the backend is
    *unavailable* ("provides no classes") rather than failed.

    Required: yes. Since backend API 1.
    """


@hookspec(firstresult=True)
def lmcache_platform_ipc_wrapper_class(
    device_type: str,
) -> type[DeviceIPCWrapper] | None:
    """Return the IPC-wrapper class that exports ``device_type`` tensors (engine side).

    Args:
        device_type: the device type being resolved.

    Returns:
        A subclass of :class:`~lmcache_platform.DeviceIPCWrapper`, or ``None`` for a
        device type this backend does not serve. Its ``wrap`` classmethod becomes the
        wrapper factory :func:`lmcache_platform.get_kv_wrapper_factory` returns.

    Enforcement: the class subclasses ``DeviceIPCWrapper``, its ``device_type`` equals
    the entry-point name's device type and its ``wire_tag`` is not empty (the wire
    format names the class by it). See :func:`lmcache_platform_cache_context_class`
    for the case where both return ``None``.

    Required: yes. Since backend API 1.
    """


@hookspec(firstresult=True)
def lmcache_platform_wire_classes(
    device_type: str,
) -> Sequence[type[DeviceIPCWrapper]] | None:
    """Return every wrapper class this backend can receive on the wire.

    A backend with several wrapper kinds (CUDA: torch IPC and raw IPC; CPU: memfd and
    named segments) lists them all, so the decoder's allow-list accepts whichever kind
    the engine's process chose.

    Args:
        device_type: the device type being resolved.

    Returns:
        A sequence of ``DeviceIPCWrapper`` subclasses, or ``None`` for "just the class
        from :func:`lmcache_platform_ipc_wrapper_class`".

    Enforcement: every class passes the same checks as the wrapper class (subclass,
    ``device_type`` equal to the entry-point name's, non-empty ``wire_tag``). The
    decoder accepts only these classes, by tag, for this device type.

    Required: no. Since backend API 1.
    """


@hookspec(firstresult=True)
def lmcache_platform_probe(device_type: str) -> Availability | None:
    """Say whether this host can serve ``device_type`` (driver and device present).

    Args:
        device_type: the device type being resolved.

    Returns:
        :meth:`Availability.yes() <lmcache_platform.Availability.yes>`, or
        :meth:`Availability.no(reason) <lmcache_platform.Availability.no>` with a
        reason an operator can act on ("torch built without CUDA; install a CUDA build
        of torch"); ``None`` counts as yes.

    Enforcement: the answer is an :class:`~lmcache_platform.Availability` or ``None``,
    else the backend fails. A probe that raises marks the backend failed; one that says
    no makes it *unavailable*, with its reason in ``lmcache-platform list`` and in the
    error a lookup of the device type raises. Must be cheap: it runs on first use.

    Required: no (a backend without a probe counts as available). Since backend API 1.
    """


@hookspec
def lmcache_platform_gc(dry_run: bool) -> list[str] | None:
    """Reclaim resources left behind by dead producers (shared-memory segments, files).

    Called on every installed backend (each is loaded first) by ``lmcache-platform gc``,
    and with ``dry_run=True`` by ``lmcache-platform doctor``. Only resources of the
    current user whose owner process is gone may be touched.

    Args:
        dry_run: list what would be removed and remove nothing.

    Returns:
        What was removed (or, with ``dry_run``, would be), one readable name per
        resource (a path, a segment name); ``None`` or ``[]`` for nothing.

    Enforcement: a hook that raises is reported as that backend's failure (``gc``
    exits 1) and does not stop the other backends.

    Required: no. Since backend API 1.
    """


@hookspec(firstresult=True)
def lmcache_platform_doctor(device_type: str) -> Sequence[DoctorFinding] | None:
    """Add this backend's own lines to ``lmcache-platform doctor``.

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


@hookspec(firstresult=True)
def lmcache_platform_device_event_class(device_type: str) -> type[DeviceEvent] | None:
    """Return the class that orders a server's copies after an engine's kernels.

    Engines record an event after the kernels a transfer depends on
    (:func:`lmcache_platform.record_event`) and send its inter-process handle with the
    request; the server's context waits on it on its stream before it touches the
    engine's blocks (:meth:`BaseCacheContext.wait_event
    <lmcache_platform.BaseCacheContext.wait_event>`), so neither side synchronizes the
    whole device. See :class:`~lmcache_platform.DeviceEvent` for the contract.

    Args:
        device_type: the device type being resolved.

    Returns:
        A subclass of :class:`~lmcache_platform.DeviceEvent`, or ``None``: a device
        type this backend does not serve, or one whose copies complete before they
        return (the host), which needs no events.

    Enforcement: the class subclasses ``DeviceEvent`` and its ``device_type`` equals
    the entry-point name's device type, else the backend fails.

    Required: no. Since backend API 1 (an optional hook added without a major bump).
    """

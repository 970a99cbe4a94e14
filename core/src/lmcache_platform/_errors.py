"""Typed errors. Each names its culprit (backend, distribution, entry point, index).

Selection errors also subclass :class:`ValueError` so that code written against
upstream LMCache's discovery-era registry, whose lookups raised ``ValueError``, keeps
working unchanged. (LMCache 0.5.6 raises ``RuntimeError`` for an ambiguous device type.)
"""

from __future__ import annotations

from collections.abc import Sequence


class LMCachePlatformError(Exception):
    """Base class of every error this package raises on purpose."""


class BackendLoadError(LMCachePlatformError, RuntimeError):
    """A backend could not be loaded or failed validation.

    Carries the backend name, its distribution and version, the entry point and the
    formatted traceback of the original failure (also chained as ``__cause__``).
    """

    def __init__(
        self,
        message: str,
        *,
        backend: str,
        distribution: str | None = None,
        version: str | None = None,
        entry_point: str | None = None,
        traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.backend = backend
        self.distribution = distribution
        self.version = version
        self.entry_point = entry_point
        self.traceback = traceback


class ApiVersionError(BackendLoadError):
    """A backend targets a backend-API major version this core does not speak."""


class BackendSelectionError(LMCachePlatformError, ValueError):
    """No single backend could be chosen for a device type."""

    def __init__(self, message: str, *, device_type: str) -> None:
        super().__init__(message)
        self.device_type = device_type


class BackendNotFoundError(BackendSelectionError):
    """No installed or registered backend serves the device type."""


class AmbiguousBackendError(BackendSelectionError):
    """Several usable backends serve the device type and none was chosen explicitly."""

    def __init__(self, message: str, *, device_type: str, candidates: Sequence[str]) -> None:
        super().__init__(message, device_type=device_type)
        self.candidates = tuple(candidates)


class BackendUnavailableError(BackendSelectionError):
    """Backends for the device type exist but none can be used (failed or probe said no).

    ``reasons`` maps each backend name to its probe reason or first failure line;
    ``errors`` holds the underlying :class:`BackendLoadError` objects, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        device_type: str,
        reasons: dict[str, str],
        errors: Sequence[BackendLoadError] = (),
    ) -> None:
        super().__init__(message, device_type=device_type)
        self.reasons = dict(reasons)
        self.errors = tuple(errors)


class EnvironmentValueError(LMCachePlatformError, ValueError):
    """An environment variable holds a value outside its choices (see :func:`env_choice`).

    ``variable`` is its name, ``value`` what it holds, ``choices`` what it may hold.
    """

    def __init__(self, message: str, *, variable: str, value: str, choices: Sequence[str]) -> None:
        super().__init__(message)
        self.variable = variable
        self.value = value
        self.choices = tuple(choices)


class WrapError(LMCachePlatformError, RuntimeError):
    """Wrapping one layer of a batch failed: ``layer`` is its index, ``layer_name`` the
    engine's name for it (None when the layers came as a sequence)."""

    def __init__(self, message: str, *, layer: int, layer_name: str | None = None) -> None:
        super().__init__(message)
        self.layer = layer
        self.layer_name = layer_name


class LayoutError(LMCachePlatformError, ValueError):
    """KV tensors have a layout that cannot be understood (or needs a hint)."""


class TransferError(LMCachePlatformError, ValueError):
    """A store or retrieve request is out of range; nothing was written."""


class DeviceFailedError(LMCachePlatformError, RuntimeError):
    """The device is in an error state no later work leaves (a sticky CUDA error, say).

    Nothing more can move in this process: a server that sees it reports it in ``status``
    and exits non-zero, so its supervisor starts a fresh one.
    """


class DescriptorError(LMCachePlatformError, ValueError):
    """An IPC descriptor is malformed or refers to memory it must not reach."""


class WireFormatError(LMCachePlatformError, ValueError):
    """Bytes on the wire are malformed, unknown, truncated or oversized."""


class ServerError(LMCachePlatformError, RuntimeError):
    """The reference server refused a request or could not start.

    ``remote_type`` is the name of the exception raised in the server
    (``"TransferError"``, ``"WireFormatError"``...), or ``None`` for a local failure.
    """

    def __init__(self, message: str, *, remote_type: str | None = None) -> None:
        super().__init__(message)
        self.remote_type = remote_type


class ServerUnavailable(ServerError):
    """No answer from the reference server in time: it is down, hung, or the deadline passed.

    Raised locally (``remote_type`` is ``None``) by the clients of
    :mod:`lmcache_platform.server`; the request may or may not have reached the server.
    """

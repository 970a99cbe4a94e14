"""Selection: pick the one backend that serves a device type, or explain why not.

Rules, in order: if ``LMCACHE_PLATFORM_BACKEND`` names backends of this device
type, the first of them that is usable wins and an unusable one is an error (an
explicit choice never falls back silently); otherwise a single usable candidate
wins; several are ambiguous; none is "not found" (nothing installed) or
"unavailable" (installed but failed, disabled or declined by its probe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ._config import ENV_BACKEND
from ._errors import (
    AmbiguousBackendError,
    BackendLoadError,
    BackendNotFoundError,
    BackendUnavailableError,
)

#: Wheels that provide the first-party backends, for "not found" hints.
KNOWN_DISTRIBUTIONS = {"cpu": "lmcache-platform-cpu", "cuda": "lmcache-platform-cuda"}


class Candidate(Protocol):
    """What selection needs to know about a backend."""

    @property
    def name(self) -> str: ...
    @property
    def usable(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def error(self) -> BackendLoadError | None: ...


def belongs_to(backend_name: str, device_type: str) -> bool:
    return backend_name == device_type or backend_name.startswith(device_type + ".")


def select(
    device_type: str,
    backends: Sequence[Candidate],
    preferred: Sequence[str],
    *,
    what: str,
    installed: Sequence[str] = (),
) -> Candidate:
    """Return the backend to use for ``device_type`` among ``backends`` (all of that type).

    ``what`` names the thing being looked up ("cache-context class", ...) for messages;
    ``installed`` lists every known backend name, for the "not found" message.
    """
    by_name = {b.name: b for b in backends}
    usable = [b for b in backends if b.usable]
    wanted = [n for n in preferred if belongs_to(n, device_type)]
    if wanted:
        for name in wanted:
            if name in by_name and by_name[name].usable:
                return by_name[name]
        reasons = {n: (by_name[n].reason if n in by_name else "not installed") for n in wanted}
        raise BackendUnavailableError(
            f"No {what} registered for device type {device_type!r}: {ENV_BACKEND} selects "
            + "; ".join(f"{n!r} ({r})" for n, r in reasons.items())
            + (f"; usable backends: {', '.join(b.name for b in usable)}" if usable else ""),
            device_type=device_type,
            reasons=reasons,
            errors=[by_name[n].error for n in wanted if n in by_name and by_name[n].error],  # type: ignore[misc]
        )
    if len(usable) == 1:
        return usable[0]
    if len(usable) > 1:
        names = [b.name for b in usable]
        raise AmbiguousBackendError(
            f"Several backends serve device type {device_type!r}: {', '.join(names)}. "
            f"Choose one with {ENV_BACKEND}={names[0]} (comma-separate choices for several "
            "device types) or disable the others with LMCACHE_PLATFORM_DISABLE.",
            device_type=device_type,
            candidates=names,
        )
    if not backends:
        dist = KNOWN_DISTRIBUTIONS.get(device_type)
        hint = (
            f"install it with `pip install {dist}`"
            if dist
            else f"install a backend distribution that provides {device_type!r}"
        )
        listing = ", ".join(installed) if installed else "none"
        raise BackendNotFoundError(
            f"No {what} registered for device type {device_type!r}: {hint}. "
            f"Installed backends: {listing}.",
            device_type=device_type,
        )
    reasons = {b.name: b.reason for b in backends}
    raise BackendUnavailableError(
        f"No {what} registered for device type {device_type!r}: no installed backend is usable: "
        + "; ".join(f"{n}: {r}" for n, r in reasons.items()),
        device_type=device_type,
        reasons=reasons,
        errors=[b.error for b in backends if b.error is not None],
    )

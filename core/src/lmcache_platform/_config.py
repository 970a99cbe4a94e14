"""Environment variables an operator uses to steer backend loading and selection.

They are read when a device type is first resolved (and on :func:`refresh`), not
on every lookup, so the hot path never touches ``os.environ``.
"""

from __future__ import annotations

import os

#: Comma-separated backend names to prefer when several serve one device type.
ENV_BACKEND = "LMCACHE_PLATFORM_BACKEND"
#: Comma-separated backend names to skip before they are imported.
ENV_DISABLE = "LMCACHE_PLATFORM_DISABLE"
#: ``0`` reads no entry points at all: only manual registrations count.
ENV_AUTOLOAD = "LMCACHE_PLATFORM_AUTOLOAD"


def _names(var: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in os.environ.get(var, "").split(",") if n.strip())


def preferred_backends() -> tuple[str, ...]:
    return _names(ENV_BACKEND)


def disabled_backends() -> frozenset[str]:
    return frozenset(_names(ENV_DISABLE))


def autoload_enabled() -> bool:
    value = os.environ.get(ENV_AUTOLOAD, "1").strip().lower()
    return value not in ("0", "false", "no", "off")

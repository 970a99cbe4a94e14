"""The environment: every variable core reads is named here, once, with its reader.

The backend-selection variables are read when a device type is first resolved (and on
:func:`~lmcache_platform.refresh`), never on every lookup, so the hot path does not touch
``os.environ``. Backends read their own variables with :func:`env_choice`, so a bad value
reads the same whichever backend it belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

from ._errors import EnvironmentValueError

#: Comma-separated backend names to prefer when several serve one device type.
BACKEND_ENV = "LMCACHE_PLATFORM_BACKEND"
#: Comma-separated backend names to skip before they are imported.
DISABLE_ENV = "LMCACHE_PLATFORM_DISABLE"
#: ``0`` reads no entry points at all: only manual registrations count.
AUTOLOAD_ENV = "LMCACHE_PLATFORM_AUTOLOAD"
#: The reference server's UNIX socket (``serve`` and the vLLM connector).
SOCKET_ENV = "LMCACHE_PLATFORM_SOCKET"
#: The reference server's cap on host memory for stored chunks (``serve``).
MAX_HOST_BYTES_ENV = "LMCACHE_PLATFORM_MAX_HOST_BYTES"
#: How the reference server prepares that memory, ``eager`` or ``ahead`` (``serve``).
HOST_MEMORY_ENV = "LMCACHE_PLATFORM_HOST_MEMORY"
#: The cuda backend's choice of IPC kind (its own variable): the vLLM connector reads it
#: too, because it decides how vLLM must allocate the KV cache before any tensor exists.
CUDA_IPC_ENV = "LMCACHE_PLATFORM_CUDA_IPC"

_Choice = TypeVar("_Choice", bound=str)


def _names(var: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in os.environ.get(var, "").split(",") if n.strip())


def preferred_backends() -> tuple[str, ...]:
    return _names(BACKEND_ENV)


def disabled_backends() -> frozenset[str]:
    return frozenset(_names(DISABLE_ENV))


def autoload_enabled() -> bool:
    value = os.environ.get(AUTOLOAD_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def env_choice(name: str, choices: Sequence[_Choice], default: _Choice, *, what: str = "") -> _Choice:
    """The value of environment variable ``name``, one of ``choices``; ``default`` when unset or empty.

    Case and surrounding spaces are ignored. Read it when the value is needed (in a hook,
    not at import), so a launcher or test can set the variable late. Any other value
    raises :class:`~lmcache_platform.EnvironmentValueError` naming the variable, the value
    and the choices; ``what`` names the kind of value for that message (``"a CPU IPC
    kind"``), so the operator reads ``LMCACHE_PLATFORM_CPU_IPC='posix' is not a CPU IPC
    kind; use one of: memfd, shm``.
    """
    if default not in choices:
        raise ValueError(f"env_choice({name!r}): the default {default!r} is not one of {list(choices)}")
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    for choice in choices:
        if value == choice.lower():
            return choice
    raise EnvironmentValueError(
        f"{name}={raw!r} is not {what or 'an allowed value'}; use one of: {', '.join(choices)}",
        variable=name,
        value=raw,
        choices=choices,
    )

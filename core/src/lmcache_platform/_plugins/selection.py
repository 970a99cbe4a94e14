"""Selection: pick the one backend that serves a device type, or explain why not.

The rule, in order (the operator guide states it for users):

1. **explicit**: ``LMCACHE_PLATFORM_BACKEND`` names backends of this device type. The
   first of them that is usable wins; if none is, that is an error (an explicit choice
   never falls back silently). The other backends of the type are not even loaded.
2. **primary**: the backend named exactly ``<device_type>`` is usable. It wins over
   every ``<device_type>.<variant>``, so installing a variant never changes what an
   existing deployment uses. Variants are not loaded.
3. **only**: otherwise, a single usable backend wins (a variant when the primary is
   absent, failed, disabled or declined by its probe).

Several usable variants and no usable primary are ambiguous: an error between equals.
None usable is "not found" (nothing installed) or "unavailable" (installed but failed,
disabled or declined). Backends are loaded through ``load`` only when a rule needs
their answer, which is what keeps unselected siblings unimported.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .._env import BACKEND_ENV, DISABLE_ENV
from .._errors import (
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
    @property
    def status(self) -> str:
        """``ok``, ``unavailable``, ``failed``, ``disabled`` or ``not loaded``."""
        ...


class Rule(str, enum.Enum):
    """Which rule chose a backend (``BackendInfo.selected_by``, ``list --json``)."""

    EXPLICIT = "explicit"
    PRIMARY = "primary"
    ONLY = "only"


@dataclass(frozen=True)
class Choice:
    """The chosen backend, the rule that chose it, and one line saying why."""

    backend: Candidate
    rule: Rule
    why: str


def belongs_to(backend_name: str, device_type: str) -> bool:
    return backend_name == device_type or backend_name.startswith(device_type + ".")


def _state(backend: Candidate) -> str:
    """The status as plain text (``Status`` is a ``str`` enum, which formats as its name)."""
    status = backend.status
    return str(status.value) if isinstance(status, enum.Enum) else status


def why_unusable(backend: Candidate) -> str:
    """What is true of a backend that cannot serve: registered, its state, and why, in one line."""
    state = _state(backend)
    reason = (backend.reason or state).splitlines()[0]
    if state == "failed":
        return reason if "failed to load" in reason else f"{backend.name!r} failed to load: {reason}"
    if state == "disabled":
        return f"{backend.name!r} is registered but {reason}"
    return f"{backend.name!r} is registered but {state} here: {reason}"


def _known_unusable(backend: Candidate) -> bool:
    return _state(backend) not in ("ok", "not loaded")


def select(
    device_type: str,
    backends: Sequence[Candidate],
    preferred: Sequence[str],
    *,
    what: str,
    load: Callable[[Candidate], None] = lambda backend: None,
    installed: Sequence[str] = (),
) -> Choice:
    """Choose the backend for ``device_type`` among ``backends`` (all of that type).

    ``load`` makes a backend's ``usable`` and ``reason`` meaningful; it is called only
    for the backends a rule has to look at. ``what`` names the thing being looked up
    ("cache-context class", ...) for messages; ``installed`` lists every known backend
    name, for the "not found" message.
    """
    by_name = {b.name: b for b in backends}
    wanted = [n for n in preferred if belongs_to(n, device_type)]
    if wanted:
        return _explicit(device_type, by_name, wanted, load)
    primary = by_name.get(device_type)
    if primary is not None:
        load(primary)
        if primary.usable:
            return Choice(primary, Rule.PRIMARY, _primary_why(primary, backends))
    for backend in backends:
        load(backend)
    usable = [b for b in backends if b.usable]
    if len(usable) == 1:
        why = "the only usable backend"
        if primary is not None:
            reason = (primary.reason or primary.name + " is unusable").splitlines()[0]
            why += f"; the primary {primary.name} cannot serve: {reason}"
        return Choice(usable[0], Rule.ONLY, why)
    if len(usable) > 1:
        names = [b.name for b in usable]
        raise AmbiguousBackendError(
            f"Several backends serve device type {device_type!r} and none of them is the primary "
            f"backend {device_type!r}: {', '.join(names)}. Choose one with {BACKEND_ENV}={names[0]} "
            "(comma-separate choices for several device types) or disable the others with "
            f"{DISABLE_ENV}.",
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
            f"No {what} registered for device type {device_type!r}: {hint}. Installed backends: {listing}.",
            device_type=device_type,
        )
    reasons = {b.name: b.reason for b in backends}
    raise BackendUnavailableError(
        f"No backend can serve device type {device_type!r} here: "
        + "; ".join(why_unusable(b) for b in backends)
        + ".",
        device_type=device_type,
        reasons=reasons,
        errors=[b.error for b in backends if b.error is not None],
    )


def _primary_why(primary: Candidate, backends: Sequence[Candidate]) -> str:
    """Why the primary serves, and which variants could replace it (never one known to be unusable)."""
    variants = [b for b in backends if b is not primary]
    open_ = [b.name for b in variants if not _known_unusable(b)]
    why = "the primary backend"
    if len(open_) == 1:
        why += f"; to use {open_[0]} instead, set {BACKEND_ENV}={open_[0]}"
    elif open_:
        why += f"; to use one of {', '.join(open_)} instead, set {BACKEND_ENV}=<name>"
    for b in variants:
        if _known_unusable(b):
            state = _state(b)
            why += f"; {b.name} " + ("failed to load" if state == "failed" else f"is {state}")
    return why


def _explicit(
    device_type: str,
    by_name: dict[str, Candidate],
    wanted: Sequence[str],
    load: Callable[[Candidate], None],
) -> Choice:
    """Rule 1: the first usable named backend; the unnamed siblings are never loaded."""
    for name in wanted:
        backend = by_name.get(name)
        if backend is None:
            continue
        load(backend)
        if backend.usable:
            return Choice(backend, Rule.EXPLICIT, f"chosen by {BACKEND_ENV}")
    reasons = {n: (by_name[n].reason if n in by_name else "not installed") for n in wanted}
    states = [why_unusable(by_name[n]) if n in by_name else f"{n!r} is not installed" for n in wanted]
    chosen = " or ".join(repr(n) for n in wanted)
    others = sorted(set(by_name) - set(wanted))
    remedy = (
        f"fix that, or take {chosen} out of {BACKEND_ENV} to let the selection rule choose among "
        f"the other installed backends of this type: {', '.join(others)}"
        if others
        else f"fix that, or install a backend that serves {device_type!r}"
    )
    raise BackendUnavailableError(
        f"{BACKEND_ENV} chooses {chosen} for device type {device_type!r}, but "
        + ("it cannot serve: " if len(wanted) == 1 else "none of them can serve: ")
        + "; ".join(states)
        + f". An explicit choice never falls back: {remedy}.",
        device_type=device_type,
        reasons=reasons,
        errors=[e for n in wanted if n in by_name and (e := by_name[n].error) is not None],
    )

"""Discovery: read the ``lmcache.platform`` entry points from installed metadata.

The same reading serves every entry-point group core loads plugins from: remote stores
(group ``lmcache.remote``, named by URL scheme) pass their own name rule. Nothing is
imported here. Each entry point becomes a :class:`BackendSpec` whose
``load`` callable imports the backend module later, only when its device type is
resolved. The scan is deterministic: duplicates of one distribution (an editable
plus a regular install, a site dir listed twice) collapse to the first one on
``sys.path`` (the copy Python would import), and results are sorted by backend
name, never in filesystem order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib_metadata


def _metadata() -> Any:
    """importlib_metadata, imported on first scan (it costs ~15 ms; most imports never scan).

    The backport is a declared dependency; the stdlib copy serves minimal images.
    """
    try:
        import importlib_metadata as md
    except ImportError:  # pragma: no cover - exercised on hosts without the backport
        import importlib.metadata as md  # type: ignore[no-redef]
    return md


#: The entry-point group backends advertise themselves under.
ENTRY_POINT_GROUP = "lmcache.platform"

#: ``<device_type>`` or ``<device_type>.<variant>``, lowercase.
BACKEND_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}(\.[a-z0-9_]{1,32})?$")
#: What a bad name's problem says, for the group above.
BACKEND_NAME_RULE = "use '<device_type>' or '<device_type>.<variant>' in lowercase letters, digits and '_'"


@dataclass(frozen=True)
class BackendSpec:
    """One advertised backend, as read from metadata (nothing imported yet)."""

    name: str
    distribution: str | None
    version: str | None
    entry_point: str
    load: Callable[[], object]
    #: Set when the metadata itself is wrong (bad name, name clash).
    problem: str | None = None

    @property
    def device_type(self) -> str:
        return device_type_of(self.name)


def device_type_of(backend_name: str) -> str:
    """``"cuda.rocm"`` -> ``"cuda"``."""
    return backend_name.partition(".")[0]


def _normalize(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def scan(
    group: str = ENTRY_POINT_GROUP,
    path: list[str] | None = None,
    *,
    names: re.Pattern[str] = BACKEND_NAME_RE,
    rule: str = BACKEND_NAME_RULE,
) -> list[BackendSpec]:
    """Return every plugin advertised under ``group``, de-duplicated and sorted.

    ``path`` limits the search to those directories (default: ``sys.path``). A
    distribution found twice counts once: the first copy on the path wins, as it
    is the one Python imports. ``names`` is the group's name rule (``rule`` says it
    in words, for the problem of a name that breaks it).
    """
    dists = _metadata().distributions(**({} if path is None else {"path": path}))
    return collect(
        (ep for dist in _unique(dists) for ep in dist.entry_points.select(group=group)),
        names=names,
        rule=rule,
    )


def _unique(dists: Iterable[Any]) -> Iterable[Any]:
    """First copy of each distribution. The name comes from the ``*.dist-info`` folder name
    when importlib_metadata can read it there, so most ``METADATA`` files are never parsed."""
    seen: set[str] = set()
    for dist in dists:
        key = _normalize(getattr(dist, "_normalized_name", None) or dist.metadata["Name"] or "")
        if key not in seen:
            seen.add(key)
            yield dist


def name_problem(name: str, names: re.Pattern[str], rule: str) -> str | None:
    """What is wrong with entry-point name ``name`` under a group's rule, or ``None``."""
    return None if names.match(name) else f"invalid backend name {name!r}: {rule}"


def collect(
    entry_points: Iterable[importlib_metadata.EntryPoint],
    *,
    names: re.Pattern[str] = BACKEND_NAME_RE,
    rule: str = BACKEND_NAME_RULE,
) -> list[BackendSpec]:
    """Turn entry points into specs; flag bad names and genuine name clashes."""
    by_name: dict[str, list[BackendSpec]] = {}
    seen: set[tuple[str, str]] = set()
    for ep in entry_points:
        dist = ep.dist
        dist_name = dist.name if dist is not None else None
        key = (_normalize(dist_name or ""), ep.name)
        if key in seen:  # the same distribution found again further down sys.path
            continue
        seen.add(key)
        spec = BackendSpec(
            name=ep.name,
            distribution=dist_name,
            version=dist.version if dist is not None else None,
            entry_point=f"{ep.name} = {ep.value}",
            load=ep.load,
            problem=name_problem(ep.name, names, rule),
        )
        by_name.setdefault(ep.name, []).append(spec)

    specs: list[BackendSpec] = []
    for name in sorted(by_name):
        group = by_name[name]
        if len(group) == 1:
            specs.append(group[0])
            continue
        dists = ", ".join(sorted(f"{s.distribution} {s.version}" for s in group))
        first = min(group, key=lambda s: _normalize(s.distribution or ""))
        specs.append(
            BackendSpec(
                name=name,
                distribution=first.distribution,
                version=first.version,
                entry_point=first.entry_point,
                load=first.load,
                problem=f"backend name {name!r} is provided by several distributions ({dists}); "
                "uninstall all but one",
            )
        )
    return specs

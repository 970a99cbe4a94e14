"""Records shared by the benchmark sections: repeated samples, ratios, targets, skips.

Every figure is a set of repeated measurements reported as median, min and max;
a speed goal is a :class:`SpeedTarget` with a pass/miss verdict printed next to the
figures, never an assertion. No torch here.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Version of the ``--json`` document; bumped on an incompatible change of its shape.
SCHEMA_VERSION = 1
#: A result whose max exceeds this multiple of its min is flagged as noisy.
NOISY_SPREAD = 2.0


@dataclass(frozen=True)
class Settings:
    """What one ``bench`` run measures: device, size of the run and optional overrides."""

    device: str = "cpu"
    quick: bool = False
    #: Repeats of every measurement, instead of each section's default.
    runs: int | None = None
    #: Hand-off and migration sizes in bytes, instead of the defaults.
    sizes: tuple[int, ...] | None = None
    #: The hand-off and migration KV set: ``"vllm"`` (current vLLM: one allocation, a
    #: strided view per layer) or ``"per-layer"`` (one allocation per layer, older engines).
    layout: str = "vllm"

    def repeats(self, quick: int, full: int) -> int:
        """``runs`` if given, else the section's default for a quick or a full run."""
        return self.runs if self.runs is not None else (quick if self.quick else full)


@dataclass(frozen=True)
class Result:
    """Repeated measurements of one case: ``values`` in ``unit`` (``s``, ``ns``, ``GB/s``).

    ``ratio`` compares the median with the median of ``ratio_of`` (another case of
    the same section and parameters): ``median / baseline``.
    """

    section: str
    case: str
    unit: str
    values: tuple[float, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    ratio: float | None = None
    ratio_of: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"{self.section}/{self.case}: no measurements")

    @property
    def median(self) -> float:
        return float(statistics.median(self.values))

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    @property
    def noisy(self) -> bool:
        """Spread too wide to trust the median alone (a busy machine, usually)."""
        return self.min > 0 and self.max > NOISY_SPREAD * self.min

    def relative_to(self, baseline: Result) -> Result:
        """A copy carrying ``self.median / baseline.median``."""
        ratio = self.median / baseline.median if baseline.median else float("inf")
        return Result(
            self.section,
            self.case,
            self.unit,
            self.values,
            self.params,
            ratio=ratio,
            ratio_of=baseline.case,
            note=self.note,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "case": self.case,
            "params": dict(self.params),
            "unit": self.unit,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "runs": len(self.values),
            "ratio": self.ratio,
            "ratio_of": self.ratio_of,
            "noisy": self.noisy,
            "note": self.note,
        }


@dataclass(frozen=True)
class SpeedTarget:
    """A speed goal: ``value`` compared with ``limit``; ``passed`` is None when not measured."""

    name: str
    goal: str
    value: float | None
    limit: float
    passed: bool | None
    note: str = ""

    @classmethod
    def at_most(cls, name: str, goal: str, value: float | None, limit: float, note: str = "") -> SpeedTarget:
        return cls(name, goal, value, limit, None if value is None else value <= limit, note)

    @classmethod
    def at_least(cls, name: str, goal: str, value: float | None, limit: float, note: str = "") -> SpeedTarget:
        return cls(name, goal, value, limit, None if value is None else value >= limit, note)

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "MISS", None: "n/a"}[self.passed]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "goal": self.goal,
            "value": self.value,
            "limit": self.limit,
            "passed": self.passed,
            "note": self.note,
        }


@dataclass(frozen=True)
class Skip:
    """A case that was not run here, and why (memory, missing backend, device)."""

    section: str
    case: str
    reason: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "case": self.case,
            "params": dict(self.params),
            "reason": self.reason,
        }


@dataclass
class Report:
    """Everything one ``bench`` run measured, in the order it was measured."""

    meta: dict[str, Any] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    targets: list[SpeedTarget] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    #: Sections that raised (the run goes on; the command exits non-zero).
    errors: list[Skip] = field(default_factory=list)

    def find(self, section: str, case: str, **params: Any) -> Result | None:
        for r in self.results:
            if (
                r.section == section
                and r.case == case
                and all(r.params.get(k) == v for k, v in params.items())
            ):
                return r
        return None

    def section(self, name: str) -> list[Result]:
        return [r for r in self.results if r.section == name]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "meta": self.meta,
            "results": [r.to_json() for r in self.results],
            "targets": [t.to_json() for t in self.targets],
            "skipped": [s.to_json() for s in self.skipped],
            "errors": [e.to_json() for e in self.errors],
        }


def ratio_rows(results: Sequence[Result], baseline_case: str, *keys: str) -> list[Result]:
    """Attach to each result its ratio to ``baseline_case`` with equal ``keys`` params."""
    out = []
    for r in results:
        base = next(
            (
                b
                for b in results
                if b.case == baseline_case and all(b.params.get(k) == r.params.get(k) for k in keys)
            ),
            None,
        )
        out.append(r.relative_to(base) if base is not None else r)
    return out


@contextmanager
def figure(path: Path, title: str, *, legend_size: int) -> Iterator[Any]:
    """Axes of a 7x4.5 in Agg figure for the body to draw on; titled, gridded and saved after.

    matplotlib is imported here, only when a plot is asked for.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=legend_size)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)

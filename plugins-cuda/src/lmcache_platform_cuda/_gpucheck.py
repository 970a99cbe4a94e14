"""The summary ``scripts/gpu-check`` writes after each of its steps (and at its end).

``python -m lmcache_platform_cuda._gpucheck OUT ELAPSED BUDGET STAGE STEP=RC ...``: one
block per step, in the script's order, from what the step left in ``OUT``:

* ``STEP.xml``, a pytest junit report: the counts, and every failed case by name (empty:
  pytest did not finish, not a pass);
* ``STEP.report.txt``, a report the step formatted for people (printed whole);
* ``STEP.log``: the lines holding figures (``GB/s``, ``path (``), as GPU tests print them.

``RC`` is the step's exit status, ``pending`` (not reached yet), ``skip`` (no time left),
``off`` (not among ``GPU_CHECK_STEPS``) or ``absent`` (what it checks is not installed on
this host, as its log says: not a failure).
``STAGE`` is ``final`` at the end, else the step that just ran (the summary then says the
run is incomplete, in case it is killed before its end). The exit status is 0 when every
step ran and passed (a pytest step that left no readable report did not), else 1.
A step needs nothing here to be summarized: the script's list of steps is the one place
to add one.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

#: How many figure lines a step's log contributes at most.
MAX_FIGURES = 24
#: What marks a line of a log as a figure worth the summary.
FIGURE_MARKS = ("GB/s", " path (")


@dataclass
class Junit:
    """A pytest junit report's outcome."""

    passed: int = 0
    failed: int = 0
    error: int = 0
    skipped: int = 0
    bad: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.error} error, {self.skipped} skipped"


def read_junit(path: Path) -> Junit | str:
    """The counts of a junit report, or why there are none (missing, empty, unreadable)."""
    if not path.exists() or path.stat().st_size == 0:
        return "no report"
    try:
        # our own pytest's report, written on this machine a moment ago
        cases = list(ET.parse(path).getroot().iter("testcase"))  # noqa: S314
    except ET.ParseError as exc:
        return f"unreadable report ({exc})"
    out = Junit()
    for case in cases:
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        name = "failed" if kind == "failure" else kind
        setattr(out, name, getattr(out, name) + 1)
        if kind in ("failure", "error"):
            out.bad.append(f"{case.get('classname')}::{case.get('name')}")
    return out


def figures(log: Path) -> list[str]:
    """The lines of a step's log that hold figures, in order, at most :data:`MAX_FIGURES`."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.strip() for line in lines if any(m in line for m in FIGURE_MARKS)][:MAX_FIGURES]


def state(rc: str) -> str | None:
    """What a step's status says when it did not run to its end; None when it did."""
    if rc == "off":
        return "not asked (GPU_CHECK_STEPS)"
    if rc == "skip":
        return "skipped: budget"
    if rc == "absent":
        return "skipped: not installed on this host (see its log)"
    if rc == "pending":
        return "not run yet"
    if rc in ("124", "137"):
        return f"timed out (rc={rc}): stopped where it was"
    return None


def step_block(out: Path, name: str, rc: str) -> tuple[list[str], bool]:
    """The summary lines of one step, and whether it passed.

    A pytest step has ``STEP.xml`` (the script creates it empty before the run, pytest
    rewrites it): left empty or unreadable, the step did not pass whatever its status.
    """
    note = state(rc)
    xml = out / f"{name}.xml"
    junit = read_junit(xml) if xml.exists() else None
    if isinstance(junit, Junit):
        passed = rc == "0" and not junit.failed and not junit.error
        head = f"{name}: {junit.line()}" + (f" ({note})" if note else "")
    elif junit is not None:
        passed = False
        head = f"{name}: {note or junit} (rc={rc})"
    else:
        passed = rc in ("0", "off", "absent")
        head = f"{name}: {note or ('passed' if passed else f'FAILED, rc={rc}')}"
    lines = [head]
    if isinstance(junit, Junit):
        lines += [f"  FAILED {b}" for b in junit.bad]
    report = out / f"{name}.report.txt"
    if report.exists():
        lines += ["  " + line for line in report.read_text(errors="replace").splitlines()]
    else:
        lines += ["  " + line for line in figures(out / f"{name}.log")]
    return lines, passed


def summary(
    out: Path, elapsed: int, budget: int, stage: str, steps: list[tuple[str, str]]
) -> tuple[str, int]:
    """The whole summary text and the exit status it stands for."""
    lines = ["", "=" * 78, "gpu-check summary", "=" * 78]
    try:
        lines += (out / "host.txt").read_text().splitlines()[:3]
    except OSError:
        lines.append("host: no report")
    ok = True
    for name, rc in steps:
        block, passed = step_block(out, name, rc)
        lines += block
        ok = ok and passed
    rcs = ", ".join(f"{n} rc={'skipped: budget' if rc == 'skip' else rc}" for n, rc in steps)
    if stage != "final":
        lines.append(
            f"\nresult: INCOMPLETE after the {stage} step, {elapsed} s of {budget} s: if this stays, "
            f"the run was killed before its end ({rcs}); logs in {out}/"
        )
        return "\n".join(lines) + "\n", 1
    lines.append(f"\nresult: {'PASS' if ok else 'FAIL'} ({rcs}) in {elapsed} s of {budget} s; logs in {out}/")
    return "\n".join(lines) + "\n", 0 if ok else 1


def parse_steps(args: list[str]) -> list[tuple[str, str]]:
    """``name=rc`` arguments, in order; a malformed one is an error naming it."""
    out = []
    for arg in args:
        name, sep, rc = arg.partition("=")
        if not sep or not name:
            raise ValueError(f"expected STEP=RC, got {arg!r}")
        out.append((name, rc))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    text, rc = summary(Path(args[0]), int(args[1]), int(args[2]), args[3], parse_steps(args[4:]))
    sys.stdout.write(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""A pytest plugin that writes the conformance run's results as JSON, for ``check``.

``lmcache-platform check`` loads it with ``-p`` and ``--lmcache-report PATH`` and
prints its own summary from the file, so the summary never depends on parsing
pytest's terminal output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .plugin import TARGET_KEY


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lmcache-report", metavar="PATH", default=None, help="write the conformance results as JSON to PATH"
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("lmcache_report")
    if path:
        config.pluginmanager.register(_Collector(Path(path), config), "lmcache-report")


class _Collector:
    def __init__(self, path: Path, config: pytest.Config) -> None:
        self.path = path
        self.config = config
        self.results: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.results.setdefault(
            report.nodeid, {"test": report.nodeid, "outcome": "passed", "detail": "", "duration": 0.0}
        )
        entry["duration"] += report.duration
        if report.skipped:
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            entry["detail"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["detail"] = report.longreprtext.strip()

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        target = self.config.stash.get(TARGET_KEY, None)
        backend = None
        if target is not None:
            backend = {
                "name": target.name,
                "device_type": target.device_type,
                "distribution": target.info.distribution,
                "version": target.info.version,
                "status": target.info.status.value,
                "unavailable": target.unavailable,
            }
        self.path.write_text(
            json.dumps(
                {"backend": backend, "exitstatus": int(exitstatus), "results": list(self.results.values())}
            )
        )

"""The conformance suite's pytest plugin: the ``--lmcache-backend`` option and its fixtures.

Loaded in every pytest run through the ``pytest11`` entry point
``lmcache_platform.conformance`` (cheap: it imports neither torch nor a backend), so
``pytest --pyargs lmcache_platform.conformance --lmcache-backend NAME`` works from any
directory. The fixtures, all session-scoped:

* ``lmcache_backend``: the backend named by the option, selected for its device type;
* ``lmcache_device``: ``torch.device`` of that type, or a skip where it cannot serve;
* ``lmcache_peer``: a spawned process playing the KV-cache server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

    from ._peer import Peer
    from ._target import Target

#: Where the ``lmcache_backend`` fixture leaves the backend under test, for reports.
TARGET_KEY = pytest.StashKey["Target"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lmcache-platform", "lmcache-platform backend conformance")
    group.addoption(
        "--lmcache-backend",
        metavar="NAME",
        default=None,
        help="installed backend (entry-point name, e.g. cpu, cuda, cpu.file) that the "
        "conformance suite checks: pytest --pyargs lmcache_platform.conformance --lmcache-backend NAME",
    )


@pytest.fixture(scope="session")
def lmcache_backend(pytestconfig: pytest.Config) -> Iterator[Target]:
    """The backend named by ``--lmcache-backend``, selected for its device type.

    ``LMCACHE_PLATFORM_BACKEND`` names it for the whole session (spawned processes
    inherit it), so a second installed backend for the device type is no obstacle.
    """
    from ._target import TargetError, selected

    name = pytestconfig.getoption("lmcache_backend")
    problem = (
        ""
        if name
        else (
            "the conformance suite checks one backend: pass --lmcache-backend NAME "
            "(`lmcache-platform list` shows the installed names)"
        )
    )
    target: Target | None = None
    with ExitStack() as stack:
        if name:
            try:
                target = stack.enter_context(selected(name))
            except TargetError as exc:
                problem = str(exc)
        if target is None:  # nothing can be checked: stop the session with one clear message
            pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)
        pytestconfig.stash[TARGET_KEY] = target
        yield target


@pytest.fixture(scope="session")
def lmcache_device(lmcache_backend: Target) -> torch.device:
    """``torch.device(device_type)`` of the backend; skips where the backend cannot serve.

    A backend that failed to load fails instead, with its traceback.
    """
    from .._plugins.engine import Status

    info = lmcache_backend.info
    if info.status is Status.FAILED:
        pytest.fail(f"{lmcache_backend.describe()}\n{info.traceback or ''}", pytrace=False)
    if lmcache_backend.unavailable:
        pytest.skip(f"{lmcache_backend.name} cannot serve on this host: {lmcache_backend.unavailable}")
    import torch

    return torch.device(lmcache_backend.device_type)


@pytest.fixture(scope="session")
def lmcache_peer(lmcache_backend: Target, lmcache_device: torch.device) -> Iterator[Peer]:
    """A spawned process playing the KV-cache server, with the backend selected there too."""
    from ._peer import Peer

    peer = Peer()
    try:
        yield peer
    finally:
        peer.close()

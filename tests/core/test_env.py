"""The environment: core's variables named in one module, and ``env_choice`` for backends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lmcache_platform as lp
from lmcache_platform import EnvironmentValueError, env_choice

CORE = Path(__file__).resolve().parents[2] / "core" / "src" / "lmcache_platform"
VAR = "LMCACHE_TEST_ENV_CHOICE"


@pytest.mark.parametrize(
    ("value", "expected"), [(None, "memfd"), ("", "memfd"), ("  ", "memfd"), ("shm", "shm"), (" SHM ", "shm")]
)
def test_env_choice_reads_a_choice_or_the_default(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    assert env_choice(VAR, ("memfd", "shm"), "memfd") == expected


def test_env_choice_names_the_variable_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv(VAR, "posix")
    with pytest.raises(EnvironmentValueError) as info:
        env_choice(VAR, ("memfd", "shm"), "memfd", what="a CPU IPC kind")
    assert str(info.value) == f"{VAR}='posix' is not a CPU IPC kind; use one of: memfd, shm"
    assert (info.value.variable, info.value.value, info.value.choices) == (VAR, "posix", ("memfd", "shm"))
    assert isinstance(info.value, lp.LMCachePlatformError) and isinstance(info.value, ValueError)
    with pytest.raises(EnvironmentValueError, match=f"^{VAR}='posix' is not an allowed value; use one of"):
        env_choice(VAR, ("memfd", "shm"), "memfd")


def test_env_choice_refuses_a_default_outside_its_choices():
    with pytest.raises(ValueError, match="the default 'tcp' is not one of"):
        env_choice(VAR, ("memfd", "shm"), "tcp")


def test_both_first_party_backends_read_their_ipc_kind_through_it(monkeypatch):
    from lmcache_platform_cpu import _config as cpu_config
    from lmcache_platform_cuda import _config as cuda_config

    for config, bad in ((cpu_config, "posix"), (cuda_config, "cuda-ipc")):
        monkeypatch.setenv(config.IPC_ENV, bad)
        with pytest.raises(EnvironmentValueError) as info:
            config.ipc_kind()
        assert info.value.variable == config.IPC_ENV and info.value.value == bad


def test_every_core_environment_variable_is_defined_in_one_module():
    """A variable's name is assigned once, in ``_env.py``; elsewhere it is imported."""
    assignment = re.compile(r"^\s*\w+\s*[:=][^=\n]*[\"']LMCACHE_", re.M)
    elsewhere = [
        str(path.relative_to(CORE))
        for path in CORE.rglob("*.py")
        if path.name != "_env.py" and assignment.search(path.read_text())
    ]
    assert elsewhere == []
    env = (CORE / "_env.py").read_text()
    for name in ("BACKEND", "DISABLE", "AUTOLOAD", "SOCKET", "MAX_HOST_BYTES"):
        assert f'{name}_ENV = "LMCACHE_PLATFORM_{name}"' in env

"""The public backend query: ``selected_backend`` and ``list_backends``, the data of ``list``."""

from __future__ import annotations

import json

import pytest

import lmcache_platform as lp
from lmcache_platform import Availability, BackendInfo, Status
from lmcache_platform._cli import main
from support.fakes import backend
from support.plugins import module_of


@pytest.fixture
def installed(lmcache_registry):
    lmcache_registry.install("cpu", backend("cpu"), distribution="lmcache-platform-cpu", version="0.1.0")
    lmcache_registry.install("cpu.file", backend("cpu"), distribution="lmcache-platform-cpu-file")
    lmcache_registry.install("cuda", backend("cuda", probe=Availability.no("no CUDA device visible")))
    lmcache_registry.install("xpu.a", backend("xpu"))
    lmcache_registry.install("xpu.b", backend("xpu"))
    return lmcache_registry


def test_they_are_public():
    assert {"selected_backend", "list_backends", "BackendInfo"} <= set(lp.__all__)


def test_selected_backend_says_which_backend_serves_and_why(installed):
    info = lp.selected_backend("cpu")
    assert isinstance(info, BackendInfo)
    assert (info.name, info.distribution, info.version, info.status) == (
        "cpu",
        "lmcache-platform-cpu",
        "0.1.0",
        Status.OK,
    )
    assert info.selected and info.selected_by == "primary"
    assert module_of(lp.get_kv_wrapper_factory("cpu")) == info_module(installed, "cpu")


def info_module(installed, name: str) -> str:
    plugin = dict(installed.registry.plugins())[name]
    return plugin.lmcache_platform_ipc_wrapper_class("cpu").__module__


@pytest.mark.parametrize(
    ("device", "error"),
    [
        ("cuda", lp.BackendUnavailableError),
        ("xpu", lp.AmbiguousBackendError),
        ("npu", lp.BackendNotFoundError),
    ],
)
def test_selected_backend_raises_what_a_lookup_raises(installed, device, error):
    with pytest.raises(error):
        lp.selected_backend(device)
    with pytest.raises(error):
        lp.get_kv_wrapper_factory(device)


def test_list_backends_is_the_data_of_the_list_command(installed, capsys):
    infos = lp.list_backends()
    assert [i.name for i in infos] == ["cpu", "cpu.file", "cuda", "xpu.a", "xpu.b"]
    assert [i.name for i in infos if i.selected] == ["cpu"]
    assert main(["list", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(b["name"], b["status"], b["selected"]) for b in report["backends"]] == [
        (i.name, i.status.value, i.selected) for i in infos
    ]
    cpu = report["device_types"]["cpu"]
    assert (cpu["selected"], cpu["selected_by"], cpu["why"]) == ("cpu", "primary", infos[0].why_selected)
    assert report["device_types"]["xpu"]["ambiguous"]


def test_list_backends_without_loading_imports_nothing(installed):
    infos = lp.list_backends(load=False)
    assert {i.status for i in infos} == {Status.NOT_LOADED}
    assert not any(i.selected for i in infos)
    assert dict(installed.registry.plugins()) == {}


def test_list_shows_the_rule_that_chose(installed, capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "cpu: cpu (the primary backend; to use cpu.file instead, set LMCACHE_PLATFORM_BACKEND=cpu.file)"
        in lines
    )
    installed.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.file,xpu.b")  # read on every selection
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "cpu: cpu.file (chosen by LMCACHE_PLATFORM_BACKEND)" in lines
    assert "xpu: xpu.b (chosen by LMCACHE_PLATFORM_BACKEND)" in lines

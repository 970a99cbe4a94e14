"""The plugin engine on its own: a group configured in a few lines, and one module serving several names.

Plugins are real distributions written into temporary site dirs and found through
installed metadata, as in ``test_discovery.py``.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lmcache_platform as lp
from lmcache_platform import Status
from lmcache_platform._errors import BackendLoadError
from lmcache_platform._plugins.engine import ApiCheck, Engine, Group
from lmcache_platform.testing import make_distribution
from support.plugins import imported

SPECS = """
import pluggy
PROJECT_NAME = "toy"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

@hookspec
def toy_api_version(): ...

@hookspec
def toy_greet(who): ...
"""

TOY = """
import os
with open(os.environ["LMCACHE_TEST_IMPORT_LOG"], "a") as _log:
    _log.write(__name__ + "\\n")
from toy_specs import hookimpl

@hookimpl
def toy_api_version():
    return 3

@hookimpl
def toy_greet(who):
    return "{word}, " + who
"""


def toy_group(logger: logging.Logger) -> Group[str]:
    toy_specs = importlib.import_module("toy_specs")  # written into the site dir by the fixture

    def check(record: Any, call: Any) -> str:  # what the group keeps: the greeting of its key
        answer = call("toy_greet", who=record.key)
        if not isinstance(answer, str):
            raise TypeError(f"toy_greet returned {answer!r}")
        return answer

    return Group(
        entry_points="toy.plugins",
        kind="toy",
        hookspecs=toy_specs,
        hook_prefix="toy_",
        names=re.compile(r"^[a-z]+$"),
        name_rule="lowercase letters",
        api=ApiCheck("toy_api_version", 3, "toy API", BackendLoadError),
        error=BackendLoadError,
        logger=logger,
        check=check,
    )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    monkeypatch.setenv("LMCACHE_TEST_IMPORT_LOG", str(tmp_path / "imports.log"))
    (path / "toy_specs.py").write_text(SPECS)
    yield path
    for name in [m for m in sys.modules if m.startswith("toy")]:
        del sys.modules[name]


def test_a_new_group_is_a_few_lines_of_configuration(
    site: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = {
        "toy_hello.py": TOY.format(word="hello"),
        "toy_bad.py": TOY.format(word="bad").replace("return 3", "return 4"),
        "toy_broken.py": "raise ImportError('no toy SDK here')\n",
    }
    make_distribution(
        site,
        "toys",
        "1.0",
        entry_points={"hello": "toy_hello", "bad": "toy_bad", "broken": "toy_broken"},
        files=files,
        group="toy.plugins",
    )
    log = logging.getLogger("toy.engine")
    engine = Engine(toy_group(log), search_path=[str(site)])
    assert engine.names() == ["bad", "broken", "hello"]
    assert imported(tmp_path / "imports.log") == []  # reading metadata imports nothing

    (hello,) = engine.for_key("hello")
    engine.load(hello)
    assert hello.status is Status.OK and hello.answers == "hello, hello"
    assert engine.call(hello, "toy_greet", who="you", unused=1) == "hello, you"
    assert imported(tmp_path / "imports.log") == ["toy_hello"]  # only the key asked for

    before = engine.snapshot()
    with caplog.at_level(logging.WARNING, logger="toy.engine"):
        for name in ("bad", "broken"):
            record = engine.get(name)
            assert record is not None
            engine.load(record)
            engine.load(record)  # once: no second import, no second warning
            assert record.status is Status.FAILED and record.error is not None
            assert record.error.distribution == "toys" and record.error.traceback
    assert "targets toy API 4, but this lmcache-platform speaks API 3" in engine.get("bad").reason  # type: ignore[union-attr]
    assert "no toy SDK here" in engine.get("broken").reason  # type: ignore[union-attr]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "toy 'bad'" in warned[0] and "toy 'broken'" in warned[1]
    assert [name for name, _ in engine.registered()] == ["hello"]  # the failures rolled back

    engine.restore(before)
    assert [name for name, _ in engine.registered()] == ["hello"]
    assert engine.get("bad").status is Status.NOT_LOADED  # type: ignore[union-attr]


MULTI = """
from lmcache_platform import API_VERSION, hookimpl
from support.fakes import context_class, wrapper_class

CLASSES = {{d: (context_class(d), wrapper_class(d, d + ".multi/1")) for d in ("xpu", "npu")}}
{extra}

@hookimpl
def lmcache_platform_api_version():
    return API_VERSION

@hookimpl
def lmcache_platform_cache_context_class(device_type):
    return CLASSES[device_type][0]

@hookimpl
def lmcache_platform_ipc_wrapper_class(device_type):
    return CLASSES[device_type][1]
"""


@pytest.mark.parametrize("first", ["xpu", "npu"])
def test_one_module_may_serve_several_device_types(lmcache_registry: Any, tmp_path: Path, first: str) -> None:
    """pluggy registers an object once: the second name shares it, and a failure of one
    name leaves the module registered for the other."""
    site = tmp_path / "site"
    broken_npu = "CLASSES['npu'] = CLASSES['xpu']  # the wrong device type for npu"
    make_distribution(
        site,
        "multi-vendor",
        "1.0",
        entry_points={"xpu": "multi_mod", "npu": "multi_mod"},
        files={"multi_mod.py": MULTI.format(extra=broken_npu)},
    )
    lmcache_registry.add_site_dir(site)
    second = {"xpu": "npu", "npu": "xpu"}[first]
    for device in (first, second):
        try:
            lp.get_kv_wrapper_factory(device)
        except lp.BackendUnavailableError:
            assert device == "npu"
    infos = {i.name: i for i in lmcache_registry.registry.backends()}
    assert infos["xpu"].status is Status.OK
    assert infos["npu"].status is Status.FAILED
    assert "device_type is 'xpu', but the entry-point name says 'npu'" in infos["npu"].reason
    assert lp.get_kv_wrapper_factory("xpu").__self__.wire_tag == "xpu.multi/1"  # type: ignore[attr-defined]
    assert [name for name, _ in lmcache_registry.registry.plugins()] == ["xpu"]
    assert lmcache_registry.registry.call("xpu", "lmcache_platform_api_version") == lp.API_VERSION

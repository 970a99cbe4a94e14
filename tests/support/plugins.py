"""Source templates for backend modules installed into temporary site dirs.

Each module appends its name to the file named by ``LMCACHE_TEST_IMPORT_LOG`` when
imported, so tests can prove which backends were (not) imported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

IMPORT_LOG_ENV = "LMCACHE_TEST_IMPORT_LOG"

_HEADER = """
import os
with open(os.environ["LMCACHE_TEST_IMPORT_LOG"], "a") as _log:
    _log.write(__name__ + "\\n")
from lmcache_platform import API_VERSION, Availability, hookimpl
from support.fakes import context_class, wrapper_class
"""

#: The required hooks of a backend module whose classes are named ``Wrapper`` and ``Context``
#: (and that imports ``API_VERSION`` and ``hookimpl``): fake and vendor projects alike.
REQUIRED_HOOKS = """
@hookimpl
def lmcache_platform_api_version():
    return API_VERSION

@hookimpl
def lmcache_platform_cache_context_class(device_type):
    return Context

@hookimpl
def lmcache_platform_ipc_wrapper_class(device_type):
    return Wrapper
"""

GOOD = (
    _HEADER
    + """
DEVICE = {device!r}
Wrapper = wrapper_class(DEVICE, {tag!r})
Context = context_class(DEVICE)
Wrapper.__module__ = Context.__module__ = __name__
"""
    + REQUIRED_HOOKS
    + """
@hookimpl
def lmcache_platform_probe(device_type):
    reason = os.environ.get("FAKE_UNAVAILABLE_" + {module!r}.upper())
    return Availability.no(reason) if reason else Availability.yes()
"""
)

#: Broken variants: name -> source. Each must fail in its own way.
BROKEN = {
    "import_error": _HEADER + "raise ImportError('vendor SDK libfoo.so not found')\n",
    "bad_api": GOOD.replace("return API_VERSION", "return API_VERSION + 1"),
    "no_api": GOOD.replace("@hookimpl\ndef lmcache_platform_api_version():\n    return API_VERSION\n", ""),
    "hook_raises": GOOD.replace("    return Context\n", "    raise RuntimeError('driver crashed')\n"),
    "wrong_type": GOOD.replace("    return Context\n", "    return dict\n"),
    "wrong_device": GOOD.replace("Context = context_class(DEVICE)", "Context = context_class('xpu')"),
    "unknown_arg": GOOD.replace(
        "def lmcache_platform_probe(device_type):", "def lmcache_platform_probe(device_type, bogus):"
    ),
    "unknown_hook": GOOD + "\n@hookimpl\ndef lmcache_platform_frobnicate():\n    return 1\n",
    "probe_raises": GOOD.replace(
        "    reason = os.environ", "    raise OSError('probe exploded')\n    reason = os.environ"
    ),
}


def plugin_source(module: str, device: str, *, variant: str | None = None) -> str:
    template = BROKEN[variant] if variant else GOOD
    return template.format(device=device, tag=f"{module}/1", module=module)


def imported(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def env_with_tests_on_path(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that imports ``support.*`` helpers."""
    env = dict(os.environ)
    tests_dir = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def backend_class(factory: Any) -> Any:
    """The backend class whose wrapper factory this is (a bound classmethod: its ``__self__``)."""
    return factory.__self__


def module_of(factory: Any) -> str:
    """The module of the backend class whose wrapper factory this is."""
    return str(backend_class(factory).__module__)

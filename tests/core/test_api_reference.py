"""The API reference names what autodoc would leave out: imported constants and every hook."""

from __future__ import annotations

from pathlib import Path

import lmcache_platform as lp
from lmcache_platform import hookspecs

API_MD = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()


def test_every_public_constant_is_documented() -> None:
    constants = [n for n in lp.__all__ if n.isupper()]
    assert {"API_VERSION", "ALLOWED_DTYPES", "MAX_EXTENT"} <= set(constants)
    missing = [n for n in constants if f".. autodata:: lmcache_platform.{n}\n" not in API_MD]
    assert not missing, f"docs/api.md documents no autodata for {missing}"


def test_every_hook_spec_is_in_the_reference() -> None:
    hooks = [n for n in dir(hookspecs) if n.startswith("lmcache_platform_")]
    assert "lmcache_platform_doctor" in hooks
    assert not [h for h in hooks if h not in API_MD], "a hook spec is missing from docs/api.md"

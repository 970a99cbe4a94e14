"""Conformance: a variant never breaks its primary backend, and a primary stays the default.

A variant (``<device_type>.<variant>``, like ``cpu.file``) installed next to the primary
backend (``<device_type>``, like ``cpu``) must leave every existing user of the device
type as it was: with nothing selected, the primary still serves, and a wire tag the
variant shares with the primary means the same fields on both sides. Checked in a fresh
process that selects nothing, next to a registered stand-in for whichever of the two
is not installed (a stand-in primary for a variant, a stand-in variant for a primary).
No device needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from lmcache_platform._env import BACKEND_ENV
from lmcache_platform.conformance._target import Target

#: Runs in a fresh process with LMCACHE_PLATFORM_BACKEND unset: argv = device type, backend.
PROBE = """
import json, sys
import lmcache_platform as lp
from lmcache_platform._plugins import registry
from lmcache_platform.testing import fake_backend

dt, target = sys.argv[1], sys.argv[2]
installed = {b.name for b in lp.list_backends(load=False)}
assert target in installed, f"{target!r} is not installed in the probing process"
stand_in = f"{dt}.conformance_stand_in" if target == dt else None if dt in installed else dt
if stand_in:
    class StandInContext(lp.BaseCacheContext):
        device_type = dt

    class StandInWrapper(lp.DeviceIPCWrapper):
        device_type = dt
        wire_tag = "conformance.stand-in/1"

    plugin = fake_backend(dt, context_class=StandInContext, wrapper_class=StandInWrapper)
    lp.register_backend(plugin, stand_in, distribution="conformance-stand-in")
out = {"stand_in": stand_in, "selected": None, "selected_by": None, "error": None,
       "primary_unusable": None, "primary_fields": {}}
try:
    info = lp.selected_backend(dt)
    out.update(selected=info.name, selected_by=info.selected_by)
    for tag, cls in registry.wire_classes_for(dt).items():
        out["primary_fields"][tag] = {n: repr(f) for n, f in cls.wire_fields.items()}
except lp.BackendSelectionError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
primary = {b.name: b for b in lp.list_backends()}[dt]
if primary.status.value != "ok":
    out["primary_unusable"] = primary.reason or primary.status.value
print(json.dumps(out))
"""


def probe(target: Target) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, target.device_type, target.name],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"the probing process failed:\n{proc.stderr}"
    view: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return view


def test_next_to_each_other_the_primary_stays_selected_and_shared_tags_agree(lmcache_backend: Target) -> None:
    name, dt = lmcache_backend.name, lmcache_backend.device_type
    view = probe(lmcache_backend)
    dist = lmcache_backend.info.distribution or ""
    if view["primary_unusable"]:
        assert name == dt or not dist or dist not in view["primary_unusable"], (
            f"installing {name} ({dist}) breaks the primary backend {dt!r}: {view['primary_unusable']}"
        )
        pytest.skip(f"the primary backend {dt!r} cannot serve on this host: {view['primary_unusable']}")
    primary = f"the primary {dt!r}" + (" (a stand-in)" if view["stand_in"] == dt else "")
    variant = name if name != dt else f"a variant (stand-in {view['stand_in']})"
    assert view["error"] is None, (
        f"with {variant} installed and nothing selected, {primary} no longer serves {dt!r}: {view['error']}"
    )
    assert (view["selected"], view["selected_by"]) == (dt, "primary"), (
        f"with {variant} installed and nothing selected, {view['selected']!r} serves {dt!r}, not {primary}"
    )
    # A shared tag is interoperability: the primary's receiver decodes the variant's descriptors.
    theirs: dict[str, dict[str, str]] = view["primary_fields"] if name != dt else {}
    for tag, cls in sorted(lmcache_backend.wire_classes.items()):
        mine = {n: repr(f) for n, f in cls.wire_fields.items()}
        assert tag not in theirs or mine == theirs[tag], (
            f"{name} and the primary {dt!r} both use wire tag {tag!r} with different fields ({mine} "
            f"against {theirs[tag]}): give the variant its own tag, such as {name + '/1'!r}"
        )

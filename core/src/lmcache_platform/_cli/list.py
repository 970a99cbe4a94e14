"""``lmcache-platform list``: what is installed, what loaded, what each device type uses.

The JSON shape (``--json``) is stable; fields are only ever added:

    {"schema": 1, "api_version": 1,
     "backends": [{"name", "device_type", "distribution", "version", "entry_point",
                   "status", "reason", "selected"}],
     "device_types": {"<type>": {"selected": "<backend>" | null, "error": "<message>" | null,
                                 "ambiguous": bool, "selected_by": "explicit" | "primary" | "only" | null,
                                 "why": "<one line>" | null, "explicit": ["<backend>", ...]}}}

``status`` is one of ``ok``, ``failed``, ``disabled``, ``unavailable``, ``not loaded``.
``remote_stores`` (added to schema 1) lists the installed remote stores, by URL scheme:
``[{"scheme", "distribution", "version", "entry_point", "status", "reason"}]``; their
modules are imported only with ``load`` (statuses ``ok``/``failed``), else ``not loaded``.
``explicit`` lists the backends of the type that ``LMCACHE_PLATFORM_BACKEND`` chooses, in
its order (empty when it names none): with ``selected`` null, the choice cannot be served.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .._env import preferred_backends
from .._errors import AmbiguousBackendError
from .._plugins.engine import Status
from .._plugins.registry import REGISTRY
from .._plugins.selection import belongs_to
from .._version import API_VERSION

SCHEMA = 1


def collect(*, load: bool = True) -> dict[str, Any]:
    """Build the report from :func:`lmcache_platform.list_backends`'s data.

    ``load=False`` reads metadata only and imports no backend.
    """
    infos, errors = REGISTRY.survey(load=load)
    preferred = preferred_backends()
    device_types: dict[str, dict[str, Any]] = {}
    for device_type in sorted({i.device_type for i in infos}):
        chosen = next((i for i in infos if i.device_type == device_type and i.selected), None)
        error = errors.get(device_type)
        device_types[device_type] = {
            "selected": chosen.name if chosen else None,
            "error": str(error) if error else None,
            "ambiguous": isinstance(error, AmbiguousBackendError),
            "selected_by": chosen.selected_by if chosen else None,
            "why": chosen.why_selected if chosen else None,
            "explicit": [n for n in preferred if belongs_to(n, device_type)],
        }
    backends = [
        {
            "name": i.name,
            "device_type": i.device_type,
            "distribution": i.distribution,
            "version": i.version,
            "entry_point": i.entry_point,
            "status": i.status.value,
            "reason": i.reason.splitlines()[0] if i.reason else "",
            "selected": i.selected,
        }
        for i in infos
    ]
    from ..remote import list_remote_stores

    stores = [
        {
            "scheme": r.scheme,
            "distribution": r.distribution,
            "version": r.version,
            "entry_point": r.entry_point,
            "status": r.status,
            "reason": r.reason.splitlines()[0] if r.reason else "",
        }
        for r in list_remote_stores(load=load)
    ]
    return {
        "schema": SCHEMA,
        "api_version": API_VERSION,
        "backends": backends,
        "device_types": device_types,
        "remote_stores": stores,
    }


def format_table(report: dict[str, Any]) -> str:
    rows = [("BACKEND", "DEVICE", "DISTRIBUTION", "VERSION", "STATUS", "")]
    for b in report["backends"]:
        rows.append(
            (
                b["name"] + (" *" if b["selected"] else ""),
                b["device_type"],
                b["distribution"] or "(manual)",
                b["version"] or "-",
                b["status"],
                b["reason"],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)).rstrip()
        + (f"  {r[5]}" if r[5] else "")
        for r in rows
    ]
    if not report["backends"]:
        lines.append("(no backends installed: pip install lmcache-platform-cpu)")
    lines.append("")
    for device_type, entry in report["device_types"].items():
        if entry["selected"]:
            choice = f"{entry['selected']} ({entry['why']})" if entry.get("why") else entry["selected"]
        else:
            choice = f"none: {(entry['error'] or 'not resolved').splitlines()[0]}"
        lines.append(f"{device_type}: {choice}")
    lines.append("(* = selected)")
    lines.append("")
    stores = [("REMOTE STORE", "DISTRIBUTION", "VERSION", "STATUS", "")] + [
        (
            f"{r['scheme']}://",
            r["distribution"] or "(manual)",
            r["version"] or "-",
            r["status"],
            r["reason"],
        )
        for r in report.get("remote_stores", [])
    ]
    widths = [max(len(r[i]) for r in stores) for i in range(4)]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)).rstrip()
        + (f"  {r[4]}" if r[4] else "")
        for r in stores
    ]
    if len(stores) == 1:
        lines.append("(no remote stores installed: --remote needs one; see docs/tiers.md)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the stable JSON report")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if any backend failed to load or a device type is ambiguous",
    )
    parser.add_argument(
        "--no-load",
        action="store_true",
        help="read installed metadata only; import no backend (statuses stay 'not loaded')",
    )


def run(args: argparse.Namespace) -> int:
    report = collect(load=not args.no_load)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    if args.check:
        failed = any(b["status"] == Status.FAILED.value for b in report["backends"])
        ambiguous = any(e["ambiguous"] for e in report["device_types"].values())
        return 1 if failed or ambiguous else 0
    return 0

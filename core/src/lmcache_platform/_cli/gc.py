"""``lmcache-platform gc``: ask every backend to reclaim what dead producers left behind."""

from __future__ import annotations

import argparse

from .._plugins.registry import REGISTRY


def reclaim(*, dry_run: bool) -> tuple[dict[str, list[str]], dict[str, BaseException]]:
    """Call every backend's ``lmcache_platform_gc`` hook: (backend -> resources, failures)."""
    REGISTRY.backends(load=True)
    found: dict[str, list[str]] = {}
    failed: dict[str, BaseException] = {}
    for name, result, error in REGISTRY.call_all("lmcache_platform_gc", dry_run=dry_run):
        if error is not None:
            failed[name] = error
        else:
            found[name] = list(result or [])
    return found, failed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yes", action="store_true", help="delete (default: dry run, list only)")


def run(args: argparse.Namespace) -> int:
    found, failed = reclaim(dry_run=not args.yes)
    verb = "removed" if args.yes else "would remove"
    total = 0
    for backend, resources in found.items():
        for resource in resources:
            print(f"{backend}: {verb} {resource}")
        total += len(resources)
    for backend, error in failed.items():
        print(f"{backend}: gc failed: {type(error).__name__}: {error}")
    noun = "stale resource" if total == 1 else "stale resources"
    if args.yes:
        print(f"removed {total} {noun} of dead processes")
    elif total:
        print(
            f"would remove {total} {noun} of dead processes; run `lmcache-platform gc --yes` to remove them"
        )
    else:
        print("no stale resources: nothing to remove")
    return 1 if failed else 0

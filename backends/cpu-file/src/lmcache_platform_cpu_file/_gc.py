"""Reclaiming KV files whose producer died without removing them (SIGKILL, OOM kill).

A file is stale when its name is ours, it is a regular file of this user made in
this pid namespace, and its producer is gone (:func:`lmcache_platform.hostmem.find_stale`
decides; anything uncertain counts as alive). No torch here.
"""

from __future__ import annotations

import os

from lmcache_platform.hostmem import find_stale

from . import _store


def reclaim_stale_files(dry_run: bool = True) -> list[str]:
    """Paths of stale KV files in the configured directory, removed unless ``dry_run``.

    Without a configured directory there is nothing to reclaim.
    """
    if not os.environ.get(_store.ENV_DIR):
        return []
    d = _store.directory()
    stale = find_stale(d.fd, _store.NAMES)
    if not dry_run:
        for name in stale:
            _store.unlink_any(d, name)
    return [os.path.join(d.path, name) for name in stale]

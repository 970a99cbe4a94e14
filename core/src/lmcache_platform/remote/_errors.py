"""The remote-store errors: what a store raises from a call, and what opening one raises.

A store's calls raise only :class:`RemoteError` subclasses (the conformance suite checks
it), so a caller handles a remote failure with one ``except`` and never sees a client
library's own exception types. Every message names the store (its URL without secrets).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import BackendLoadError, LMCachePlatformError


class RemoteError(LMCachePlatformError, RuntimeError):
    """A remote-store call failed; base class of the call errors below."""


class RemoteUnavailable(RemoteError):
    """The store could not be reached, refused the connection or the credentials, or went away."""


class RemoteTimeout(RemoteUnavailable):
    """The call's ``timeout`` passed before the store answered; what it did is unknown."""


class RemotePartialError(RemoteError):
    """Some items of a batch failed (a cluster node is down); the others succeeded.

    ``results`` holds the call's answer with every failed item in its "absent" form
    (``None`` for a get, ``False`` for exists and put); ``failed`` holds their indexes.
    """

    def __init__(self, message: str, *, results: Sequence[Any], failed: Sequence[int]) -> None:
        super().__init__(message)
        self.results = list(results)
        self.failed = tuple(failed)


class RemoteConfigError(LMCachePlatformError, ValueError):
    """A remote URL or option is wrong (unknown scheme, password in the URL, unreadable file)."""


class RemoteStoreNotFoundError(RemoteConfigError):
    """No installed remote store serves the URL's scheme; ``scheme`` and ``installed`` say which."""

    def __init__(self, message: str, *, scheme: str, installed: Sequence[str]) -> None:
        super().__init__(message)
        self.scheme = scheme
        self.installed = tuple(installed)


class RemoteStoreLoadError(BackendLoadError):
    """A remote-store plugin failed to import or validate; names its distribution and entry point.

    ``backend`` holds the URL scheme (the entry-point name).
    """

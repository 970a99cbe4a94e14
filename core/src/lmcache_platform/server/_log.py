"""The server's log lines: one sentence for people, an event name and fields for machines."""

from __future__ import annotations

import logging
from typing import Any

#: The server's logger (``--json-log`` formats its records' ``event`` and ``fields``). Named
#: for the handler's module, not this one: operators' filters and the operator guide know
#: the server's lines by that name, which predates this module.
logger = logging.getLogger("lmcache_platform.server._server")


def log_event(level: int, event: str, message: str, **fields: Any) -> None:
    """One server log line: ``message`` for people, ``event`` and ``fields`` for ``--json-log``."""
    logger.log(level, message, extra={"event": event, "fields": fields})

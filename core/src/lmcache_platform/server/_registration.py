"""Opening a cache context from a ``register`` request, and preparing it off the request path.

The request's wrappers arrive as wire-format bytes and, for host memory, file
descriptors; only the server's own user may send descriptors. A context that cannot
be built leaves nothing open: the wrappers it decoded are closed again.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from .. import wire
from .._errors import DescriptorError, WireFormatError
from ..protocol import _frames
from ._log import log_event

if TYPE_CHECKING:
    from .._kv.context import BaseCacheContext
    from ..protocol._ops import RegisterRequest
    from ._transfers import Entry

logger = logging.getLogger(__name__)


def open_context(req: RegisterRequest, peer: str, uid: int, fds: list[int]) -> BaseCacheContext:
    """The cache context a ``register`` request from ``peer`` (user ``uid``) describes."""
    from .._facade import create_cache_context

    if fds and uid != os.geteuid():
        _frames.close_fds(fds)
        raise DescriptorError(
            f"register from {peer}: {len(fds)} file descriptors from another user (uid {uid}; "
            f"this server runs as uid {os.geteuid()}); run the engine and the server as one user"
        )
    wrappers = wire.decode(req.wrappers, fds=fds)
    if not wrappers:
        raise WireFormatError("register: the wrapper list is empty")
    try:
        return create_cache_context(wrappers, **req.config)
    except BaseException:
        for w in wrappers:
            w.close()
        raise


def prefault(entry: Entry) -> None:
    """Let the context prepare the engine's memory beside the first transfers; log the outcome.

    A host context maps every page now, so no transfer pays a page fault for the
    first touch of a block (``HostMemoryCacheContext.prefault_memory``). The outcome
    goes to ``entry.engine_memory`` (``status`` reports it): until its state is
    ``mapped``, transfers that touch a page first pay that page's fault themselves.
    """
    from ..hostmem import PopulateUnsupported

    ctx_id, ctx = entry.context, entry.ctx
    start = time.monotonic()
    try:
        nbytes = ctx.prefault_memory()
    except PopulateUnsupported as exc:
        logger.debug("context %d: not prefaulted (%s); pages fault in during transfers", ctx_id, exc)
        entry.engine_memory = {"state": "unsupported", "error": str(exc)}
        return
    except Exception as exc:  # an optimization failed: transfers still work, page by page
        entry.engine_memory = {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
        log_event(
            logging.WARNING,
            "prefault",
            f"context {ctx_id}: prefaulting the engine's memory failed ({type(exc).__name__}: {exc}); "
            "its pages fault in during transfers",
            context=ctx_id,
            error=str(exc),
        )
        return
    seconds = time.monotonic() - start
    entry.engine_memory = {
        "state": "stopped" if ctx.closed else "mapped",
        "bytes": nbytes,
        "seconds": round(seconds, 3),
    }
    if nbytes:
        log_event(
            logging.INFO,
            "prefault",
            f"context {ctx_id}: {nbytes / 2**20:.0f} MiB of the engine's memory mapped in {seconds:.2f} s"
            f"{' (stopped early: closed)' if ctx.closed else ''}",
            context=ctx_id,
            bytes=nbytes,
            seconds=round(seconds, 3),
        )

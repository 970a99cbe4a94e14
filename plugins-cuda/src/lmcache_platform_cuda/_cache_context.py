"""``GPUCacheContext``: the base machinery on one CUDA device, on a dedicated stream.

The base already reopens the wrappers, discovers layouts, groups layers, allocates
the staging buffer on :attr:`device` and moves chunks with generic torch ops. What
CUDA adds is ordering: every transfer (block-id upload, gather, scatter) is
enqueued on a stream of its own, so a server overlaps them with its other work and
orders them against an engine's events by entering :meth:`stream_context` and
waiting there. Callers that read a staging slot or hand blocks back to the engine
synchronize first (:meth:`synchronize`, or an event recorded inside the context).
Nothing else is CUDA's: the base's ``close`` synchronizes, then drops every buffer and
view, which hands the memory back to torch's caching allocator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from lmcache_platform import BaseCacheContext

if TYPE_CHECKING:
    import torch


class GPUCacheContext(BaseCacheContext):
    """Cache context for KV caches reopened from CUDA IPC wrappers (either kind)."""

    device_type: ClassVar[str] = "cuda"

    def create_stream(self) -> torch.cuda.Stream:
        """A dedicated stream, ordered after everything construction enqueued.

        Opening a torch IPC share makes the *current* stream wait for the
        producer's event, and the staging and pointer buffers were filled there
        too; the transfer stream waits for all of it once, here.
        """
        import torch

        stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return stream

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        """Run the enclosed CUDA work on this context's device and stream."""
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

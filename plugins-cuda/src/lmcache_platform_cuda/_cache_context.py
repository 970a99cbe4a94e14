"""``GPUCacheContext``: the base machinery on one CUDA device, on a dedicated stream.

The base already reopens the wrappers, discovers layouts, groups layers, allocates
the staging buffer on :attr:`device` and moves chunks with generic torch ops. What
CUDA adds is ordering: every transfer (block-id upload, gather, scatter) is
enqueued on a stream of its own, so a server overlaps them with its other work and
orders them against an engine's events by entering :meth:`stream_context` and
waiting there. Callers that read a staging slot or hand blocks back to the engine
synchronize first (:meth:`synchronize`, or an event recorded inside the context).
``store``/``retrieve`` launch the fused Triton kernels of ``_kernels`` (one launch per
kernel group of a chunk) and fall back to the base's torch ops where those cannot run.
The base's ``close`` synchronizes, then drops every buffer and view, which hands the
memory back to torch's caching allocator.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from lmcache_platform import BaseCacheContext

if TYPE_CHECKING:
    import torch

    from lmcache_platform import ChunkTransfer

    from ._kernels import TritonTransfers


_log = logging.getLogger(__name__)


class GPUCacheContext(BaseCacheContext):
    """Cache context for KV caches reopened from CUDA IPC wrappers (either kind)."""

    device_type: ClassVar[str] = "cuda"
    _kernels: TritonTransfers | None = None

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

    def register_host_memory(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-lock one of the server's chunk mappings for this device (``cudaHostRegister``), once.

        Copies between the device and registered memory run at the link's speed and
        asynchronously; registering a whole mapping once (tens of GB/s) replaces a pinned
        allocation per chunk (about 2 GB/s). A refusal (no more lockable memory) leaves the
        mapping pageable: copies still work, slower, and the log says why.
        """
        import torch

        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(address, nbytes, 0)
        if int(err) != 0:
            _log.warning(
                "cudaHostRegister of %d bytes of chunk memory failed (error %d): copies use pageable memory",
                nbytes,
                int(err),
            )
            return None

        def unregister() -> None:
            cudart.cudaHostUnregister(address)

        return unregister

    def store(self, plan: ChunkTransfer) -> None:
        """Gather ``plan`` with the fused kernels, or the base's torch ops where they cannot run."""
        if not self.transfer_kernels().run(plan, store=True):
            super().store(plan)

    def retrieve(self, plan: ChunkTransfer) -> None:
        """Scatter ``plan`` with the fused kernels, or the base's torch ops where they cannot run."""
        if not self.transfer_kernels().run(plan, store=False):
            super().retrieve(plan)

    def transfer_kernels(self) -> TritonTransfers:
        """The context's fused kernels, made on the first transfer (``reason`` says why not)."""
        if self._kernels is None:
            from ._kernels import TritonTransfers

            self._kernels = TritonTransfers(self)
        return self._kernels

    def release(self) -> None:
        """Drop the kernels' tables and their views of the engine's memory."""
        self._kernels = None
        super().release()

    def report_status(self) -> dict[str, Any]:
        """The base's summary, plus how transfers run (``transfers``: ``triton`` or ``torch``, and why;
        ``None`` until the first transfer decides)."""
        status = super().report_status()
        kernels = self._kernels
        if kernels is None:  # decided on the first transfer
            status["transfers"] = {"path": None, "reason": "no transfer yet"}
        else:
            status["transfers"] = {"path": "triton" if kernels.active else "torch", "reason": kernels.reason}
        return status

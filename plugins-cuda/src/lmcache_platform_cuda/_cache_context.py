"""``GPUCacheContext``: the base machinery on one CUDA device, on a dedicated stream.

The base already reopens the wrappers, discovers layouts, groups layers, allocates
the staging buffer on :attr:`device` and moves chunks with generic torch ops. What
CUDA adds is ordering: every transfer (block-id upload, gather, scatter) is
enqueued on a stream of its own, so a server overlaps them with its other work and
orders them against an engine's events by entering :meth:`stream_context` and
waiting there. The host copies of ``read_chunk`` / ``write_chunk`` run on a second
stream, ordered per staging slot by an event, so in a batch one chunk crosses the
link while the next one is gathered (or the previous one scattered). Callers that
read a staging slot or a ``read_chunk``'s host tensors synchronize first
(:meth:`synchronize`); one that hands blocks back to the engine may instead record an
event inside :meth:`stream_context` (it covers every gather and scatter).
``store``/``retrieve`` launch the fused Triton kernels of ``_kernels`` (one launch per
kernel group of a chunk) and fall back to the base's torch ops where those cannot run.
The kernels are compiled when the context is made (a server's registration), not in its
first transfer, which runs under the transfer lock against the caller's deadline.
The base's ``close`` synchronizes, then drops every buffer and view, which hands the
memory back to torch's caching allocator.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from lmcache_platform import BaseCacheContext

if TYPE_CHECKING:
    import torch

    from lmcache_platform import CacheContextConfig, ChunkTransfer

    from ._kernels import TritonTransfers


_log = logging.getLogger(__name__)


class GPUCacheContext(BaseCacheContext):
    """Cache context for KV caches reopened from CUDA IPC wrappers (either kind)."""

    device_type: ClassVar[str] = "cuda"
    _kernels: TritonTransfers | None = None
    #: The host copies' stream, made on the first copy.
    _copies: torch.cuda.Stream | None = None
    #: One event per staging slot (see :meth:`_slot_free`).
    _slot_events: list[torch.cuda.Event]

    def __init__(self, kv_caches: Sequence[Any], config: CacheContextConfig) -> None:
        super().__init__(kv_caches, config)
        try:
            self.transfer_kernels().warm(self)
        except BaseException:
            self.close()
            raise

    def create_stream(self) -> torch.cuda.Stream:
        """A dedicated stream, ordered after everything construction enqueued.

        Opening a torch IPC share makes the *current* stream wait for the
        producer's event, and the staging and pointer buffers were filled there
        too; the transfer stream waits for all of it once, here.
        """
        import torch

        stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Made here, before any thread can ask for them (the events reach the driver on
        # their first record): a lazily made list could be made twice, losing a record.
        self._slot_events = [torch.cuda.Event() for _ in range(self.max_batch_size)]  # type: ignore[no-untyped-call]
        return stream

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        """Run the enclosed CUDA work on this context's device and stream."""
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def register_host_memory(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-lock one of the server's chunk mappings for the devices (``cuMemHostRegister``), once.

        Copies between the device and registered memory run at the link's speed and
        asynchronously; registering a whole mapping once (tens of GB/s) replaces a pinned
        allocation per chunk (about 2 GB/s). The registration is portable, so contexts
        on other devices use it too. A refusal (no more lockable memory) raises
        ``DescriptorError``: the mapping stays pageable, copies still work, slower, and
        the server logs and counts it.
        """
        from ._driver import driver

        ordinal = self.ordinal
        driver().host_register(address, nbytes, ordinal)

        def unregister() -> None:
            driver().host_unregister(address, ordinal)

        return unregister

    def _sticky_error(self) -> str | None:
        """The driver's name for the device's sticky error, or None (none, or no driver to ask)."""
        from lmcache_platform import DescriptorError

        from ._driver import driver

        if self.device.type != "cuda":
            return None
        try:
            return driver().sticky_error(self.ordinal)
        except DescriptorError:  # no driver to ask: not known to be sticky
            return None

    @property
    def ordinal(self) -> int:
        """The CUDA device index of :attr:`device`."""
        import torch

        index = self.device.index
        return int(torch.cuda.current_device() if index is None else index)

    def store(self, plan: ChunkTransfer) -> None:
        """Gather ``plan`` with the fused kernels, or the base's torch ops where they cannot run.

        A gather into a staging slot first waits (on the device) until the slot's last
        copy to the host is done.
        """
        if plan.staged and self._ordered_slots:
            self.stream.wait_event(self._slot_free(plan.slot))
        with self._sticky():
            if not self.transfer_kernels().run(plan, store=True):
                super().store(plan)
        if plan.staged and self._ordered_slots:  # a copy into the slot waits for the gather
            self._slot_free(plan.slot).record(self.stream)

    def retrieve(self, plan: ChunkTransfer) -> None:
        """Scatter ``plan`` with the fused kernels, or the base's torch ops where they cannot run.

        Marks the staging slot free for its next copy from the host once the scatter ran.
        """
        with self._sticky():
            if not self.transfer_kernels().run(plan, store=False):
                super().retrieve(plan)
        if plan.staged and self._ordered_slots:
            self._slot_free(plan.slot).record(self.stream)

    # -- host copies on a stream of their own -----------------------------------------

    def copy_into_slot(self, slot: int, host: Sequence[torch.Tensor]) -> None:
        """Copy a chunk from the host into ``slot`` on the copy stream; the scatter waits for it.

        The copy waits for the slot's previous scatter (or copy out) only, so in a batch
        the copy of chunk i + 1 runs while chunk i scatters.
        """
        import torch

        if not self._ordered_slots:
            return super().copy_into_slot(slot, host)
        copies = self._copy_stream()
        copies.wait_event(self._slot_free(slot))
        with torch.cuda.stream(copies):
            super().copy_into_slot(slot, host)
        self.stream.wait_stream(copies)

    def copy_out_of_slot(self, slot: int, host: Sequence[torch.Tensor]) -> None:
        """Copy ``slot`` to the host on the copy stream, after its gather; the slot is free after.

        The next gather (into another slot) does not wait for it: in a batch chunk i
        crosses the link while chunk i + 1 is gathered.
        """
        import torch

        if not self._ordered_slots:
            return super().copy_out_of_slot(slot, host)
        copies = self._copy_stream()
        copies.wait_stream(self.stream)  # the gather into the slot (and everything before it)
        with torch.cuda.stream(copies):
            super().copy_out_of_slot(slot, host)
        self._slot_free(slot).record(copies)

    def synchronize(self) -> None:
        """Wait for the transfer stream and the host copies' stream (both, even if one fails)."""
        with self._sticky():
            try:
                super().synchronize()
            finally:
                if self._copies is not None:
                    self._copies.synchronize()

    @contextlib.contextmanager
    def _sticky(self) -> Iterator[None]:
        """Turn a failure that left the device in a sticky error state into ``DeviceFailedError``.

        Such a device answers every later call with the same error, so the server would
        answer requests it can never serve: the driver is asked, and the error says so.
        """
        try:
            yield
        except Exception as exc:
            from lmcache_platform import DeviceFailedError

            sticky = self._sticky_error()
            if sticky is None:
                raise
            raise DeviceFailedError(
                f"{self.device} is in a sticky error state ({sticky}) after {type(exc).__name__}: {exc}; "
                "no transfer can run in this process any more, restart it"
            ) from exc

    def get_temp_kernel_group_buffer(self, slot: int, kernel_group_idx: int) -> torch.Tensor:
        """The base's view; work the caller then enqueues on :attr:`stream` follows the slot's copies."""
        return self._after_copies(slot, super().get_temp_kernel_group_buffer(slot, kernel_group_idx))

    def get_temp_object_group_buffer(self, slot: int, object_group_idx: int) -> torch.Tensor:
        """The base's view; work the caller then enqueues on :attr:`stream` follows the slot's copies."""
        return self._after_copies(slot, super().get_temp_object_group_buffer(slot, object_group_idx))

    def _after_copies(self, slot: int, view: torch.Tensor) -> torch.Tensor:
        """``view`` of ``slot``, once :attr:`stream` waits for the slot's last copy."""
        if self._ordered_slots:
            self.stream.wait_event(self._slot_free(slot))
        return view

    @property
    def _ordered_slots(self) -> bool:
        """Whether the copies run on a stream of their own (on a CUDA device; a subclass
        that runs this context's kernels on host tensors, as the tests do, copies in order)."""
        return self.device.type == "cuda"

    def _copy_stream(self) -> torch.cuda.Stream:
        """The stream the host copies run on, made on the first one (after the transfer stream)."""
        if self._copies is None:
            import torch

            stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(self.stream)
            self._copies = stream
        return self._copies

    def _slot_free(self, slot: int) -> torch.cuda.Event:
        """Recorded after the last device work that used ``slot``; waiting on a fresh one is a no-op."""
        return self._slot_events[slot]

    def transfer_kernels(self) -> TritonTransfers:
        """The context's fused kernels, made and compiled with the context (``reason`` says why not)."""
        if self._kernels is None:
            from ._kernels import TritonTransfers

            self._kernels = TritonTransfers(self)
        return self._kernels

    def release(self) -> None:
        """Drop the kernels' tables and their views of the engine's memory."""
        self._kernels = None
        super().release()

    def report_status(self) -> dict[str, Any]:
        """The base's summary, plus how transfers run (``transfers``: ``triton`` or ``torch``, and why)."""
        status = super().report_status()
        kernels = self._kernels
        if kernels is None:  # closed
            status["transfers"] = {"path": None, "reason": "closed"}
        else:
            status["transfers"] = {"path": "triton" if kernels.active else "torch", "reason": kernels.reason}
        return status

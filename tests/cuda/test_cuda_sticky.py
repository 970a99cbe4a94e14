"""A sticky CUDA error (an illegal address): the context says so with ``DeviceFailedError``.

After such an error every later call of the process fails the same way, so a server that
kept answering would answer requests it can never serve. The context asks the driver
(``cuCtxSynchronize``) whenever a transfer or a synchronization fails; here the driver is
``FakeVmmLib`` under the real binding (no GPU), the context's kernels run in Triton's
interpreter on CPU tensors, and the failing launch is injected.
"""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_platform import CacheContextConfig, DeviceFailedError, KVFormat
from lmcache_platform_cuda import _kernels, _vmm_ipc
from support.cache import HeldWrapper, engine_kv
from support.cuda_fakes import FakeVmmLib, InterpretedContext

pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run here")


class HostContext(InterpretedContext):
    """``InterpretedContext`` asking the fake driver about device 0 for a sticky error."""

    def _sticky_error(self) -> str | None:
        return _vmm_ipc.get_runtime().sticky_error(0)  # type: ignore[attr-defined, no-any-return]


def illegal_address(self: Any, plan: Any, *, store: bool) -> bool:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def ctx(fake_vmm: FakeVmmLib, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layers = engine_kv(KVFormat.VLLM, 2, 8, 4, 2, 8, device="cpu", order="LBNHC")
    context = HostContext(
        [HeldWrapper.wrap(t) for t in layers], CacheContextConfig(lmcache_tokens_per_chunk=8)
    )
    monkeypatch.setattr(_kernels.TritonTransfers, "run", illegal_address)
    yield context
    context.close()


def test_a_failure_that_left_the_device_sticky_is_a_device_failure(ctx: Any, fake_vmm: FakeVmmLib) -> None:
    fake_vmm.fail("cuCtxSynchronize", 700)  # the driver: the context is in a sticky error state
    with pytest.raises(
        DeviceFailedError, match=r"sticky error state \(CUDA_ERROR_ILLEGAL_ADDRESS \(700\)\)"
    ) as info:
        ctx.store_chunk([[1, 2]])
    assert "illegal memory access" in str(info.value) and "restart" in str(info.value)


def test_a_failure_that_did_not_is_raised_as_it_was(ctx: Any) -> None:
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        ctx.retrieve_chunk([[1, 2]])
    assert not isinstance(info.value, DeviceFailedError)

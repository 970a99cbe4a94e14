"""Fixtures for the CUDA-backend tests.

This machine-independent half of the suite runs without a GPU: where the CUDA
runtime would answer (device enumeration, the driver's IPC calls) a fake answers
instead, and each test using one says so. Tests that need the real thing carry the
``cuda`` marker and skip cleanly when ``torch.cuda.is_available()`` is false.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
from collections.abc import Iterator

import pytest

from lmcache_platform_cuda import _devices, _raw_ipc, _vmm_ipc
from support import cuda_workers as cuda_workers
from support.cuda_fakes import UUIDS, FakeDevices, FakeRuntime, FakeVmmLib, HostCudaDriver
from support.procs import stop_worker


@pytest.fixture
def fake_devices(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDevices]:
    devices = FakeDevices(monkeypatch)
    yield devices
    _devices.DEVICES.reset()


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    runtime = FakeRuntime()
    monkeypatch.setattr(_raw_ipc, "get_runtime", lambda: runtime)
    return runtime


@pytest.fixture
def fake_vmm(monkeypatch: pytest.MonkeyPatch, fake_devices: FakeDevices) -> Iterator[FakeVmmLib]:
    """The VMM kind over ``FakeVmmLib`` (no GPU here): the real ``CudaDriver`` binding, "device"
    memory that is host memory in memfds, and host tensors counting as on cuda:0."""
    lib = FakeVmmLib()
    driver = HostCudaDriver(lib)  # type: ignore[arg-type]
    fake_devices.set(UUIDS[:1])
    monkeypatch.setattr(_vmm_ipc, "get_runtime", lambda: driver)
    monkeypatch.setattr(_vmm_ipc, "cuda_ordinal", lambda tensor: 0)
    yield lib
    gc.collect()
    lib.free_all()


@pytest.fixture(scope="module")
def peer() -> Iterator[cuda_workers.PeerHandle]:
    """A second process (spawn) that reopens descriptors, as a KV-cache server would."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=cuda_workers.peer_main, args=(theirs,), daemon=True)
    process.start()
    theirs.close()
    handle = cuda_workers.PeerHandle(ours, process)
    try:
        yield handle
    finally:
        try:
            stop_worker(process, lambda: handle.call("exit", timeout=30), 30)
        finally:
            ours.close()

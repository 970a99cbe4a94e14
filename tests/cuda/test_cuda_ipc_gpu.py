"""CUDA IPC on a real GPU: both wrapper kinds across a process boundary.

Needs an NVIDIA GPU (``cuda`` marker; skipped cleanly without one). The test
process plays the engine (it allocates, wraps and encodes); a spawned peer plays
the server (it decodes, reopens, reads and writes). Nothing is faked here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcache_platform import DescriptorError, DeviceIPCWrapper, wire
from lmcache_platform_cuda import CudaIPCWrapper, RawCudaIPCWrapper
from lmcache_platform_cuda._devices import DEVICES
from support.cuda_workers import (
    ALLOWED,
    PeerError,
    PeerHandle,
    device_memory_freed,
    digest,
    exporter_main,
    pattern,
    recv,
    send,
)
from support.gpu import NEEDS_GPU

pytestmark = NEEDS_GPU
KINDS = [CudaIPCWrapper, RawCudaIPCWrapper]


def payload(*wrappers: DeviceIPCWrapper) -> str:
    return wire.encode(list(wrappers)).hex()


def interior_view() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pad, base, view): ``base`` starts inside an allocator segment that ``pad`` opened,
    and ``view`` is a strided window in the middle of ``base``."""
    torch.cuda.empty_cache()  # so that pad and base come from one fresh segment, in order
    pad = torch.empty(4096, dtype=torch.uint8, device="cuda")
    base = torch.empty(3, 64, 130, dtype=torch.bfloat16, device="cuda")
    base.copy_(pattern(base, seed=1))
    view = base[1, :, 1:129].t()  # shape (128, 64), strides (1, 130), offset 64*130 + 1
    torch.cuda.synchronize()
    return pad, base, view


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_round_trip_with_write_back_and_untouched_neighbours(
    peer: PeerHandle, kind: type[DeviceIPCWrapper]
) -> None:
    pad, base, view = interior_view()
    w = kind.wrap(view)
    assert (w.shape, w.stride, w.storage_offset) == ((128, 64), (1, 130), 64 * 130 + 1)
    assert w.device_uuid == str(torch.cuda.get_device_properties(0).uuid)
    if isinstance(w, RawCudaIPCWrapper):
        assert w.alloc_offset > 0  # the storage sits inside a larger allocation
    else:
        assert isinstance(w, CudaIPCWrapper) and w.storage_offset_bytes > 0
    before = base.clone()

    (seen,) = peer.call("open", "rt", payload(w))
    assert seen["device"] == "cuda:0"
    assert (seen["shape"], seen["stride"], seen["storage_offset"]) == ([128, 64], [1, 130], 64 * 130 + 1)
    assert seen["digest"] == digest(view)  # the peer reads exactly our bytes

    peer.call("fill", "rt", 0, 2)  # the peer writes through its view
    torch.cuda.synchronize()
    assert torch.equal(view.view(torch.int16), pattern(view, seed=2).view(torch.int16))
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[1, :, 1:129] = False
    assert torch.equal(base.view(torch.int16)[outside], before.view(torch.int16)[outside])
    state = peer.call("close", "rt")
    assert state["refs"] == [0]
    del pad


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_close_is_refcounted_idempotent_and_reimport_works(
    peer: PeerHandle, kind: type[DeviceIPCWrapper]
) -> None:
    pad, base, _ = interior_view()
    a, b = base[0], base[2]
    if kind is RawCudaIPCWrapper:  # two tensors of one allocation share one mapping
        wa, wb = kind.wrap(a), kind.wrap(b)
        assert isinstance(wa, RawCudaIPCWrapper) and isinstance(wb, RawCudaIPCWrapper)
        assert wa.ipc_handle == wb.ipc_handle
        data = payload(wa, wb)
    else:  # one share decoded twice in the peer: one storage, one ref-counter slot
        wa = kind.wrap(a)  # type: ignore[assignment]
        data = payload(wa, wa)
    opened = peer.call("open", "rc", data)
    assert [o["refs"] for o in opened] == [2, 2]
    assert peer.call("close", "rc", 0)["refs"] == [1, 1]
    assert peer.call("close", "rc", 0)["refs"] == [1, 1]  # a second close drops nothing
    assert peer.call("close", "rc")["alive"] == [False, False]  # last wrapper and tensors gone

    (again, _) = peer.call("open", "rc2", data)
    assert again["digest"] == digest(a) and again["refs"] == 2
    peer.call("close", "rc2")
    del pad


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_reopen_on_a_fresh_thread(peer: PeerHandle, kind: type[DeviceIPCWrapper]) -> None:
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    (seen,) = peer.call("open", "th", payload(kind.wrap(t)), True)
    assert seen["digest"] == digest(t)
    peer.call("close", "th")


def test_a_received_tensor_cannot_be_shared_on(peer: PeerHandle) -> None:
    t = torch.zeros(1024, device="cuda")
    peer.call("open", "fwd", payload(CudaIPCWrapper.wrap(t)))
    with pytest.raises(PeerError, match="DescriptorError: torch cannot share this CUDA storage"):
        peer.call("rewrap", "fwd", 0)
    peer.call("close", "fwd")


def test_closing_frees_a_dead_exporters_memory() -> None:
    """The Kubernetes pod-restart leak: memory a dead exporter shared stays until we close."""
    nbytes = 1 << 30
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    exporter = ctx.Process(target=exporter_main, args=(theirs, nbytes), daemon=True)
    exporter.start()
    theirs.close()
    assert ours.poll(120), "the exporter did not start"
    (w,) = wire.decode(bytes.fromhex(recv(ours)), allowed=ALLOWED)
    t = w.to_tensor()
    assert t.numel() == nbytes and int(t[12345].item()) == 7
    send(ours, "exit")
    exporter.join(60)
    assert exporter.exitcode == 0
    views = [t]
    del t
    freed = device_memory_freed(views, [w])
    assert freed >= 0.8 * nbytes, freed


def test_expandable_segments_are_refused_with_a_hint() -> None:
    code = textwrap.dedent(
        """
        import torch
        from lmcache_platform import DescriptorError
        from lmcache_platform_cuda import RawCudaIPCWrapper
        try:
            RawCudaIPCWrapper.wrap(torch.empty(1 << 22, device="cuda"))
        except DescriptorError as exc:
            print("REFUSED:", exc)
        else:
            print("ACCEPTED")
        """
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REFUSED:" in out.stdout and "expandable_segments" in out.stdout, out.stdout


def test_uuid_mapping_on_this_host() -> None:
    n = torch.cuda.device_count()
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
    assert [DEVICES.uuid_of(i) for i in range(n)] == uuids
    assert [DEVICES.ordinal_of(u) for u in uuids] == list(range(n))
    with pytest.raises(DescriptorError, match=f"visible devices: 0={uuids[0]}"):
        DEVICES.ordinal_of("00000000-0000-0000-0000-000000000000")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_reordered_visible_devices(kind: type[DeviceIPCWrapper]) -> None:
    """The server sees the GPUs in the opposite order; the UUID still finds the right one."""
    t = torch.arange(4096, dtype=torch.int32, device="cuda:1")
    torch.cuda.synchronize()
    code = textwrap.dedent(
        """
        import sys
        from lmcache_platform import wire
        from support.cuda_workers import ALLOWED, digest
        (w,) = wire.decode(bytes.fromhex(sys.stdin.read()), allowed=ALLOWED)
        t = w.to_tensor()
        print(t.device, digest(t))
        w.close()
        """
    )
    n = torch.cuda.device_count()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in reversed(range(n)))}
    # The child imports support.cuda_workers: tests/ (where support/ lives) goes on its path.
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=payload(kind.wrap(t)),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"cuda:{n - 2}", digest(t)]

"""Case 7: a full /dev/shm gives a clear error and leaves nothing behind.

Two ways. For real, where this runs as root: a child process gets a private mount
namespace (``unshare -m``) with a 1 MiB tmpfs mounted over /dev/shm, so the kernel
itself says ENOSPC and the host's /dev/shm is untouched. Simulated, everywhere:
``os.statvfs`` reports a nearly full /dev/shm, or ``os.posix_fallocate`` fails
with ENOSPC in the middle of a batch (another process won the race for the space).

The backend's own unit tests cover these paths at the segment level
(``tests/cpu/test_cpu_shm.py``); here they go through the engine's entry point,
``lmcache_platform.wrap_kv_caches``, for a whole model.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import WrapError
from lmcache_platform_cpu import CpuShmIPCWrapper, ShmCapacityError
from support.plugins import env_with_tests_on_path
from support.reliability import SHM_DIR, emit, mapped_shm, segments_of

KIB = 1024

# Runs inside the private mount namespace, where /dev/shm is a fresh 1 MiB tmpfs.
IN_NAMESPACE = textwrap.dedent("""
    import json, os, sys
    import torch
    import lmcache_platform as lp
    from lmcache_platform_cpu import CpuShmIPCWrapper, ShmCapacityError

    def ours():
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("lmcache_platform_"))

    def refused(call):
        try:
            call()
        except Exception as exc:
            return {"type": type(exc).__name__, "capacity": isinstance(exc, ShmCapacityError),
                    "message": str(exc), "left": ours()}
        return None

    out = {"pid": os.getpid(), "size": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize}
    # 1. A model that cannot fit: refused as a whole before anything is created.
    layers = [torch.full((96 * 1024,), float(i)) for i in range(4)]  # 4 x 384 KiB
    addresses = [t.data_ptr() for t in layers]
    out["batch"] = refused(lambda: lp.wrap_kv_caches(layers))
    out["batch_untouched"] = [t.data_ptr() for t in layers] == addresses
    # 2. One big layer fits; the next one does not.
    big = torch.ones(192 * 1024)  # 768 KiB
    kept = lp.wrap_kv_caches([big])
    out["after_big"] = ours()
    out["single"] = refused(lambda: CpuShmIPCWrapper.wrap(torch.ones(128 * 1024)))  # 512 KiB
    # 3. The free-space check passes (it is lied to), the kernel refuses the pages.
    real = os.statvfs
    os.statvfs = lambda p: os.statvfs_result((4096, 4096, 1 << 20, 1 << 20, 1 << 20, 0, 0, 0, 0, 255))
    out["kernel"] = refused(lambda: CpuShmIPCWrapper.wrap(torch.ones(128 * 1024)))
    os.statvfs = real
    # 4. The survivor still works, and closing it frees the space.
    reopened = CpuShmIPCWrapper.from_fields(kept[0].fields()).to_tensor()
    out["survivor_ok"] = bool(torch.equal(reopened, big))
    del reopened
    kept[0].close()
    out["after_close"] = ours()
    print(json.dumps(out))
""")


def _namespace_command() -> list[str] | None:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return None
    mount = "mount -t tmpfs -o size=1M,mode=1777 tmpfs /dev/shm"
    return [
        unshare,
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'{mount} && exec "$0" -c "$1"',
        sys.executable,
        IN_NAMESPACE,
    ]


def test_a_real_full_tmpfs_refuses_with_enospc_and_keeps_nothing(request: pytest.FixtureRequest) -> None:
    command = _namespace_command()
    if command is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace; the simulated tests still run")
    proc = subprocess.run(command, env=env_with_tests_on_path(), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and ("mount" in proc.stderr or "unshare" in proc.stderr) and not proc.stdout:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    assert out["size"] == 1 << 20
    for case in ("batch", "single", "kernel"):
        r = out[case]
        assert r is not None, f"{case}: nothing was refused"
        assert r["capacity"] and r["type"] == "ShmCapacityError", r
        assert "nothing was created" in r["message"] and "--shm-size" in r["message"], r["message"]
    for case in ("batch", "single"):
        assert "short by" in out[case]["message"], out[case]["message"]
    assert out["batch"]["left"] == [] and out["batch_untouched"]
    assert len(out["after_big"]) == 1
    assert out["single"]["left"] == out["after_big"]  # the refused one left nothing
    assert out["kernel"]["left"] == out["after_big"]  # ENOSPC from the kernel: unlinked again
    assert out["survivor_ok"] and out["after_close"] == []
    assert segments_of({out["pid"]}) == []  # the host's /dev/shm never saw any of it
    emit(
        request,
        "7 real full tmpfs",
        f"1 MiB tmpfs over /dev/shm in a private mount namespace: batch of 1.5 MiB refused "
        f"({out['batch']['message'].split(';')[0]}); kernel ENOSPC refused; nothing left",
    )


# -- simulated ----------------------------------------------------------------------------------


@pytest.fixture
def model() -> Iterator[list[torch.Tensor]]:
    """Four 64 KiB layers with a known pattern."""
    yield [torch.arange(16 * KIB, dtype=torch.float32) + 1000 * i for i in range(4)]


def _state() -> tuple[set[str], Counter[str]]:
    return set(segments_of({os.getpid()})), mapped_shm()


def _unchanged(before: tuple[set[str], Counter[str]]) -> bool:
    """No segment of ours appeared or stayed, no new mapping (earlier garbage may go away)."""
    segments, maps = _state()
    return segments <= before[0] and not maps - before[1]


def test_nearly_full_dev_shm_refuses_the_whole_model_up_front(
    model: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    free = 100 * KIB  # room for one layer, not four
    real = os.statvfs

    def nearly_full(path: Any) -> os.statvfs_result:
        st = real(path)
        if os.fspath(path) != SHM_DIR:
            return st
        return os.statvfs_result((4096, 4096, st.f_blocks, free // 4096, free // 4096, *st[5:]))

    monkeypatch.setattr(os, "statvfs", nearly_full)
    before, addresses = _state(), [t.data_ptr() for t in model]
    with pytest.raises(ShmCapacityError) as info:
        lp.wrap_kv_caches(model)
    err = info.value
    assert (err.errno, err.needed, err.free) == (errno.ENOSPC, 256 * KIB, free)
    for part in ("short by 156.0 KiB", "nothing was created", "--shm-size", "lmcache-platform gc --yes"):
        assert part in str(err), str(err)
    assert _unchanged(before) and [t.data_ptr() for t in model] == addresses
    monkeypatch.setattr(os, "statvfs", real)  # space comes back: the same call now works
    wrappers = lp.wrap_kv_caches(model)
    assert all(
        torch.equal(t, torch.arange(16 * KIB, dtype=torch.float32) + 1000 * i) for i, t in enumerate(model)
    )
    for w in wrappers:
        w.close()


def test_enospc_in_the_middle_of_a_batch_unwinds_the_layers_already_wrapped(
    model: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The check passed, then another process took the space: layer 2's allocation fails."""
    real, calls = os.posix_fallocate, []

    def third_fails(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", third_fails)
    before = _state()
    expected = [t.clone() for t in model]
    with pytest.raises(WrapError) as info:
        lp.wrap_kv_caches(model)
    assert info.value.layer == 2 and isinstance(info.value.__cause__, ShmCapacityError)
    assert "layer 2" in str(info.value)
    assert set(segments_of({os.getpid()})) == before[0], "a segment of the failed batch was left behind"
    assert all(torch.equal(t, e) for t, e in zip(model, expected, strict=True))  # the engine lost nothing
    emit(
        request,
        "7 simulated ENOSPC",
        f"ENOSPC at layer 2 of 4: WrapError(layer=2) from ShmCapacityError; "
        f"{len(calls) - 1} segments made before it were unlinked; engine tensors intact",
    )


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.ENOMEM], ids=["ENOSPC", "ENOMEM"])
def test_a_kernel_refusal_despite_free_space_explains_itself(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """statvfs says there is room, the kernel says no (a race, or a memory cgroup charging tmpfs pages)."""

    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    before = _state()
    with pytest.raises(ShmCapacityError) as info:
        CpuShmIPCWrapper.wrap(torch.ones(1024))
    assert _unchanged(before)
    message = str(info.value)
    assert "short by" not in message and "kernel refused" in message and "nothing was created" in message

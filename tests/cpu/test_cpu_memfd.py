"""What only ``CpuMemfdIPCWrapper`` (the default kind) has: sealing, the checks through /proc, the cgroup limit.

The lifecycle both kinds share (migration, aliasing, lifetimes, fork, preflight) is
tested once over both in ``test_cpu_wrapper.py``; the cases with real producer and
consumer processes (truncation attempts, SIGKILL, the leak soak) are in
``tests/reliability/test_rel_memfd.py``.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import lmcache_platform
from lmcache_platform import DescriptorError
from lmcache_platform.hostmem import Headroom, pid_namespace
from lmcache_platform_cpu import CpuMemfdIPCWrapper, CpuShmIPCWrapper, MemfdCapacityError, _memfd
from support.shm import segments_of


def memfd_maps(name: str) -> int:
    """Mappings of memfd ``name`` in this process."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(f"/memfd:{name} (deleted)"))


def footprint() -> tuple[int, int]:
    """(open fds, mappings of any memfd of ours) in this process, once earlier tests' garbage
    is collected (a cycle freed mid-test would otherwise change the counts)."""
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if "/memfd:" + _memfd.PREFIX in line)
    return len(os.listdir("/proc/self/fd")), maps


def exported(w: CpuMemfdIPCWrapper) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{w.memfd_fd}") == f"/memfd:{w.memfd_name} (deleted)"
    except FileNotFoundError:
        return False


def reopen(w: lmcache_platform.DeviceIPCWrapper) -> CpuMemfdIPCWrapper:
    """A consumer-side copy, rebuilt from primitives as a decoder would."""
    return CpuMemfdIPCWrapper.from_fields(w.fields())


def pattern(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


def test_an_export_is_a_sealed_private_memfd_and_nothing_in_dev_shm() -> None:
    t = pattern(4, 8, dtype=torch.bfloat16)
    expected, shm_before = t.clone(), set(segments_of({os.getpid()}))
    w = CpuMemfdIPCWrapper.wrap(t)
    assert set(segments_of({os.getpid()})) == shm_before
    assert (w.memfd_pid, w.memfd_pidns, w.memfd_nbytes) == (os.getpid(), pid_namespace(), 64)
    assert w.memfd_fd in _memfd.owned() and exported(w)
    st = os.fstat(w.memfd_fd)
    assert (st.st_dev, st.st_ino, st.st_size, st.st_mode & 0o777) == (w.memfd_dev, w.memfd_ino, 64, 0o600)
    assert fcntl.fcntl(w.memfd_fd, fcntl.F_GET_SEALS) == _memfd.SEALS
    with pytest.raises(PermissionError):  # nobody, the producer included, can shrink it
        os.ftruncate(w.memfd_fd, 0)
    assert memfd_maps(w.memfd_name) == 1 and torch.equal(t, expected)
    assert w.handle["memfd_name"] == w.memfd_name
    w.close()
    assert not exported(w) and w.memfd_fd not in _memfd.owned()


# -- what a consumer verifies before it maps ----------------------------------------------------


@pytest.fixture
def export() -> Iterator[CpuMemfdIPCWrapper]:
    t = pattern(1024)
    w = CpuMemfdIPCWrapper.wrap(t)
    yield w
    w.close()
    del t


def memfd(name: str, nbytes: int, seals: int) -> int:
    """A memfd made by hand (this process), as a forger would."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


Forge = Callable[[CpuMemfdIPCWrapper, list[int]], dict[str, Any]]


def with_fd(fd: int, w: CpuMemfdIPCWrapper, **over: Any) -> dict[str, Any]:
    st = os.fstat(fd)
    return {**w.fields(), "memfd_fd": fd, "memfd_dev": st.st_dev, "memfd_ino": st.st_ino, **over}


def unsealed(w: CpuMemfdIPCWrapper, opened: list[int]) -> dict[str, Any]:
    opened.append(memfd(w.memfd_name, w.memfd_nbytes, seals=0))
    return with_fd(opened[-1], w)


def regular_file(w: CpuMemfdIPCWrapper, opened: list[int]) -> dict[str, Any]:
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.ftruncate(fd, w.memfd_nbytes)
    opened.append(fd)
    return with_fd(fd, w)


def pipe(w: CpuMemfdIPCWrapper, opened: list[int]) -> dict[str, Any]:
    opened.extend(os.pipe())
    return with_fd(opened[-2], w)


def another_memfd(w: CpuMemfdIPCWrapper, opened: list[int]) -> dict[str, Any]:
    """The fd of another memfd, sealed and sized alike, with the export's name and inode."""
    opened.append(memfd(_memfd.PREFIX + secrets.token_hex(16), w.memfd_nbytes, seals=_memfd.SEALS))
    return {**w.fields(), "memfd_fd": opened[-1]}


def same_name_other_inode(w: CpuMemfdIPCWrapper, opened: list[int]) -> dict[str, Any]:
    """A sealed memfd that even bears the export's name: only its inode gives it away."""
    opened.append(memfd(w.memfd_name, w.memfd_nbytes, seals=_memfd.SEALS))
    return {**w.fields(), "memfd_fd": opened[-1]}


def others_owner(w: CpuMemfdIPCWrapper, opened: list[int]) -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.skip("giving a memfd to another uid needs root")
    opened.append(memfd(w.memfd_name, w.memfd_nbytes, seals=_memfd.SEALS))
    os.fchown(opened[-1], 54321, -1)
    return with_fd(opened[-1], w)


FORGED: dict[str, tuple[Forge, str]] = {
    "wrong inode": (lambda w, _: {**w.fields(), "memfd_ino": w.memfd_ino + 1}, "inode"),
    "wrong device": (lambda w, _: {**w.fields(), "memfd_dev": w.memfd_dev + 1}, "inode"),
    "same name, other inode": (same_name_other_inode, "inode"),
    "wrong size": (lambda w, _: {**w.fields(), "memfd_nbytes": w.memfd_nbytes + 4096}, "size"),
    "unsealed memfd": (unsealed, "seals"),
    "a regular file": (regular_file, "memfd"),
    "a pipe": (pipe, "memfd"),
    "another memfd's fd number": (another_memfd, "name"),
    "an fd number that is not open": (lambda w, _: {**w.fields(), "memfd_fd": 999_999}, "fd"),
    "a dead pid": (lambda w, _: {**w.fields(), "memfd_pid": dead_pid()}, "producer"),
    "another pid namespace": (lambda w, _: {**w.fields(), "memfd_pidns": w.memfd_pidns + 1}, "pid namespace"),
    "another user's memfd": (others_owner, "owner"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_every_verification_step_refuses_a_forged_descriptor_and_maps_nothing(
    case: str, export: CpuMemfdIPCWrapper
) -> None:
    forge, check = FORGED[case]
    opened: list[int] = []
    try:
        fields = forge(export, opened)
        before = footprint()
        forged = CpuMemfdIPCWrapper.from_fields(fields)
        with pytest.raises(DescriptorError, match=f"fails the {check} check: .*; nothing was mapped"):
            forged.to_tensor()
        assert footprint() == before, "a refused descriptor left an fd or a mapping"
    finally:
        for fd in opened:
            os.close(fd)


def test_another_processs_fd_number_is_refused(export: CpuMemfdIPCWrapper) -> None:
    """A live process of the same user, with a memfd at the exported fd number: not ours."""
    code = (
        "import os, sys; fd = os.memfd_create('lmcache_platform_' + '0' * 32); "
        "print(fd, flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        fd = int(proc.stdout.readline())
        forged = CpuMemfdIPCWrapper.from_fields({**export.fields(), "memfd_pid": proc.pid, "memfd_fd": fd})
        with pytest.raises(DescriptorError, match="fails the name check"):
            forged.to_tensor()
    finally:
        proc.communicate("")


def test_another_pid_namespace_says_to_switch_to_named_segments(export: CpuMemfdIPCWrapper) -> None:
    forged = CpuMemfdIPCWrapper.from_fields({**export.fields(), "memfd_pidns": 1})
    with pytest.raises(
        DescriptorError, match=r"switch both sides to named segments \(LMCACHE_PLATFORM_CPU_IPC=shm\)"
    ):
        forged.to_tensor()


@pytest.mark.parametrize("where", ["/proc/<pid>/fd", "the fd"])
def test_an_unreadable_proc_says_to_switch_to_named_segments(
    where: str, export: CpuMemfdIPCWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What hidepid, another user or a non-dumpable producer look like: EACCES from /proc."""
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: Any, **kwargs: Any) -> int:
        if (where == "the fd") == ("dir_fd" in kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(
        DescriptorError,
        match=r"fails the access check: .*(hidepid|dumpable).*"
        r"switch both sides to named segments",
    ):
        reopen(export).to_tensor()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"memfd_name": "../../etc/passwd"}, "is not one of this project's"),
        ({"memfd_name": _memfd.PREFIX + "g" * 32}, "is not one of this project's"),
        ({"memfd_name": _memfd.PREFIX + "a" * 33}, "exceeds the limit"),
        ({"memfd_pid": 0}, "memfd_pid 0 names no process"),
        ({"memfd_pid": 1 << 23}, "above the maximum"),
        ({"memfd_fd": -1}, "below the minimum"),
        ({"memfd_ino": 1 << 64}, "above the maximum"),
        ({"memfd_nbytes": 63}, "spans 64 bytes but the memory holds only 63"),
        (
            {
                "memfd_name": "",
                "memfd_pid": 0,
                "memfd_fd": 0,
                "memfd_ino": 0,
                "memfd_dev": 0,
                "memfd_pidns": 0,
            },
            "memfd_nbytes is 64 but no memory is named",
        ),
        ({"memfd_nbytes": 0, "shape": [0]}, "memory is named but memfd_nbytes is 0"),
    ],
)
def test_malformed_descriptors_are_refused_before_anything_is_opened(
    change: dict[str, object], match: str
) -> None:
    fields = {
        "dtype": "float32",
        "shape": [16],
        "stride": [1],
        "storage_offset": 0,
        "device_uuid": "cpu",
        "memfd_pidns": pid_namespace(),
        "memfd_pid": os.getpid(),
        "memfd_fd": 3,
        "memfd_dev": 1,
        "memfd_ino": 7,
        "memfd_name": _memfd.PREFIX + "a" * 32,
        "memfd_nbytes": 64,
    }
    before = footprint()
    with pytest.raises(DescriptorError, match=match):
        CpuMemfdIPCWrapper.from_fields({**fields, **change})
    assert footprint() == before


# -- capacity: the memory cgroup, not /dev/shm --------------------------------------------------

CGROUP = Headroom(1000, "the memory cgroup limit /sys/fs/cgroup/kv/memory.max (64.0 MiB, 63.9 MiB in use)")


def test_capacity_shortfall_names_the_cgroup_limit_and_creates_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_memfd, "memory_headroom", lambda: CGROUP)
    t = pattern(1024)
    address, before, fds = t.data_ptr(), footprint(), _memfd.owned()
    with pytest.raises(MemfdCapacityError) as info:
        CpuMemfdIPCWrapper.wrap(t)
    assert info.value.errno == errno.ENOMEM and (info.value.needed, info.value.free) == (4096, 1000)
    assert str(info.value).startswith(
        "[Errno 12] a memfd of 4.0 KiB does not fit: the memory cgroup limit /sys/fs/cgroup/kv/memory.max "
        "(64.0 MiB, 63.9 MiB in use) leaves 1000 B (short by 3.0 KiB); nothing was created. memfd memory "
        "counts against the memory cgroup, not /dev/shm"
    )
    assert t.data_ptr() == address and footprint() == before and _memfd.owned() == fds


def test_a_kernel_refusal_despite_headroom_explains_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "posix_fallocate", no_memory)
    before = footprint()
    with pytest.raises(
        MemfdCapacityError, match=r"the kernel refused to reserve 4\.0 KiB for a memfd although"
    ):
        CpuMemfdIPCWrapper.wrap(pattern(1024))
    assert footprint() == before


# -- the other kind, and verify ------------------------------------------------------------------


def test_the_two_kinds_never_mistake_each_others_memory() -> None:
    t = torch.arange(16, dtype=torch.int32)
    as_memfd = CpuMemfdIPCWrapper.wrap(t)
    as_shm = CpuShmIPCWrapper.wrap(t)  # moves out of the memfd into a segment
    assert as_shm.shm_name and torch.equal(t, torch.arange(16, dtype=torch.int32))
    assert torch.equal(CpuShmIPCWrapper.from_fields(as_shm.fields()).to_tensor(), t)
    as_memfd.close()
    as_shm.close()
    del t


def test_verify_has_nothing_to_check_on_a_sealed_memfd(export: CpuMemfdIPCWrapper) -> None:
    consumer = reopen(export)
    view = consumer.to_tensor()
    with pytest.raises(PermissionError):
        os.ftruncate(export.memfd_fd, 0)
    consumer.verify()
    assert view.sum().item() == sum(range(1024))
    consumer.close()

"""POSIX shared-memory primitives: names, exclusive 0600 creation, checked opening, capacity."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from lmcache_platform import DescriptorError
from lmcache_platform_cpu import ShmCapacityError, _shm
from support.shm import segments_of


def path(name: str) -> str:
    return os.path.join(_shm.SHM_DIR, name)


def test_create_then_unlink() -> None:
    name, mm = _shm.create(8192)
    try:
        st = os.stat(path(name))
        assert st.st_size == 8192 and stat.S_ISREG(st.st_mode)
        assert name in _shm.owned()
        mm[:5] = b"hello"
        fd = os.open(path(name), os.O_RDONLY)
        assert os.pread(fd, 5, 0) == b"hello"  # the same bytes, seen through the file
        os.close(fd)
    finally:
        mm.close()
        assert _shm.unlink(name) is True
    assert not os.path.exists(path(name))
    assert name not in _shm.owned()
    assert _shm.unlink(name) is False  # idempotent


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_segments_are_created_with_mode_0600_whatever_the_umask(umask: int) -> None:
    old = os.umask(umask)
    try:
        name, mm = _shm.create(4096)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(path(name)).st_mode) == 0o600
    finally:
        mm.close()
        _shm.unlink(name)


def test_names_carry_pid_and_128_random_bits() -> None:
    names = {_shm.new_name() for _ in range(2000)}
    assert len(names) == 2000
    for name in list(names)[:50]:
        pidns, pid = _shm.parse_name(name)
        assert (pidns, pid) == (_shm.pid_namespace(), os.getpid())
        token = name.rsplit("_", 1)[1]
        assert len(token) == 32 and int(token, 16) >= 0
    # The random parts share no common prefix pattern: ~all 16 first digits occur.
    assert len({n.rsplit("_", 1)[1][0] for n in names}) == 16


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "foo",
        "/etc/passwd",
        "../lmcache_platform_1_2_" + "a" * 32,
        "lmcache_platform_1_2_" + "a" * 31,
        "lmcache_platform_1_2_" + "A" * 32,
        "lmcache_platform_1_2_" + "a" * 32 + "/..",
        "lmcache_platform_1_2_" + "a" * 32 + "\n",
        "lmcache_platform_x_2_" + "a" * 32,
        "lmcache_platform_1_2_" + "a" * 32 + "0" * 200,
        "lmcache_kv_1234_0",
    ],
)
def test_names_outside_our_pattern_are_refused(bad: str) -> None:
    with pytest.raises(DescriptorError, match="not a segment of this project"):
        _shm.parse_name(bad)
    with pytest.raises(DescriptorError, match="not a segment of this project"):
        _shm.open_existing(bad, 4096)
    with pytest.raises(DescriptorError):
        _shm.unlink_any(bad)


def test_open_checks_existence_size_mode_and_owner() -> None:
    name, mm = _shm.create(4096)
    try:
        with pytest.raises(DescriptorError, match="holds 4096 bytes but the descriptor says 8192"):
            _shm.open_existing(name, 8192)
        with pytest.raises(DescriptorError, match="descriptor says 1024"):
            _shm.open_existing(name, 1024)
        os.chmod(path(name), 0o644)
        with pytest.raises(DescriptorError, match="mode 0644"):
            _shm.open_existing(name, 4096)
        os.chmod(path(name), 0o600)
        if os.geteuid() == 0:  # only root can hand a segment to another user
            os.chown(path(name), 54321, -1)
            with pytest.raises(DescriptorError, match="belongs to uid 54321"):
                _shm.open_existing(name, 4096)
            os.chown(path(name), 0, -1)
        reopened = _shm.open_existing(name, 4096)
        mm[:3] = b"abc"
        assert reopened[:3] == b"abc"
        reopened.close()
    finally:
        mm.close()
        _shm.unlink(name)
    with pytest.raises(DescriptorError, match="does not exist"):
        _shm.open_existing(name, 4096)


def test_open_refuses_a_symlink_with_our_name() -> None:
    name = _shm.new_name()
    target, mm = _shm.create(4096)
    os.symlink(path(target), path(name))
    try:
        with pytest.raises(DescriptorError, match="cannot open"):
            _shm.open_existing(name, 4096)
    finally:
        os.unlink(path(name))
        mm.close()
        _shm.unlink(target)


def test_capacity_shortfall_creates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(segments_of({os.getpid()}))
    monkeypatch.setattr(_shm, "free_bytes", lambda: 3 << 20)
    with pytest.raises(ShmCapacityError) as info:
        _shm.create(64 << 20)
    err = info.value
    assert (err.needed, err.free, err.errno) == (64 << 20, 3 << 20, errno.ENOSPC)
    assert isinstance(err, OSError)
    message = str(err)
    for part in ("3.0 MiB free", "64.0 MiB", "short by 61.0 MiB", "--shm-size", "gc"):
        assert part in message
    assert set(segments_of({os.getpid()})) - before == set()


def test_a_full_filesystem_at_allocation_unlinks_the_new_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Simulates /dev/shm filling up between the free-space check and the allocation
    # (another process won the race): posix_fallocate reports ENOSPC.
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before, owned_before = set(segments_of({os.getpid()})), _shm.owned()
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ShmCapacityError, match="nothing was created"):
        _shm.create(1 << 20)
    assert set(segments_of({os.getpid()})) - before == set()
    assert _shm.owned() == owned_before


def test_nonpositive_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="positive size"):
        _shm.create(0)

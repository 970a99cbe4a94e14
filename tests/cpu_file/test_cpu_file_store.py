"""The ``cpu.file`` store: the directory's rules, exclusive creation, checked opening, ownership."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from pathlib import Path

import pytest

from lmcache_platform import DescriptorError
from lmcache_platform_cpu_file import DirectoryError, FileCapacityError, FileStore, _store

STORE = FileStore()


def create(nbytes: int) -> tuple[str, mmap.mmap]:
    """``STORE.create`` with the name out of the handle."""
    handle, mm = STORE.create(nbytes)
    assert set(handle) == {"file_name"} and isinstance(handle["file_name"], str)
    return handle["file_name"], mm


def test_a_missing_directory_is_created_private_whatever_the_umask(kv_dir: Path) -> None:
    old = os.umask(0o277)  # would leave the owner without write and search
    try:
        d = _store.directory()
    finally:
        os.umask(old)
    assert d.path == str(kv_dir)
    st = os.stat(kv_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o500])
def test_a_directory_not_exactly_0700_is_refused(kv_dir: Path, mode: int) -> None:
    kv_dir.mkdir()
    kv_dir.chmod(mode)
    with pytest.raises(DirectoryError, match=f"has mode {mode:04o}; it must be 0700"):
        _store.directory()


def test_a_symlinked_directory_and_a_file_are_refused(kv_dir: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    kv_dir.symlink_to(real)
    with pytest.raises(DirectoryError, match="is a symlink"):
        _store.directory()
    kv_dir.unlink()
    kv_dir.write_text("")
    with pytest.raises(DirectoryError, match="is not a directory"):
        _store.directory()
    kv_dir.unlink()


def test_another_users_directory_is_refused(kv_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    kv_dir.mkdir(mode=0o700)
    os.chown(kv_dir, 54321, -1)
    with pytest.raises(DirectoryError, match="belongs to uid 54321"):
        _store.directory()


def test_without_the_variable_there_is_no_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_store.ENV_DIR, raising=False)
    with pytest.raises(DirectoryError, match="LMCACHE_PLATFORM_CPU_FILE_DIR is not set"):
        _store.directory()


def test_create_makes_a_private_file_of_exact_size_under_an_unguessable_name(kv_dir: Path) -> None:
    name, mm = create(5000)
    try:
        st = os.lstat(kv_dir / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == len(mm) == 5000
        assert name in _store.owned()
        assert _store.NAMES.parse(name)[1] == os.getpid()
        reopened = STORE.open_existing({"file_name": name}, 5000)
        mm[:3] = b"abc"
        assert reopened[:3] == b"abc"
        reopened.close()
    finally:
        mm.close()
        assert STORE.release({"file_name": name}) is True
    assert not (kv_dir / name).exists() and STORE.release({"file_name": name}) is False
    assert len({_store.NAMES.new() for _ in range(2000)}) == 2000


@pytest.mark.parametrize(
    "bad",
    [
        "../x",
        "a/b",
        "/etc/passwd",
        "lmcache_cpu_file_1_2_" + "a" * 32 + "/..",
        "lmcache_platform_1_2_" + "a" * 32,
        "lmcache_cpu_file_1_2_" + "A" * 32,
        "",
    ],
)
def test_names_outside_the_pattern_are_refused_before_anything_is_opened(kv_dir: Path, bad: str) -> None:
    with pytest.raises(DescriptorError, match="is not a KV file of this project"):
        STORE.check_handle({"file_name": bad})
    with pytest.raises(DescriptorError, match="is not a KV file of this project"):
        STORE.open_existing({"file_name": bad}, 4096)
    assert not kv_dir.exists(), "the directory was touched for a bad name"


def test_open_checks_type_owner_mode_and_size_before_mapping(kv_dir: Path) -> None:
    name, mm = create(4096)
    path = kv_dir / name
    try:
        with pytest.raises(DescriptorError, match="holds 4096 bytes but the descriptor implies 8192"):
            STORE.open_existing({"file_name": name}, 8192)
        path.chmod(0o640)
        with pytest.raises(DescriptorError, match="mode 0640"):
            STORE.open_existing({"file_name": name}, 4096)
        path.chmod(0o600)
        if os.geteuid() == 0:
            os.chown(path, 54321, -1)
            with pytest.raises(DescriptorError, match="belongs to uid 54321"):
                STORE.open_existing({"file_name": name}, 4096)
            os.chown(path, 0, -1)
        decoy = _store.NAMES.new()
        (kv_dir / decoy).symlink_to(path)
        with pytest.raises(DescriptorError, match="is a symlink"):
            STORE.open_existing({"file_name": decoy}, 4096)
        (kv_dir / decoy).unlink()
        fifo = _store.NAMES.new()
        os.mkfifo(kv_dir / fifo, 0o600)
        with pytest.raises(DescriptorError, match="not a regular file"):
            STORE.open_existing({"file_name": fifo}, 4096)
        (kv_dir / fifo).unlink()
    finally:
        mm.close()
        STORE.release({"file_name": name})
    with pytest.raises(
        DescriptorError, match=r"does not exist .* set LMCACHE_PLATFORM_CPU_FILE_DIR differently"
    ):
        STORE.open_existing({"file_name": name}, 4096)


def test_a_consumer_with_another_directory_cannot_reach_the_file(
    kv_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, mm = create(4096)
    try:
        monkeypatch.setenv(_store.ENV_DIR, str(tmp_path / "elsewhere"))
        with pytest.raises(DescriptorError, match="does not exist"):
            STORE.open_existing({"file_name": name}, 4096)
    finally:
        monkeypatch.setenv(_store.ENV_DIR, str(kv_dir))
        mm.close()
        STORE.release({"file_name": name})


def test_a_capacity_shortfall_creates_nothing(kv_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _store.directory()
    monkeypatch.setattr(_store.Directory, "free_bytes", lambda self: 1000)
    with pytest.raises(
        FileCapacityError,
        match=r"1000 B free but 4\.0 KiB are needed \(short by 3\.0 KiB\).*nothing was created",
    ):
        create(4096)
    assert os.listdir(d.path) == []
    with pytest.raises(FileCapacityError) as info:
        STORE.check_capacity(1 << 20)
    assert info.value.errno == errno.ENOSPC and info.value.needed == 1 << 20


def test_running_out_of_space_while_reserving_leaves_nothing(
    kv_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    owned = _store.owned()
    with pytest.raises(FileCapacityError, match=r"refused to reserve 1\.0 MiB although .* are reported free"):
        create(1 << 20)
    assert os.listdir(_store.directory().path) == [] and _store.owned() == owned


def test_a_forked_child_never_unlinks_its_parents_files(kv_dir: Path) -> None:
    name, mm = create(4096)
    try:
        pid = os.fork()
        if pid == 0:  # child: what its atexit and an explicit unlink would do
            code = 0
            try:
                _store._unlink_all_owned()
                code = 1 if STORE.release({"file_name": name}) else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert (kv_dir / name).exists() and name in _store.owned()
    finally:
        mm.close()
        STORE.release({"file_name": name})

"""The file store: the remote-store conformance suite, atomic entries, the bound, the directory's checks.

Real files in pytest's temporary directories, real processes for the writer killed
mid-write and for a second server sharing the directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmcache_platform.remote import RemoteConfigError, RemoteStore, open_remote
from lmcache_platform_file_store import FileStore, _io
from lmcache_platform_file_store import _store as store_module

T = 5.0


def url(directory: Path, **query: str) -> str:
    tail = "&".join(f"{k}={v}" for k, v in query.items())
    return f"file://{directory}" + (f"?{tail}" if tail else "")


def opened(directory: Path, **query: str) -> RemoteStore:
    return open_remote(url(directory, **query))


def test_the_conformance_suite_passes(tmp_path: Path) -> None:
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [
        sys.executable, "-m", "pytest", "--pyargs", "lmcache_platform.remote.conformance",
        "--lmcache-remote", url(tmp_path / "kv"), "-c", str(ini), "--rootdir", str(tmp_path),
        "-p", "no:cacheprovider", "-W", "error", "-q", "-rfEs",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # No host to replace: the stalled/refused-server checks do not apply to a local file system.
    assert "failed" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def _drop_pages(directory: Path) -> None:
    """Every file's pages out of the page cache (``fsync``, then ``POSIX_FADV_DONTNEED``): cold reads."""
    for p in directory.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize(
    ("direct", "refused"),
    [("1", ""), ("1", "O_DIRECT"), ("auto", ""), ("auto", "O_DIRECT"), ("auto", "cachestat"), ("0", "")],
)
def test_reads_round_trip_in_every_mode_or_fall_back_once(
    tmp_path: Path,
    direct: str,
    refused: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every read mode, warm and cold (pages dropped): ``O_DIRECT`` where the file system takes it
    (pytest's temporary directory); where it refuses it (EINVAL, injected where the store asks
    for it, ``fcntl(F_SETFL, O_DIRECT)``: this machine's file systems, tmpfs included, all take
    it), or where the kernel has no ``cachestat`` (a syscall number no kernel has: a real
    ENOSYS), buffered reads, said once."""
    caplog.set_level(logging.INFO, logger="lmcache_platform_file_store")
    store = opened(tmp_path / "kv", direct=direct)
    if refused == "cachestat":
        monkeypatch.setattr(_io, "_NR_CACHESTAT", 100_000)
    if refused == "O_DIRECT":
        real_fcntl = fcntl.fcntl

        def no_direct(fd: int, cmd: int, arg: int = 0) -> int:
            if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(fcntl, "fcntl", no_direct)
    try:
        values = [os.urandom(n) for n in (0, 1, 4096 - 16, 4096, 3 << 20, (1 << 20) + 7)]
        keys = [b"d%d" % i for i in range(len(values))]
        assert store.put_many(list(zip(keys, values, strict=True)), ttl=None, timeout=T) == [True] * len(
            values
        )
        for cold in (False, True, True):
            if cold:
                _drop_pages(tmp_path / "kv")
            got = store.get_many([*keys, b"absent"], timeout=T)
            assert [None if g is None else bytes(g) for g in got] == [*values, None]
            _drop_pages(tmp_path / "kv")
            bufs = [[bytearray(len(v) // 2), bytearray(len(v) - len(v) // 2)] for v in values]
            lengths = store.get_many_into(keys, bufs, timeout=T)  # type: ignore[attr-defined]
            assert lengths == [len(v) for v in values] and [bytes(a + b) for a, b in bufs] == values
        said = [r for r in caplog.records if "does not take" in r.getMessage()]
        assert len(said) == int(bool(refused)) and all(refused in r.getMessage() for r in said)
        assert store._direct is (direct != "0" and not refused)  # type: ignore[attr-defined]
    finally:
        store.close()
    with pytest.raises(RemoteConfigError, match="direct is auto, 0 or 1"):
        opened(tmp_path / "bad", direct="yes")


@pytest.mark.parametrize("direct", ["auto", "1"])
def test_a_chunk_is_read_cold_straight_into_page_aligned_memory(tmp_path: Path, direct: str) -> None:
    """The tier's layout (an entry header, then tensors) puts the first tensor on a page boundary
    in the file, so a cold read lands there without a bounce; every byte (header, padding, an
    unaligned tail) still arrives, also into unaligned buffers."""
    store = opened(tmp_path / "kv", direct=direct)
    try:
        header, first, second = os.urandom(192), os.urandom(3 << 20), os.urandom((1 << 20) + 100)
        put = store.put_many_gather  # type: ignore[attr-defined]
        assert put([(b"c", [header, first, second])], ttl=None, timeout=T) == [True]
        size = (tmp_path / "kv" / "e.c").stat().st_size
        assert (size - len(second) - len(first)) % _io.BLOCK == 0  # the first tensor: page-aligned
        for aligned in (True, False):
            _drop_pages(tmp_path / "kv")
            pages = mmap.mmap(-1, 6 << 20)
            at = 0 if aligned else 8
            dest = [
                memoryview(bytearray(len(header))),
                memoryview(pages)[at : at + len(first)],
                memoryview(pages)[(4 << 20) : (4 << 20) + len(second)],
            ]
            assert store.get_many_into([b"c"], [dest], timeout=T) == [len(header) + len(first) + len(second)]  # type: ignore[attr-defined]
            assert [bytes(d) for d in dest] == [header, first, second]
            fd = os.open(tmp_path / "kv" / "e.c", os.O_RDONLY)
            try:  # past the page cache: the read left the file's pages out of it
                assert not _io.cached(fd, _io.BLOCK, len(first)) or (direct == "auto" and not aligned)
            finally:
                os.close(fd)
            for d in dest:
                d.release()
            pages.close()
    finally:
        store.close()


def test_direct_reads_fill_every_piece_whatever_its_alignment(tmp_path: Path) -> None:
    """``_io.read_into`` past the page cache: aligned middles straight in, headers, edges and
    unaligned pieces through the bounce buffer, a file ending mid-block short of the pieces."""
    data = os.urandom(5 * _io.BLOCK + 300)
    path = tmp_path / "f"
    path.write_bytes(data)
    pages = mmap.mmap(-1, 8 * _io.BLOCK)
    view = memoryview(pages)
    cuts = [(0, 10), (10, _io.BLOCK), (_io.BLOCK, 3 * _io.BLOCK + 5), (3 * _io.BLOCK + 5, len(data) + 100)]
    for mode in (_io.DIRECT, _io.CACHE_FIRST, _io.BUFFERED):
        _drop_pages(tmp_path)
        fd = os.open(path, os.O_RDONLY)
        try:
            pieces = [
                memoryview(bytearray(10)),  # a small header
                memoryview(bytearray(_io.BLOCK - 10)),  # unaligned memory: all through the bounce
                view[_io.BLOCK : 3 * _io.BLOCK + 5],  # aligned as in the file: straight in, a 5-byte tail
                view[4 * _io.BLOCK + 5 : 4 * _io.BLOCK + 5 + len(data) + 100 - (3 * _io.BLOCK + 5)],
            ]
            got = _io.read_into(fd, pieces, 0, len(data), mode)
        finally:
            os.close(fd)
        assert got == len(data)
        for (lo, hi), piece in zip(cuts, pieces, strict=True):
            assert bytes(piece[: max(min(hi, len(data)) - lo, 0)]) == data[lo:hi], mode
        for piece in pieces:
            piece.release()
    fd = os.open(path, os.O_RDONLY)
    try:
        tail = memoryview(bytearray(1000))
        assert _io.read_into(fd, [tail], len(data) - 300, len(data), _io.DIRECT) == 300
        assert bytes(tail[:300]) == data[-300:]
    finally:
        os.close(fd)
    view.release()
    pages.close()


def test_files_of_the_first_layout_are_still_read(tmp_path: Path) -> None:
    """An entry written by an earlier server (``MAGIC_V1``, the value right after the expiry)."""
    store = opened(tmp_path / "kv")
    try:
        value = os.urandom(70_000)
        (tmp_path / "kv" / "e.old").write_bytes(store_module.MAGIC_V1 + bytes(8) + value)
        (tmp_path / "kv" / "e.old").chmod(0o600)
        assert [bytes(v) for v in store.get_many([b"old"], timeout=T) if v is not None] == [value]
        into = [bytearray(100), bytearray(len(value) - 100)]
        assert store.get_many_into([b"old"], [into], timeout=T) == [len(value)]  # type: ignore[attr-defined]
        assert bytes(into[0] + into[1]) == value and store.exists_many([b"old"], timeout=T) == [True]
    finally:
        store.close()


def test_get_many_into_reads_in_place_or_says_the_length(tmp_path: Path) -> None:
    store = opened(tmp_path / "kv")
    try:
        value = os.urandom(10_000)
        assert (
            store.put_many_gather(  # type: ignore[attr-defined]
                [(b"k", [value[:7], memoryview(value)[7:]])], ttl=None, timeout=T
            )
            == [True]
        )
        assert store.put_many([(b"old", b"x")], ttl=0.05, timeout=T) == [True]
        time.sleep(0.1)
        head, rest = bytearray(100), bytearray(len(value) - 100)
        short = [bytearray(10)]
        got = store.get_many_into(  # type: ignore[attr-defined]
            [b"k", b"absent", b"old", b"k"], [[head, rest], [bytearray(1)], [bytearray(1)], short], timeout=T
        )
        assert got == [len(value), None, None, len(value)]  # expired: a miss; wrong size: its length
        assert bytes(head + rest) == value and short == [bytearray(10)]  # the short buffers untouched
    finally:
        store.close()


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    writer = textwrap.dedent(
        f"""
        import sys
        from lmcache_platform.remote import open_remote
        store = open_remote({url(directory)!r})
        print("open", flush=True)
        store.put_many([(b"big", bytes(1 << 30))], ttl=None, timeout=600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
    deadline = time.monotonic() + 30
    while not any(p.name.startswith(".tmp.") and p.stat().st_size > (1 << 20) for p in directory.iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, "the writer never started writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    store = opened(directory)
    try:
        assert store.exists_many([b"big"], timeout=T) == [False]
        assert store.get_many([b"big"], timeout=T) == [None]
    finally:
        store.close()
    # A later open removes what a dead writer left, once it is old enough.
    assert [p.name for p in directory.iterdir() if p.name.startswith(".tmp.")]
    for p in directory.iterdir():
        os.utime(p, (time.time() - 2 * store_module.STALE_TMP_S,) * 2)
    opened(directory).close()
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".tmp.")]


def test_the_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = opened(tmp_path / "kv", max_bytes="40K")
    try:
        value = os.urandom(9 << 10)
        for i in range(4):
            assert store.put_many([(f"k{i}".encode(), value)], ttl=None, timeout=T) == [True]
            time.sleep(0.01)  # distinct mtimes
        assert store.get_many([b"k0"], timeout=T)[0] == value  # read: now the most recently used
        time.sleep(0.01)
        assert store.put_many([(b"k4", value)], ttl=None, timeout=T) == [True]  # past 40 KiB
        held = store.exists_many([b"k0", b"k1", b"k2", b"k3", b"k4"], timeout=T)
        assert held == [True, False, False, True, True]  # down to 90 %: the two least recently used
        used = sum(p.stat().st_size for p in (tmp_path / "kv").iterdir())
        assert used <= 40 << 10
    finally:
        store.close()


def test_two_processes_share_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    store = opened(directory)
    try:
        assert store.put_many([(b"shared", b"from the first")], ttl=None, timeout=T) == [True]
        other = textwrap.dedent(
            f"""
            from lmcache_platform.remote import open_remote
            store = open_remote({url(directory)!r})
            print(bytes(store.get_many([b"shared"], timeout=5)[0]).decode())
            store.put_many([(b"back", b"from the second")], ttl=None, timeout=5)
            """
        )
        out = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "from the first", out.stderr
        assert [bytes(v) for v in store.get_many([b"back"], timeout=T) if v is not None] == [
            b"from the second"
        ]
    finally:
        store.close()


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(RemoteConfigError, match=r"writable by others.*chmod go-w"):
        opened(open_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, -1)
    with pytest.raises(RemoteConfigError, match="owned by uid 65534"):
        opened(theirs)


def test_a_symlink_and_a_host_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(RemoteConfigError) as refused:
        opened(tmp_path / "link")
    assert str(refused.value) == (
        f"file store directory {tmp_path / 'link'} is a symlink (to {real}); symlinks are refused, "
        f"so that entries land where the URL says: name the directory itself, file://{real}"
    )
    with pytest.raises(RemoteConfigError, match="no host"):
        open_remote(f"file://somehost{real}")
    with pytest.raises(RemoteConfigError, match="max_bytes, not"):
        open_remote(f"file://{real}?maxbytes=1G")


def test_a_regular_file_and_a_missing_parent_are_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(RemoteConfigError) as refused:
        opened(tmp_path / "file")
    assert str(refused.value) == (
        f"file store directory {tmp_path / 'file'} exists and is not a directory; name a directory "
        "(a missing one is created 0700)"
    )
    deep = tmp_path / "a" / "b"
    with pytest.raises(RemoteConfigError) as refused:
        opened(deep)
    assert str(refused.value) == (
        f"file store directory {deep}: its parent {deep.parent} does not exist; create it first: "
        f"mkdir -m 700 -p {deep}"
    )
    assert not deep.parent.exists()


def test_a_created_directory_and_its_entries_are_private(tmp_path: Path) -> None:
    store = opened(tmp_path / "new")
    try:
        store.put_many([(b"k", b"v")], ttl=None, timeout=T)
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "new").iterdir())
    finally:
        store.close()


def test_foreign_and_expired_files_are_misses(tmp_path: Path) -> None:
    store = opened(tmp_path / "kv")
    assert isinstance(store, FileStore)
    try:
        (tmp_path / "kv" / "e.planted").write_bytes(b"not an entry of ours")
        assert store.get_many([b"planted"], timeout=T) == [None]
        assert store.exists_many([b"planted"], timeout=T) == [False]
        store.put_many([(b"brief", b"v")], ttl=0.05, timeout=T)
        time.sleep(0.1)
        assert store.get_many([b"brief"], timeout=T) == [None]
        assert not (tmp_path / "kv" / "e.brief").exists()  # an expired entry is removed when met
        assert store.delete_many([b"planted", b"absent"], timeout=T) == [True, False]
    finally:
        store.close()

"""Tiers that outlive ``serve``: the file store, chains of tiers, and damage that is never served.

Real ``lmcache-platform serve`` processes with ``--remote file:///DIR`` (and a real Valkey
behind it for the chain), :class:`support.serve.TinyEngine` as the engine (real CPU KV
tensors, the calls a connector makes); ``tests/vllm/test_vllm_file.py`` runs real
engines. In process: :class:`RemoteTier` and :class:`RemoteChain` over file stores.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_platform.remote._chain import RemoteChain
from lmcache_platform.remote._entry import TensorSpec
from lmcache_platform.remote._tier import RemoteTier
from lmcache_platform.server import ServerClient
from support.serve import CHUNK_BYTES, Serve, TinyEngine, namespace, private_dir
from support.valkey import ValkeyNode
from support.waits import until

NS = namespace(model="tiers")
KEYS = [bytes([i]) * 32 for i in range(1, 40)]


def tier(directory: Path, *, written: int = 0, **kw: Any) -> RemoteTier:
    """A file tier on ``directory`` holding entries ``chunk(i)`` under ``KEYS[i]`` for ``i < written``."""
    t = RemoteTier.open(f"file://{directory}", prefix="t", **kw)
    assert t.wait_ready(10)
    for i in range(written):
        assert t.write_behind(NS, KEYS[i], chunk(i))
    assert t.flush(10)
    return t


def chunk(seed: int) -> list[torch.Tensor]:
    return [torch.full((CHUNK_BYTES,), seed % 251, dtype=torch.uint8)]


def entry_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith("e."))


# -- in process -------------------------------------------------------------------------------


def test_damaged_truncated_and_foreign_entries_are_refused_counted_and_removed(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv", written=3)
    try:
        files = entry_files(tmp_path / "kv")
        assert len(files) == 3
        damaged = bytearray(files[0].read_bytes())
        damaged[-100] ^= 0xFF  # a byte changed in place
        files[0].write_bytes(bytes(damaged))
        files[1].write_bytes(files[1].read_bytes()[: CHUNK_BYTES // 2])  # cut short
        fetched = t.fetch(NS, KEYS[:3])
        assert fetched[0] is None and fetched[1] is None and fetched[2] is not None
        stats = t.stats()
        assert sum(v for k, v in stats.items() if k.startswith("refused_")) == 2
        assert stats["removed_refused"] == 2
        assert [p.name for p in entry_files(tmp_path / "kv")] == [files[2].name]  # never read twice
        # Another deployment's entry under our key (its prefix differs): refused as foreign.
        other = RemoteTier.open(f"file://{tmp_path / 'kv'}", prefix="other")
        assert other.wait_ready(10)
        assert other.write_behind(NS, KEYS[5], chunk(5)) and other.flush(10)
        other.close()
        planted = entry_files(tmp_path / "kv")[0].parent / ("e.t:" + NS.hex() + ":" + KEYS[5].hex())
        entry = next(p for p in entry_files(tmp_path / "kv") if p.name.startswith("e.other:"))
        os.rename(entry, planted)
        assert t.fetch(NS, [KEYS[5]]) == [None]
        assert t.stats()["removed_refused"] == 3 and not planted.exists()
    finally:
        t.close()


def test_a_chunk_that_cannot_be_encoded_is_a_counted_write_error(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv")
    try:
        assert t.write_behind(NS, KEYS[0], [torch.zeros(4, dtype=torch.complex64)])  # no entry dtype
        assert t.write_behind(NS, KEYS[1], chunk(1))
        assert t.flush(10)
        s = t.stats()
        assert (s["write_errors"], s["encode_errors"], s["written"], s["state"]) == (1, 1, 1, "healthy"), s
    finally:
        t.close()


def test_a_fetch_reads_straight_into_the_callers_memory_with_every_check(tmp_path: Path) -> None:
    t = tier(tmp_path / "kv", written=4)
    try:
        expect = [TensorSpec("uint8", (CHUNK_BYTES,))]
        made: list[torch.Tensor] = []

        def into() -> list[torch.Tensor]:
            made.append(torch.empty(CHUNK_BYTES, dtype=torch.uint8))
            return made[-1:]

        got = t.fetch(NS, KEYS[:5], expect=expect, into=into)
        for i in range(4):
            d = got[i]
            assert d is not None and d.placed and any(d.tensors[0] is m for m in made)  # made on threads
            assert torch.equal(d.tensors[0], chunk(i)[0])
        assert got[4] is None and t.stats()["fetch_misses"] == 1
        files = entry_files(tmp_path / "kv")
        damaged = bytearray(files[0].read_bytes())
        damaged[-1] ^= 1
        files[0].write_bytes(bytes(damaged))  # same length: read in place, then refused
        assert t.fetch(NS, KEYS[:1], expect=expect, into=into) == [None]
        other = [TensorSpec("uint8", (CHUNK_BYTES // 2,))]  # another layout: read whole, refused
        assert t.fetch(
            NS, KEYS[1:2], expect=other, into=lambda: [torch.empty(CHUNK_BYTES // 2, dtype=torch.uint8)]
        ) == [None]
        s = t.stats()
        assert (s["refused_checksum"], s["refused_layout"], s["removed_refused"]) == (1, 1, 2), s
    finally:
        t.close()


def test_a_chain_looks_through_its_tiers_in_order_and_brings_chunks_nearer(tmp_path: Path) -> None:
    near, far = tier(tmp_path / "near"), tier(tmp_path / "far")
    chain = RemoteChain([near, far])
    try:
        assert near.write_behind(NS, KEYS[0], chunk(0)) and near.flush(10)
        assert far.write_behind(NS, KEYS[1], chunk(1)) and far.flush(10)
        assert chain.lookup_more(NS, KEYS[:3]) == 2  # one from each tier, in order
        got = chain.fetch(NS, KEYS[:2])
        assert [torch.equal(g.tensors[0], chunk(i)[0]) for i, g in enumerate(got) if g is not None] == [
            True
        ] * 2
        assert chain.flush(10)
        assert near.lookup_more(NS, KEYS[:2]) == 2  # the far tier's chunk was written to the near one
        assert chain.write_behind(NS, KEYS[2], chunk(2)) and chain.flush(10)
        assert (
            near.lookup_more(NS, [KEYS[2]]) == far.lookup_more(NS, [KEYS[2]]) == 1
        )  # stores go to every tier
        stats = chain.stats()
        assert [t["store"] for t in stats["tiers"]] == [near.name, far.name]
        assert stats["written"] == sum(t["written"] for t in stats["tiers"])
    finally:
        chain.close()


# -- real serve processes ---------------------------------------------------------------------


class Node:
    """A tiny engine registered with one ``serve``."""

    def __init__(self, srv: Serve) -> None:
        self.srv = srv
        self.engine = TinyEngine()
        self.client = ServerClient(str(srv.socket_path), timeout=30, deadline_ms=10_000)
        self.ctx = self.engine.register(self.client, NS)

    def put(self, keys: list[bytes], seed: int = 0) -> int:
        for i, key in enumerate(keys):
            self.engine.fill(i, seed + key[0])
        return int(
            self.client.put(self.ctx, [(k, [self.engine.blocks(i)]) for i, k in enumerate(keys)]).stored
        )

    def get(self, keys: list[bytes]) -> int:
        self.engine.zero()
        return int(
            self.client.get(self.ctx, [(k, [self.engine.blocks(i)]) for i, k in enumerate(keys)]).retrieved
        )

    def holds(self, keys: list[bytes], seed: int = 0) -> bool:
        return all(self.engine.holds(i, seed + k[0]) for i, k in enumerate(keys))

    def remote(self) -> dict[str, Any]:
        return dict(self.client.status()["server"]["remote"])

    def close(self) -> None:
        self.client.close()
        self.engine.close()


def serve(tmp: Path, name: str, *remotes: str, flags: tuple[str, ...] = ()) -> Serve:
    args = [a for url in remotes for a in ("--remote", url)]
    srv = Serve(private_dir(tmp, name) / "kv.sock", "--json-log", "--remote-prefix", "t", *args, *flags)
    return srv.wait_ready()


def test_a_restarted_serve_serves_what_the_previous_one_stored_on_disk(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'disk'}"
    first = serve(tmp_path, "first", url)
    node = Node(first)
    try:
        assert node.put(KEYS[:4]) == 4
        assert until(lambda: node.remote()["written"] == 4)
    finally:
        node.close()
    assert first.stop() == 0, first.log()
    second = serve(tmp_path, "second", url)
    node = Node(second)
    try:
        reply = node.client.call("lookup", namespace=NS, keys=KEYS[:6])
        assert (reply["hits"], reply["remote"]) == (4, 4)
        assert node.get(KEYS[:4]) == 4 and node.holds(KEYS[:4])  # the bytes the first server stored
    finally:
        node.close()
        assert second.stop() == 0


def test_a_clean_stop_flushes_the_queue_within_its_bound_and_says_what_it_dropped(tmp_path: Path) -> None:
    # A Valkey that never answers: nothing queued can be written, so the stop drops it all.
    valkey = ValkeyNode(tmp_path / "valkey").start()
    try:
        srv = serve(tmp_path, "flush", valkey.url, flags=("--remote-flush-timeout", "1s"))
        node = Node(srv)
        try:
            assert until(lambda: node.remote()["state"] == "healthy")
            valkey.pause()
            node.put(KEYS[:3])
        finally:
            node.close()
        started = time.monotonic()
        rc = srv.stop()
        took = time.monotonic() - started
    finally:
        valkey.resume()
        valkey.close()
    assert rc == 0, srv.log()
    dropped = [e for e in srv.events() if e["event"] == "remote_dropped"]
    assert took < 15, f"stopping took {took:.1f} s with a 1 s flush bound"
    assert dropped and dropped[0]["chunks"] >= 1, srv.log()[-2000:]


def test_two_tiers_survive_restarts_of_serve_and_of_valkey(tmp_path: Path) -> None:
    disk = f"file://{tmp_path / 'disk'}"
    with ValkeyNode(tmp_path / "valkey") as valkey:
        srv = serve(tmp_path, "chain-1", disk, valkey.url, flags=("--metrics-port", "0"))
        node = Node(srv)
        try:
            assert node.put(KEYS[:4]) == 4
            assert until(lambda: [t["written"] for t in node.remote()["tiers"]] == [4, 4]), node.remote()
            port = next(e["port"] for e in srv.events() if e["event"] == "metrics")
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert 'lmcache_platform_server_remote_tier_written_total{tier="1",store="valkey://' in text
            assert 'lmcache_platform_server_remote_tier_up{tier="0",store="file://' in text
        finally:
            node.close()
        assert srv.stop() == 0, srv.log()
        valkey.restart()  # an empty Valkey: only the disk still holds the chunks
        srv = serve(tmp_path, "chain-2", disk, valkey.url)
        node = Node(srv)
        try:
            assert until(lambda: [t["state"] for t in node.remote()["tiers"]] == ["healthy", "healthy"])
            reply = node.client.call("lookup", namespace=NS, keys=KEYS[:4])
            assert (reply["hits"], reply["remote"]) == (4, 4)
            assert node.get(KEYS[:4]) == 4 and node.holds(KEYS[:4])
            assert node.put(KEYS[10:12]) == 2
            assert until(lambda: [t["written"] for t in node.remote()["tiers"]] == [2, 2]), node.remote()
        finally:
            node.close()
            assert srv.stop() == 0


def test_two_servers_sharing_a_directory_share_kv(tmp_path: Path) -> None:
    disk = f"file://{tmp_path / 'shared'}"
    a_srv, b_srv = serve(tmp_path, "a", disk), serve(tmp_path, "b", disk)
    a, b = Node(a_srv), Node(b_srv)
    try:
        assert a.put(KEYS[:3], seed=7) == 3
        assert until(lambda: a.remote()["written"] == 3)
        assert b.get(KEYS[:3]) == 3 and b.holds(KEYS[:3], seed=7)
    finally:
        a.close()
        b.close()
        assert a_srv.stop() == 0 and b_srv.stop() == 0


# -- a disk tier's faults: a small real file system (tmpfs, mounted as root) --------------------


@contextlib.contextmanager
def small_fs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path``: a real file system that fills up and turns read-only."""
    path.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


_fresh = itertools.count(1)


def heals(node: Node) -> bool:
    """Put one new chunk (a degraded tier's next trial write), then whether the tier is healthy."""
    key = next(_fresh).to_bytes(2, "big") + b"heal" + bytes(26)
    assert node.put([key]) == 1  # served from memory whatever the tier does
    time.sleep(0.1)
    return bool(node.remote()["state"] == "healthy")


def lines_with(srv: Serve, text: str) -> int:
    return sum(text in line for line in srv.log().splitlines())


def test_serve_refuses_a_disk_tier_it_cannot_write_with_one_line(tmp_path: Path) -> None:
    with small_fs(tmp_path / "mnt", "1m") as mnt:
        (mnt / "kv").mkdir(mode=0o700)
        remount(mnt, "ro")
        srv = Serve(private_dir(tmp_path, "ro") / "kv.sock", "--remote", f"file://{mnt / 'kv'}")
        assert srv.wait_exit() == 2
        lines = srv.log().strip().splitlines()
        assert len(lines) == 1, lines
        assert "cannot start: remote tier: file store directory" in lines[0]
        assert "is not writable (Read-only file system)" in lines[0] and "read-write file system" in lines[0]


def test_a_full_disk_degrades_the_tier_and_serving_goes_on_until_it_has_room(tmp_path: Path) -> None:
    with small_fs(tmp_path / "mnt", "2m") as mnt:
        filler = mnt / "filler"
        filler.write_bytes(bytes(2 << 20))  # ENOSPC at its end: the rest of the file system is full
        with serve(
            tmp_path, "full", f"file://{mnt / 'kv'}?max_bytes=64M", flags=("--metrics-port", "0")
        ) as srv:
            node = Node(srv)
            try:
                for i in range(0, 12, 2):  # every put and get answers from memory
                    assert node.put(KEYS[i : i + 2]) == 2
                    assert node.get(KEYS[i : i + 2]) == 2 and node.holds(KEYS[i : i + 2])
                assert until(lambda: node.remote()["state"] == "degraded"), node.remote()
                r = node.remote()
                assert r["write_errors"] >= 3 and r["written"] == 0, r
                port = next(e["port"] for e in srv.events() if e["event"] == "metrics")
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                (up,) = [
                    line
                    for line in text.splitlines()
                    if line.startswith("lmcache_platform_server_remote_up{")
                ]
                assert (
                    up.endswith(" 0")
                    and 'lmcache_platform_server_remote_dropped_total{reason="degraded"}' in text
                )
                filler.unlink()  # room again: a trial write heals the tier
                assert until(lambda: heals(node), 60), node.remote()
                written = node.remote()["written"]
                assert written >= 1 and len(entry_files(mnt / "kv")) == written
                assert len([e for e in srv.events() if e["event"] == "remote_degraded"]) == 1
                assert len([e for e in srv.events() if e["event"] == "remote_up"]) == 2  # start, recovery
                assert lines_with(srv, "No space left") == 1, srv.log()  # once, not per chunk
            finally:
                node.close()


def test_a_disk_turned_read_only_still_serves_its_entries_and_recovers(tmp_path: Path) -> None:
    with small_fs(tmp_path / "mnt", "8m") as mnt:
        url = f"file://{mnt / 'kv'}"
        writer_srv, reader_srv = serve(tmp_path, "w", url), serve(tmp_path, "r", url)
        writer, reader = Node(writer_srv), Node(reader_srv)
        try:
            assert writer.put(KEYS[:4]) == 4
            assert until(lambda: writer.remote()["written"] == 4)
            remount(mnt, "ro")
            assert reader.get(KEYS[:4]) == 4 and reader.holds(KEYS[:4])  # read from the disk tier
            for i in range(10, 16):
                assert writer.put([KEYS[i]]) == 1  # served from memory, never failed
            assert until(lambda: writer.remote()["state"] == "degraded"), writer.remote()
            assert reader.get(KEYS[10:12]) == 0  # not written: misses, not errors
            remount(mnt, "rw")
            assert until(lambda: heals(writer), 60), writer.remote()
            assert lines_with(writer_srv, "Read-only file system") <= 2, writer_srv.log()  # write, touch
            assert reader.remote()["state"] == "healthy"
        finally:
            writer.close()
            reader.close()
            assert writer_srv.stop() == 0 and reader_srv.stop() == 0

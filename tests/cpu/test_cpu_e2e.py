"""Engine and server in two real processes (spawn): wrap, reopen, store, retrieve, verify.

One engine process and one server process serve every case of this module (each
costs a torch import). Per case, the engine allocates paged KV caches, fills them
with random bytes and wraps them with ``lmcache_platform.wrap_kv_caches``; the
server rebuilds the wrappers from JSON and builds its context through
``lmcache_platform.create_cache_context``, stores chunks and keeps copies; the
engine scrambles its caches; the server retrieves the chunks into other blocks; the
engine checks every byte of every layer.
"""

from __future__ import annotations

import multiprocessing
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from support import commands
from support import cpu_workers as workers
from support.procs import stop_worker

CHUNK = 32
#: Tokens per chunk of each transfer: full chunks and a partial one.
CHUNKS = [32, 20, 32, 32, 32]
SPAWN = multiprocessing.get_context("spawn")


#: Per IPC kind: its size and name fields, and what refusing a bad name or a gone export says.
KINDS = {
    "memfd": {
        "nbytes": "memfd_nbytes",
        "name": "memfd_name",
        "bad_name": "not one of this project's",
        "gone": "closed the export",
    },
    "shm": {
        "nbytes": "shm_nbytes",
        "name": "shm_name",
        "bad_name": "not a segment of this project",
        "gone": "does not exist",
    },
}


class Peer:
    """A spawned worker process spoken to with JSON over a pipe."""

    def __init__(self, target: Any, child_pids: set[int], env: dict[str, str] | None = None) -> None:
        conn, child = SPAWN.Pipe()
        self.channel = commands.PipeChannel(conn)
        self.proc = SPAWN.Process(target=target, args=(child,), daemon=True)
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})  # a spawned child starts with a copy of this environment
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        child.close()
        assert self.proc.pid is not None
        child_pids.add(self.proc.pid)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """The worker's raw answer (``ok``, then ``result`` or ``type`` and ``error``)."""
        return commands.exchange(self.channel, op, args, timeout=120)  # a hang guard, not a timing assertion

    def ok(self, op: str, **args: Any) -> Any:
        """The result; :class:`CommandFailed` if the worker's handler raised."""
        return commands.request(self.channel, op, args, timeout=120)

    def stop(self) -> None:
        stop_worker(self.proc, lambda: self.call("exit"), 30)
        assert self.proc.exitcode == 0


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    """The IPC kind the engine exports with (``LMCACHE_PLATFORM_CPU_IPC``); the server takes both."""
    return str(request.param)


@pytest.fixture(scope="module")
def peers(child_pids: set[int], kind: str) -> Iterator[tuple[Peer, Peer]]:
    engine = Peer(workers.engine_main, child_pids, env={"LMCACHE_PLATFORM_CPU_IPC": kind})
    server = Peer(workers.server_main, child_pids)
    yield engine, server
    server.stop()
    engine.stop()


# -- cases ------------------------------------------------------------------------------


def layer(fmt: str, dtype: str, **extra: Any) -> dict[str, Any]:
    return {
        "format": fmt,
        "dtype": dtype,
        "num_blocks": 48,
        "block_size": 16,
        "heads": 4,
        "head_size": 8,
        **extra,
    }


@dataclass
class Case:
    layers: list[dict[str, Any]]
    #: engine groups as EngineGroupInfo keywords; empty: one implicit group
    groups: list[dict[str, Any]] = field(default_factory=list)
    hints: dict[str, Any] | None = None
    separate_object_groups: bool = True
    full_sw_kv: bool = False

    def config(self) -> dict[str, Any]:
        return {
            "tokens_per_chunk": CHUNK,
            "hints": self.hints,
            "groups": self.groups,
            "separate_object_groups": self.separate_object_groups,
            "full_sw_kv": self.full_sw_kv,
        }

    def verify_groups(self) -> list[dict[str, Any]]:
        """Per engine group: its layers, block size and tokens kept per chunk (the spec)."""
        groups = self.groups or [
            {
                "layer_indices": list(range(len(self.layers))),
                "block_size": self.layers[0]["block_size"],
                "sliding_window": None,
            }
        ]
        out = []
        for g in groups:
            window = g.get("sliding_window")
            kept = CHUNK if window is None or self.full_sw_kv else min(CHUNK, window)
            out.append({**g, "kept_tokens": kept})
        return out


FORMATS = ["flash_attn", "flash_attn_hnd", "flashinfer", "flashinfer_hnd", "mla"]
DTYPES = {
    "flash_attn": "bfloat16",
    "flash_attn_hnd": "float16",
    "flashinfer": "float32",
    "flashinfer_hnd": "float8_e4m3fn",
    "mla": "bfloat16",
}


def single_format(fmt: str, hinted: bool) -> Case:
    layers = [layer(fmt, DTYPES[fmt]) for _ in range(3)]
    if hinted:  # the format stated, no engine groups
        return Case(layers, hints={"kv_format": fmt})
    # no hints: the engine group's block size tells tokens from heads, as vLLM passes it
    return Case(layers, groups=[{"layer_indices": [0, 1, 2], "block_size": 16}])


CASES = {
    f"{fmt}-{'hints' if h else 'nohints'}": single_format(fmt, h) for fmt in FORMATS for h in (True, False)
}
CASES["vllm-hnd-memory-nhd-view-nohints-nogroups"] = Case(
    [layer("flash_attn", "float16", hnd_memory=True) for _ in range(2)]
)
CASES["block-size-hint-only"] = Case(
    [layer("flashinfer_hnd", "int8") for _ in range(2)], hints={"block_size": 16}
)
# A hybrid model: full-attention layers 0, 2, 4 and sliding-window layers 1, 3. As in
# vLLM, layers of the two groups share allocations pairwise, the groups use disjoint
# block ids, and only the window's last tokens of each chunk are kept.
CASES["two-groups-sliding-window-shared-memory"] = Case(
    [
        layer("flash_attn", "bfloat16", shared=f"s{i // 2}") if i < 4 else layer("flash_attn", "bfloat16")
        for i in range(5)
    ],
    groups=[
        {"layer_indices": [0, 2, 4], "block_size": 16, "sliding_window": None},
        {"layer_indices": [1, 3], "block_size": 16, "sliding_window": 8},
    ],
)
CASES["two-groups-sliding-window-full-kv-one-object"] = Case(
    [
        layer("flashinfer", "float16", num_blocks=96),
        layer("mla", "float16", block_size=8, num_blocks=96),
        layer("flashinfer", "float16", num_blocks=96),
        layer("mla", "float16", block_size=8, num_blocks=96),
    ],
    groups=[
        {"layer_indices": [0, 2], "block_size": 16, "sliding_window": None},
        {"layer_indices": [1, 3], "block_size": 8, "sliding_window": 12},
    ],
    separate_object_groups=False,
    full_sw_kv=True,
)


def plan(case: Case, seed: int) -> list[dict[str, Any]]:
    """Source and destination block ids per chunk and group; all distinct across groups
    (layers of different groups may share memory, as in vLLM)."""
    rng = random.Random(seed)
    groups = case.verify_groups()
    num_blocks = min(spec["num_blocks"] for spec in case.layers)
    pools = [list(range(g, num_blocks, len(groups))) for g in range(len(groups))]
    for pool in pools:
        rng.shuffle(pool)
    transfers = []
    for n in CHUNKS:
        src, dst = [], []
        for g, group in enumerate(groups):
            k = -(-n // group["block_size"])
            src.append([pools[g].pop() for _ in range(k)])
            dst.append([pools[g].pop() for _ in range(k)])
        transfers.append({"num_tokens": n, "src": src, "dst": dst})
    return transfers


def register(engine: Peer, server: Peer, case: Case, seed: int) -> list[dict[str, Any]]:
    wrappers: list[dict[str, Any]] = engine.ok("setup", layers=case.layers, seed=seed)["wrappers"]
    reply = server.ok("register", wrappers=wrappers, config=case.config())
    assert reply["class"] == "CPUCacheContext"
    for kg in reply["status"]["kernel_groups"]:  # discovered formats are the engine's
        for i in kg["layer_indices"]:
            assert kg["kv_format"] == case.layers[i]["format"], (i, kg)
    return wrappers


@pytest.mark.parametrize("name", list(CASES))
def test_store_then_retrieve_into_other_blocks_is_bit_exact(peers: tuple[Peer, Peer], name: str) -> None:
    engine, server = peers
    case = CASES[name]
    seed = sorted(CASES).index(name)
    register(engine, server, case, seed)
    transfers = plan(case, seed)
    engine.ok("snapshot")
    server.ok("store", transfers=transfers)
    engine.ok("scramble", seed=seed + 1000)
    server.ok("retrieve", transfers=transfers)
    result = engine.ok("check_retrieved", groups=case.verify_groups(), transfers=transfers)
    assert result["written_tokens"] > 0
    assert result["mismatched_bytes"] == 0, result
    assert server.ok("close")["mappings"] == 0  # the server unmapped every segment or memfd
    closed = engine.ok("close")
    assert closed["handles"] and closed["remaining"] == []
    shared = {spec["shared"] for spec in case.layers if "shared" in spec}
    unshared = [spec for spec in case.layers if "shared" not in spec]
    assert len(closed["handles"]) == len(shared) + len(unshared)  # one export per allocation


# -- error paths across the processes ---------------------------------------------------


def test_ambiguous_layout_names_the_hint_and_leaks_no_mapping(peers: tuple[Peer, Peer]) -> None:
    engine, server = peers
    case = Case([layer("flash_attn", "float16") for _ in range(2)])  # dense: NHD or HND?
    wrappers = engine.ok("setup", layers=case.layers, seed=1)["wrappers"]
    reply = server.call("register", wrappers=wrappers, config=case.config())
    assert not reply["ok"] and reply["type"] == "LayoutError"
    assert "KVFormat.FLASH_ATTN" in reply["error"] and "block_size" in reply["error"]
    assert server.ok("close")["mappings"] == 0  # the failed context closed what it opened
    case.hints = {"kv_format": "flash_attn"}  # the same wrappers, with the hint: fine
    server.ok("register", wrappers=wrappers, config=case.config())
    assert server.ok("close")["mappings"] == 0
    assert engine.ok("close")["remaining"] == []


def test_out_of_range_retrieve_writes_nothing(peers: tuple[Peer, Peer]) -> None:
    engine, server = peers
    case = CASES["flash_attn-hints"]
    register(engine, server, case, seed=2)
    transfers = plan(case, seed=2)
    server.ok("store", transfers=transfers)
    engine.ok("scramble", seed=3)
    last = transfers[-1]
    # Past the end, negative (-1 would mean "skip": -2 is simply out of range), too few ids.
    for dst in ([[last["dst"][0][0], 48]], [[-2, last["dst"][0][1]]], [[last["dst"][0][0]]]):
        reply = server.call("retrieve", transfers=[{**last, "dst": dst}], first_chunk=len(transfers) - 1)
        assert (reply["ok"], reply["type"]) == (False, "TransferError"), reply
    assert engine.ok("check_untouched")["mismatched_bytes"] == 0
    server.ok("retrieve", transfers=[last], first_chunk=len(transfers) - 1)  # the valid one lands
    assert engine.ok("check_untouched")["mismatched_bytes"] > 0
    server.ok("close")
    engine.ok("close")


def test_tampered_or_dangling_descriptors_are_refused(peers: tuple[Peer, Peer], kind: str) -> None:
    engine, server = peers
    fields_of = KINDS[kind]
    wrappers = engine.ok("setup", layers=[layer("mla", "float16")], seed=5)["wrappers"]
    w = wrappers[0]
    assert w["tag"] == f"cpu.{kind}/1"
    assert server.ok("open", tag=w["tag"], fields=w["fields"])["shape"] == [48, 16, 8]
    nbytes = fields_of["nbytes"]
    for change, error, text in [
        ({nbytes: w["fields"][nbytes] + 4096}, "DescriptorError", "descriptor says"),
        ({fields_of["name"]: "../../dev/shm/x"}, "DescriptorError", fields_of["bad_name"]),
        ({"shape": [48, 16, 8, 2]}, "DescriptorError", "differ in rank"),
        ({"dtype": "object"}, "DescriptorError", "not allowed"),
    ]:
        reply = server.call("open", tag=w["tag"], fields={**w["fields"], **change})
        assert (reply["ok"], reply["type"]) == (False, error) and text in reply["error"], reply
    closed = engine.ok("close", drop_only=True)  # dropping the tensor releases its export
    assert closed["remaining"] == []
    reply = server.call("open", tag=w["tag"], fields=w["fields"])
    assert not reply["ok"] and fields_of["gone"] in reply["error"], reply
    assert server.ok("close")["mappings"] == 0

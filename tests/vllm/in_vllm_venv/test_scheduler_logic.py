"""The connector's scheduler and identity logic against vLLM's own objects and a real server.

Run by ``tests/vllm/test_connector_logic.py`` with the vLLM virtualenv's pytest (these tests
import vLLM). Real pieces: vLLM's ``Request`` and block hasher (so the keys are the
ones a running engine computes), vLLM's ``BlockPool`` (so held blocks are real
reference counts), vLLM's KV-cache specs, and a real ``lmcache-platform serve``.
Faked: the engine's config objects (attribute bags with the fields the connector
reads) and the scheduler's per-step output, since no engine runs here; the
real-engine tests (``test_vllm_*.py``) cover the same paths end to end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from lmcache_platform.server import ServerClient
from lmcache_platform.vllm import _identity
from lmcache_platform.vllm._messages import READY, SKIP, StepPlan, Transfer, WorkerReport
from lmcache_platform.vllm._scheduler import SchedulerSide
from lmcache_platform.vllm._settings import Settings
from lmcache_platform.vllm._worker import WorkerSide
from support.procs import sigstop
from support.serve import CHUNK_BYTES, Serve, TinyEngine, private_dir

BLOCK = 16
CHUNK = 64  # tokens per chunk: four blocks
NUM_BLOCKS = 64

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def request(
    tokens: list[int],
    rid: str = "r",
    *,
    salt: str | None = None,
    lora: LoRARequest | None = None,
    mm: list[MultiModalFeatureSpec] | None = None,
    embeds: torch.Tensor | None = None,
) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        lora_request=lora,
        mm_features=mm,
        prompt_embeds=embeds,
        block_hasher=HASHER,
    )


def prompt(n_chunks: int, seed: int = 0) -> list[int]:
    return [(i * 31 + seed) % 997 + 1 for i in range(n_chunks * CHUNK + 5)]


def image(identifier: str, offset: int, length: int = 32) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset, length)
    )


def keys_of(req: Request, epoch: int = 0) -> list[bytes]:
    per = CHUNK // BLOCK
    return _identity.chunk_keys(req.block_hashes, per, len(req.block_hashes) // per, epoch)


# -- identity: keys cover what vLLM's prefix cache covers -----------------------------------


def test_keys_separate_salts_and_keep_unsalted_requests_shared() -> None:
    p = prompt(3)
    a, b, none = (keys_of(request(p, salt=s)) for s in ("tenant-a", "tenant-b", None))
    assert len(a) == 3
    assert not set(a) & set(b) and not set(a) & set(none) and not set(b) & set(none)
    assert keys_of(request(p, salt="tenant-a")) == a  # the same tenant shares
    assert keys_of(request(p)) == none  # so do requests without salt, as before


def test_keys_separate_lora_adapters_from_each_other_and_the_base_model() -> None:
    p = prompt(2)
    base = keys_of(request(p))
    one = keys_of(request(p, lora=LoRARequest("one", 1, "/adapters/one")))
    two = keys_of(request(p, lora=LoRARequest("two", 2, "/adapters/two")))
    assert len({*base, *one, *two}) == 6
    assert keys_of(request(p, lora=LoRARequest("one", 1, "/adapters/one"))) == one


def test_keys_separate_multimodal_items_behind_the_same_placeholder_tokens() -> None:
    p = prompt(3)
    cat = keys_of(request(p, mm=[image("sha-of-a-cat", 70)]))
    dog = keys_of(request(p, mm=[image("sha-of-a-dog", 70)]))
    moved = keys_of(request(p, mm=[image("sha-of-a-cat", 80)]))
    assert cat[0] == dog[0] == moved[0]  # chunk 0 ends before the image: the same KV
    assert cat[1] != dog[1] and cat[1] != moved[1]  # the image (or its place) changes the rest
    assert cat[2] != dog[2]


def test_keys_separate_prompt_embeddings_block_by_block() -> None:
    p = prompt(3)
    embeds = torch.randn(len(p), 8, generator=torch.Generator().manual_seed(0))
    other = embeds.clone()
    other[CHUNK + 3] += 1.0  # one position of chunk 1 differs
    a = keys_of(request(p, embeds=embeds))
    b = keys_of(request(p, embeds=other))
    assert not set(a) & set(keys_of(request(p)))  # embeddings are not the token ids' KV
    assert a[0] == b[0]  # the chunk before the difference keeps its KV
    assert a[1] != b[1] and a[2] != b[2]  # the difference and every chunk after it do not
    assert keys_of(request(p, embeds=embeds.clone())) == a  # the same embeddings share


def test_a_cache_reset_starts_a_new_epoch_of_keys() -> None:
    req = request(prompt(2))
    assert not set(keys_of(req, 0)) & set(keys_of(req, 1))


# -- namespaces: what changes KV bytes for every request ------------------------------------


def config(**over: Any) -> SimpleNamespace:
    """An engine config with the fields the connector reads (``over`` replaces some)."""
    hf: dict[str, Any] = {"model_type": "qwen2", "rope_theta": 10000.0, **over.pop("hf", {})}
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(
            model="tiny",
            revision=None,
            quantization=over.pop("quantization", None),
            max_model_len=over.pop("max_model_len", 4096),
            hf_config=SimpleNamespace(to_dict=lambda: dict(hf)),
        ),
        cache_config=SimpleNamespace(
            cache_dtype=over.pop("cache_dtype", "auto"),
            enable_prefix_caching=True,
            prefix_caching_hash_algo=over.pop("hash_algo", "sha256"),
            block_size=BLOCK,
            prefix_match_unit=None,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=over.pop("tp", 1),
            pipeline_parallel_size=over.pop("pp", 1),
            decode_context_parallel_size=over.pop("dcp", 1),
            prefill_context_parallel_size=1,
        ),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}, kv_load_failure_policy="fail"),
    )
    assert not over, over
    return cfg


def attention(dtype: torch.dtype = torch.bfloat16, window: int | None = None) -> Any:
    if window:
        return SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=dtype, sliding_window=window
        )
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=dtype)


def kv_config(*specs: Any) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{g}.attn"], spec) for g, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def ns(cfg: SimpleNamespace | None = None, kv: KVCacheConfig | None = None, **rank: int) -> bytes:
    return _identity.cache_namespace_for(
        cfg or config(), kv or kv_config(attention()), CHUNK, None, _identity.Rank(**rank)
    )


def test_the_namespace_is_a_function_of_the_config() -> None:
    assert ns() == ns()


@pytest.mark.parametrize(
    "change",
    [
        {"cache_dtype": "fp8_e5m2"},  # both fp8 flavours are uint8 tensors: only the config tells
        {"quantization": "fp8"},
        {"hf": {"rope_theta": 500000.0}},  # hf_overrides land in the HF config
        {"tp": 2},
        {"pp": 2},
    ],
    ids=lambda c: next(iter(c)),
)
def test_what_changes_kv_bytes_changes_the_namespace(change: dict[str, Any]) -> None:
    base = ns(config(cache_dtype="fp8_e4m3"))
    assert ns(config(**{"cache_dtype": "fp8_e4m3", **change})) != base


def test_every_rank_has_its_own_namespace() -> None:
    cfg = config(tp=2, pp=2)
    names = {ns(cfg, tp_rank=t, pp_rank=p) for t in (0, 1) for p in (0, 1)}
    assert len(names) == 4


def test_max_model_len_counts_only_where_the_rotary_embedding_depends_on_it() -> None:
    plain = [ns(config(max_model_len=n)) for n in (4096, 131072)]
    assert plain[0] == plain[1]
    longrope = {"rope_scaling": {"rope_type": "longrope"}}
    scaled = [ns(config(max_model_len=n, hf=longrope)) for n in (4096, 131072)]
    assert scaled[0] != scaled[1]


def test_what_the_connector_cannot_move_passes_through_with_a_reason() -> None:
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 4),), dtypes=(torch.float32,))
    assert "MambaSpec" in (_identity.cannot_move(config(), kv_config(mamba)) or "")
    assert "attention-free" in (_identity.cannot_move(config(), kv_config()) or "")
    assert _identity.cannot_move(config(), kv_config(attention(), attention(window=32))) is None
    assert "context parallelism" in (_identity.cannot_move(config(dcp=2), kv_config(attention())) or "")


def test_per_process_hashes_share_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert "PYTHONHASHSEED" in (_identity.cannot_share(config(hash_algo="xxhash")) or "")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert _identity.cannot_share(config(hash_algo="xxhash")) is None
    assert _identity.cannot_share(config()) is None


# -- the scheduler side against a real server ----------------------------------------------


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    sock = private_dir(tmp_path_factory.mktemp("srv")) / "kv.sock"
    with Serve(sock) as proc:
        yield proc


class Pools:
    """What the connector binds: vLLM's kv-cache manager with one real block pool."""

    def __init__(self) -> None:
        self.block_pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK)
        self.coordinator = SimpleNamespace(single_type_managers=[])

    def take(self, n: int) -> list[int]:
        return [b.block_id for b in self.block_pool.get_new_blocks(n)]

    def refs(self, ids: list[int]) -> list[int]:
        return [self.block_pool.blocks[b].ref_cnt for b in ids]


#: Stand-ins for the engines' workers: a live registration in each namespace a scheduler
#: asks about (a lookup offers hits only for namespaces some engine can load into).
_WORKERS: list[tuple[ServerClient, TinyEngine]] = []


@pytest.fixture(autouse=True)
def _close_workers() -> Iterator[None]:
    yield
    while _WORKERS:
        client, engine = _WORKERS.pop()
        client.close()
        engine.close()


def scheduler(
    serve: Serve, kv: KVCacheConfig, cfg: SimpleNamespace | None = None, **settings: Any
) -> tuple[SchedulerSide, Pools]:
    side = SchedulerSide(
        cfg or config(),
        kv,
        Settings(socket=str(serve.socket_path), tokens_per_chunk=CHUNK, lookup_ms=2000, **settings),
    )
    pools = Pools()
    side.bind(pools)
    for namespace in getattr(side, "namespaces", []):
        engine = TinyEngine()
        client = ServerClient(str(serve.socket_path), timeout=30)
        engine.register(client, namespace)
        _WORKERS.append((client, engine))
    # The client connects in the background; a lookup sent before that is a miss by design.
    deadline = time.monotonic() + 10
    while side._client is not None and side._client.state != "healthy":
        assert time.monotonic() < deadline, side._client.state
        time.sleep(0.01)
    return side, pools


@pytest.fixture(autouse=True)
def _hash_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM resolves it from a full VllmConfig; ours is a bag of fields (one group size: BLOCK)."""
    monkeypatch.setattr(_identity, "hash_block_size", lambda vllm_config, kv_cache_config: BLOCK)


def store(serve: Serve, namespace: bytes, keys: list[bytes]) -> None:
    """Put chunks under ``keys`` in ``namespace``, as another engine of that namespace would."""
    engine = TinyEngine()
    try:
        with ServerClient(str(serve.socket_path), timeout=30) as c:
            ctx = engine.register(c, namespace)
            for i, key in enumerate(keys):
                engine.fill(i, seed=i)
                assert c.put(ctx, [(key, [engine.blocks(i)])]).stored == 1
    finally:
        engine.close()


def answer(side: SchedulerSide, req: Request, computed: int = 0) -> tuple[int | None, bool]:
    """Ask until the lookup is answered (the first asks return None: ask again later)."""
    deadline = time.monotonic() + 10
    while True:
        got = side.get_num_new_matched_tokens(req, computed)
        if got[0] is not None or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def test_an_answered_hit_loads_asynchronously(serve: Serve) -> None:
    kv = kv_config(attention())
    side, _ = scheduler(serve, kv)
    req = request(prompt(3, seed=1), "hit")
    store(serve, side.namespaces[0], keys_of(req)[:2])
    side.on_new_request(req)
    side.build_connector_meta(step({"busy": (0, 16)}))  # the engine computes
    t0 = time.perf_counter()
    first = side.get_num_new_matched_tokens(req, 0)
    waited = time.perf_counter() - t0
    print(f"first ask answered {first} in {waited * 1e3:.2f} ms")
    assert first in ((None, False), (2 * CHUNK, True))
    assert answer(side, req) == (2 * CHUNK, True)
    assert side._loads == []  # nothing planned until vLLM allocated
    side.shutdown()


def test_a_load_skips_null_and_locally_cached_blocks_and_holds_its_targets(serve: Serve) -> None:
    kv = kv_config(attention(), attention(window=32))
    side, pools = scheduler(serve, kv, config(tp=2))
    req = request(prompt(3, seed=2), "sw")
    for namespace in side.namespaces:
        store(serve, namespace, keys_of(req)[:3])
    side.on_new_request(req)
    # vLLM had the first block cached locally; it offers from a block boundary.
    assert answer(side, req, computed=BLOCK) == (3 * CHUNK - BLOCK, True)
    full = pools.take(12)
    sliding = [0] * 10 + pools.take(2)  # the window keeps the last two blocks; the rest are null
    blocks = SimpleNamespace(get_block_ids=lambda: (full, sliding))
    side.update_state_after_alloc(req, blocks, 3 * CHUNK - BLOCK)
    (load,) = side.build_connector_meta(step()).loads
    rows = [groups for _, groups in load.chunks]
    assert rows[0][0][0] == SKIP and rows[0][0][1:] == full[1:4]  # block 0 was the local hit
    assert all(b == SKIP for b in rows[0][1] + rows[1][1])  # null blocks are never written
    assert rows[2][1] == [SKIP, SKIP, *sliding[10:]]
    assert pools.refs(full[1:] + sliding[10:]) == [2] * 13  # held until the load resolves
    # One rank of two resolved it: still held; both: released.
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=WorkerReport({load.ticket: 1})))
    assert pools.refs(full[1:]) == [2] * 11
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=WorkerReport({load.ticket: 1})))
    assert not side._holds
    assert pools.refs(full[1:] + sliding[10:]) == [1] * 13
    side.shutdown()


def test_the_scheduler_asks_every_rank_and_offers_only_what_all_can_load(serve: Serve) -> None:
    kv = kv_config(attention())
    side, _ = scheduler(serve, kv, config(tp=2))
    assert len(side.namespaces) == 2
    req = request(prompt(3, seed=3), "tp")
    keys = keys_of(req)
    store(serve, side.namespaces[0], keys[:3])
    store(serve, side.namespaces[1], keys[:1])  # rank 1 lost its copy of chunks 1 and 2
    side.on_new_request(req)
    assert answer(side, req) == (CHUNK, True)
    side.shutdown()


def test_stores_read_the_true_block_table_and_skip_chunks_whose_kept_blocks_are_gone(serve: Serve) -> None:
    kv = kv_config(attention(), attention(window=32))
    side, pools = scheduler(serve, kv)
    req = request(prompt(3, seed=4), "store")
    side.on_new_request(req)
    assert answer(side, req) == (0, False)
    full = pools.take(12)
    # A local prefix hit moved the window on: chunk 0's kept sliding blocks are vLLM's null block.
    sliding = [0, 0, 0, 0, *pools.take(8)]
    plan = side.build_connector_meta(step({"store": (0, 3 * CHUNK)}, {"store": (full, sliding)}))
    assert plan.stores == [] and side.stats.totals["skipped_chunks"] == 3
    req2 = request(prompt(3, seed=5), "store2")
    side.on_new_request(req2)
    answer(side, req2)
    full2, sliding2 = pools.take(12), pools.take(12)
    (save,) = side.build_connector_meta(
        step({"store2": (0, 3 * CHUNK)}, {"store2": (full2, sliding2)})
    ).stores
    assert [groups for _, groups in save.chunks] == [
        [full2[c * 4 : c * 4 + 4], sliding2[c * 4 : c * 4 + 4]] for c in range(3)
    ]
    held = full2 + [b for c in range(3) for b in sliding2[c * 4 + 2 : c * 4 + 4]]
    assert pools.refs(held) == [2] * len(held)
    side.shutdown()


def test_hits_follow_the_servers_registrations_and_rank_reports_gate_stores(serve: Serve) -> None:
    """A rank's report of an outage may reach the scheduler after the rank re-registered
    (an idle engine makes no step to correct it): the server, which answers each lookup
    for every rank's registration, decides hits; the reports decide stores."""
    side, _ = scheduler(serve, kv_config(attention()))
    ids = prompt(2, seed=6)
    store(serve, side.namespaces[0], keys_of(request(ids, "k")))
    side.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=WorkerReport({}, {"tp0pp0": "down"}))
    )
    stale = request(ids, "stale-report")
    side.on_new_request(stale)
    assert answer(side, stale) == (2 * CHUNK, True)  # the rank's registration is live
    stores_while_reported_down = side.serving
    assert not stores_while_reported_down  # until a report or a reconnect says the rank is back

    registered = open_contexts(serve)
    client, engine = _WORKERS.pop()  # the rank's link ends: the server drops its registration
    client.close()
    engine.close()
    until(lambda: open_contexts(serve) == registered - 1)
    gone = request(ids, "unregistered")
    side.on_new_request(gone)
    assert answer(side, gone) == (0, False)
    assert side.stats.totals["lookups_unregistered"] == 1

    side.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=WorkerReport({}, {"tp0pp0": READY}))
    )
    stores_after_ready = side.serving
    assert stores_after_ready
    again = TinyEngine()
    _WORKERS.append((ServerClient(str(serve.socket_path), timeout=30), again))
    again.register(_WORKERS[-1][0], side.namespaces[0])
    back = request(ids, "registered-again")
    side.on_new_request(back)
    assert answer(side, back) == (2 * CHUNK, True)
    side.shutdown()


def test_a_hung_or_absent_server_costs_a_lookup_at_most_its_deadline(tmp_path: Any) -> None:
    kv = kv_config(attention())
    side = SchedulerSide(
        config(), kv, Settings(socket=str(tmp_path / "nobody.sock"), tokens_per_chunk=CHUNK, lookup_ms=300)
    )
    side.bind(Pools())
    req = request(prompt(2), "absent")
    side.on_new_request(req)
    t0 = time.monotonic()
    assert answer(side, req) == (0, False)
    assert time.monotonic() - t0 < 5
    side.shutdown()


def test_the_scheduler_makes_failed_loads_recompute_instead_of_failing_requests(serve: Serve) -> None:
    cfg = config()
    SchedulerSide(
        cfg, kv_config(attention()), Settings(socket=str(serve.socket_path), tokens_per_chunk=CHUNK)
    ).shutdown()
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_reset_cache_stops_later_requests_from_finding_earlier_chunks(serve: Serve) -> None:
    side, _ = scheduler(serve, kv_config(attention()))
    req = request(prompt(2, seed=8), "epoch")
    store(serve, side.namespaces[0], keys_of(req, epoch=0))
    side.on_new_request(req)
    assert answer(side, req) == (2 * CHUNK, True)
    assert side.reset_cache() is True
    again = request(prompt(2, seed=8), "epoch-after")
    side.on_new_request(again)
    assert answer(side, again) == (0, False)
    side.shutdown()


def step(
    scheduled: dict[str, tuple[int, int]] | None = None,
    tables: dict[str, tuple[list[int], ...]] | None = None,
) -> SimpleNamespace:
    """A scheduler output: per request (computed before, scheduled now), and the block tables."""
    scheduled = scheduled or {}
    tables = tables or {}
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, num_computed_tokens=b) for r, (b, _) in scheduled.items()
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r: n for r, (_, n) in scheduled.items()},
        total_num_scheduled_tokens=sum(n for _, n in scheduled.values()),
        finished_req_ids=set(),
        preempted_req_ids=set(),
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: tables.get(r)),
    )


# -- P/D roles -------------------------------------------------------------------------------


def with_role(role: str, **over: Any) -> SimpleNamespace:
    cfg = config(**over)
    cfg.kv_transfer_config.kv_role = role
    return cfg


def planned_stores(side: SchedulerSide, pools: Pools, req: Request, chunks: int) -> list[Any]:
    blocks = pools.take(4 * chunks)
    return list(
        side.build_connector_meta(
            step({req.request_id: (0, chunks * CHUNK)}, {req.request_id: (blocks,)})
        ).stores
    )


def test_a_producer_stores_and_never_looks_up(serve: Serve) -> None:
    side, pools = scheduler(serve, kv_config(attention()), with_role("kv_producer"))
    req = request(prompt(2, seed=40), "producer")
    store(serve, side.namespaces[0], keys_of(req))  # held by the server: a kv_both engine would load it
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.stats.totals["lookups"] == 0
    assert len(planned_stores(side, pools, req, 2)) == 1
    side.shutdown()


def test_a_consumer_loads_and_never_stores(serve: Serve) -> None:
    side, pools = scheduler(serve, kv_config(attention()), with_role("kv_consumer"))
    held = request(prompt(2, seed=41), "consumer-hit")
    store(serve, side.namespaces[0], keys_of(held))
    side.on_new_request(held)
    assert answer(side, held) == (2 * CHUNK, True)
    fresh = request(prompt(2, seed=42), "consumer-miss")
    side.on_new_request(fresh)
    assert answer(side, fresh) == (0, False)
    assert planned_stores(side, pools, fresh, 2) == []
    side.shutdown()


# -- KV-cache events -------------------------------------------------------------------------


def with_events(**over: Any) -> SimpleNamespace:
    cfg = config(**over)
    cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    return cfg


def events_of(side: SchedulerSide, *, want: int = 1, timeout: float = 10) -> list[Any]:
    """Take events until ``want`` have come (removals are read in the background)."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        out += side.take_events()
        time.sleep(0.05)
    return out


def external(hashes: Any) -> list[Any]:
    """vLLM's block hashes as its events name them (64-bit ints by default)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def confirm(side: SchedulerSide, ticket: int, *held: int) -> None:
    """Each rank's answer to store ``ticket``: the leading chunks its server holds."""
    report = WorkerReport({ticket: len(held)}, {}, {ticket: list(held)})
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))


def planned_store(side: SchedulerSide, pools: Pools, req: Request) -> Any:
    """The one store planned for ``req``, a new request the server lacks: all its whole chunks."""
    side.on_new_request(req)
    answer(side, req)
    (save,) = planned_stores(side, pools, req, len(req.prompt_token_ids) // CHUNK)
    return save


@pytest.fixture(scope="module")
def small_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """A server with room for eight of TinyEngine's chunks."""
    sock = private_dir(tmp_path_factory.mktemp("small")) / "kv.sock"
    with Serve(sock, "--max-host-bytes", str(8 * CHUNK_BYTES)) as proc:
        yield proc


def test_without_the_event_publisher_nothing_is_collected(serve: Serve) -> None:
    side, pools = scheduler(serve, kv_config(attention()))
    save = planned_store(side, pools, request(prompt(2, seed=43), "quiet"))
    confirm(side, save.ticket, 2)
    assert side.take_events() == []
    side.shutdown()


def test_stored_chunks_are_reported_once_every_rank_holds_them(serve: Serve) -> None:
    from vllm.distributed.kv_events import BlockStored

    side, pools = scheduler(serve, kv_config(attention()), with_events(tp=2))
    req = request(prompt(3, seed=44), "events")
    save = planned_store(side, pools, req)
    confirm(side, save.ticket, 3, 2)  # rank 1's server held only two of the three chunks
    (event,) = events_of(side)
    assert isinstance(event, BlockStored) and event.medium == "CPU"
    per = CHUNK // BLOCK
    assert event.block_hashes == external(req.block_hashes[: 2 * per])  # vLLM's own hashes
    assert event.token_ids == list(req.prompt_token_ids[: 2 * CHUNK])
    assert (event.block_size, event.parent_block_hash) == (BLOCK, None)
    side.shutdown()


def test_a_store_not_every_rank_answered_is_never_reported(serve: Serve) -> None:
    side, pools = scheduler(serve, kv_config(attention()), with_events(tp=2))
    save = planned_store(side, pools, request(prompt(2, seed=45), "half"))
    confirm(side, save.ticket, 2)  # one rank's answer
    assert events_of(side, timeout=0.3) == []
    confirm(side, save.ticket, 0)  # the other rank's store failed
    assert events_of(side, timeout=0.3) == []
    side.shutdown()


def test_chunks_the_server_evicts_are_reported_removed(small_serve: Serve) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    side, pools = scheduler(small_serve, kv_config(attention()), with_events())
    req = request(prompt(2, seed=46), "evicted")
    keys = keys_of(req)
    store(small_serve, side.namespaces[0], keys)  # what the workers' put would have stored
    side.on_new_request(req)
    assert answer(side, req) == (2 * CHUNK, True)  # held: a kv_both engine would load it
    req2 = request(prompt(2, seed=47), "evicted-2")
    save = planned_store(side, pools, req2)
    store(small_serve, side.namespaces[0], keys_of(req2))
    confirm(side, save.ticket, 2)
    (stored,) = events_of(side)
    assert isinstance(stored, BlockStored)
    store(small_serve, side.namespaces[0], [bytes([i]) * 32 for i in range(10)])  # evicts req2's chunks
    (removed,) = events_of(side)
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert removed.block_hashes == stored.block_hashes
    assert events_of(side, timeout=1.5) == []  # reported once
    side.shutdown()


def test_a_later_store_of_a_request_names_the_block_before_it_as_parent(serve: Serve) -> None:
    side, pools = scheduler(serve, kv_config(attention()), with_events())
    req = request(prompt(2, seed=48), "parent")
    side.on_new_request(req)
    answer(side, req)
    blocks = pools.take(8)
    (first,) = side.build_connector_meta(step({"parent": (0, CHUNK)}, {"parent": (blocks,)})).stores
    confirm(side, first.ticket, 1)
    (second,) = side.build_connector_meta(step({"parent": (CHUNK, CHUNK)}, {"parent": (blocks,)})).stores
    confirm(side, second.ticket, 1)
    a, b = events_of(side, want=2)
    per = CHUNK // BLOCK
    assert a.parent_block_hash is None and a.block_hashes == external(req.block_hashes[:per])
    assert [b.parent_block_hash] == external(req.block_hashes[per - 1 : per])
    assert b.block_hashes == external(req.block_hashes[per : 2 * per])
    side.shutdown()


# -- sleep mode and weight updates (vLLM 0.33+ calls these; the hooks exist on 0.32 too) -----


def server_holds(serve: Serve) -> int:
    """The server's fds on, and mappings of, engine memory (memfds of the cpu backend)."""
    pid = serve.proc.pid
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += "memfd:lmcache" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
    with open(f"/proc/{pid}/maps") as f:
        maps = sum("memfd:lmcache" in line for line in f)
    return fds + maps


def worker_side(serve: Serve) -> tuple[WorkerSide, torch.Tensor]:
    kv = torch.zeros((2, NUM_BLOCKS, BLOCK, 2, 64), dtype=torch.bfloat16)
    side = WorkerSide(
        config(),
        kv_config(attention()),
        # Its own namespace: the worker registers whole blocks, the other tests' TinyEngine tokens.
        Settings(socket=str(serve.socket_path), tokens_per_chunk=CHUNK, model_id="sleep-mode"),
    )
    side.register_kv_caches({"model.layers.0.attn": kv})
    until(lambda: side.state == READY)
    return side, kv


def until(pred: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def open_contexts(serve: Serve) -> int:
    with ServerClient(str(serve.socket_path), timeout=30) as c:
        return int(c.status()["server"]["contexts"])


def test_sleep_drops_every_server_mapping_and_wake_up_loads_into_the_new_memory(serve: Serve) -> None:
    until(lambda: open_contexts(serve) == 0)  # earlier tests' engines are closed by now
    before = server_holds(serve)
    side, kv = worker_side(serve)
    assert server_holds(serve) > before  # the server maps the engine's memory
    blocks = [[1, 2, 3, 4]]
    kv[:, 1:5] = torch.randn(kv[:, 1:5].shape).to(torch.bfloat16)
    stored = kv[:, 1:5].clone()
    side.wait_for_save(StepPlan(stores=[Transfer(1, "sleepy", [(b"s" * 32, blocks)])]))
    until(lambda: 1 in side.report().resolved or side.stats.totals["stored_chunks"] >= 1)
    assert side.stats.totals["stored_chunks"] == 1
    side.unregister_kv_caches()
    assert server_holds(serve) == before  # nothing of the engine's memory is mapped or held
    assert side.state != READY
    side.unregister_kv_caches()  # idempotent
    kv.zero_()  # vLLM maps fresh memory behind the same tensors on wake-up
    side.restore_kv_caches()
    until(lambda: side.state == READY)
    assert server_holds(serve) > before
    side.start_load_kv(StepPlan(loads=[Transfer(2, "awake", [(b"s" * 32, [[9, 10, 11, 12]])])]))
    finished: set[str] = set()

    def loaded() -> bool:
        finished.update(side.transfer_results()[0])
        return bool(finished)

    until(loaded)
    assert torch.equal(kv[:, 9:13], stored)  # the chunk stored before sleep, into the new memory
    side.shutdown()
    until(lambda: server_holds(serve) == before)


def test_may_load_async_only_for_an_answered_hit(serve: Serve) -> None:
    side, _ = scheduler(serve, kv_config(attention()))
    hit, miss = request(prompt(2, seed=50), "async-hit"), request(prompt(2, seed=51), "async-miss")
    store(serve, side.namespaces[0], keys_of(hit))
    assert side.may_load_async(hit) is False  # never seen: no socket call is made to find out
    side.on_new_request(hit)
    side.on_new_request(miss)
    until(lambda: side.may_load_async(hit))
    answer(side, miss)
    assert side.may_load_async(miss) is False
    producer, _ = scheduler(serve, kv_config(attention()), with_role("kv_producer"))
    producer.on_new_request(hit)
    assert producer.may_load_async(hit) is False
    side.shutdown()
    producer.shutdown()


# -- an idle engine waits for the server instead of spinning against it ----------------------


@contextlib.contextmanager
def stopped_for(serve: Serve, seconds: float) -> Iterator[None]:
    """The server process stopped (SIGSTOP) now and continued ``seconds`` later, or on exit.

    Stopped means every thread of it is (``support.procs.sigstop`` waits for that), and on
    exit the timer's SIGCONT is no longer in flight: it cannot land in a later stop.
    """
    sigstop(serve.proc.pid)
    timer = threading.Timer(seconds, os.kill, (serve.proc.pid, signal.SIGCONT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        os.kill(serve.proc.pid, signal.SIGCONT)


@pytest.fixture
def own_serve(tmp_path: Any) -> Iterator[Serve]:
    with Serve(private_dir(tmp_path) / "kv.sock") as proc:
        yield proc


def busy_scheduler(
    serve: Serve, seed: int, *rids: str, **settings: Any
) -> tuple[SchedulerSide, list[Request]]:
    """A scheduler whose engine is computing, and new requests ``rids`` (two chunks each, seeds
    from ``seed`` on) that the server holds."""
    side, _ = scheduler(serve, kv_config(attention()), **settings)
    reqs = [request(prompt(2, seed=seed + i), rid) for i, rid in enumerate(rids)]
    for req in reqs:
        store(serve, side.namespaces[0], keys_of(req))
    side.build_connector_meta(step({"other": (0, 16)}))
    return side, reqs


def test_an_idle_engine_waits_for_a_lookup_a_busy_one_asks_again(own_serve: Serve) -> None:
    side, (busy, idle) = busy_scheduler(own_serve, 60, "busy", "idle")
    with stopped_for(own_serve, 0.3):
        side.on_new_request(busy)
        assert side.get_num_new_matched_tokens(busy, 0) == (None, False)  # 10 ms: the server is stopped
    assert answer(side, busy) == (2 * CHUNK, True)
    side.build_connector_meta(step())  # a step that computed nothing
    with stopped_for(own_serve, 0.3):
        side.on_new_request(idle)
        # One pass: it waits for the answer that comes once the server continues.
        assert side.get_num_new_matched_tokens(idle, 0) == (2 * CHUNK, True)
    side.shutdown()


def test_a_busy_engine_waits_for_a_new_lookup_on_its_first_pass_only(own_serve: Serve) -> None:
    side, (soon, late) = busy_scheduler(own_serve, 62, "soon", "late", lookup_wait_ms=500)
    with stopped_for(own_serve, 0.1):
        side.on_new_request(soon)
        # Its first pass waits (500 ms at most) for the answer that comes once the server continues.
        assert side.get_num_new_matched_tokens(soon, 0) == (2 * CHUNK, True)
    with stopped_for(own_serve, 0.9):
        side.on_new_request(late)
        assert side.get_num_new_matched_tokens(late, 0) == (None, False)  # waited its 500 ms
        # The next pass asks again without waiting: a second 500 ms would see the answer.
        assert side.get_num_new_matched_tokens(late, 0) == (None, False)
    assert answer(side, late) == (2 * CHUNK, True)
    side.shutdown()


def test_new_requests_in_one_pass_share_one_wait(own_serve: Serve) -> None:
    side, (first, second) = busy_scheduler(own_serve, 64, "first", "second", lookup_wait_ms=500)
    with stopped_for(own_serve, 0.9):
        side.on_new_request(first)
        side.on_new_request(second)
        assert side.get_num_new_matched_tokens(first, 0) == (None, False)  # the pass's 500 ms
        # The same pass: nothing left to wait, so the second asks again at once.
        assert side.get_num_new_matched_tokens(second, 0) == (None, False)
        side.build_connector_meta(step({"other": (16, 16)}))  # the next pass has a budget again
        # ...which the second, not yet given any, may wait out: the answer comes meanwhile.
        assert side.get_num_new_matched_tokens(second, 0) == (2 * CHUNK, True)
    assert answer(side, first) == (2 * CHUNK, True)
    side.shutdown()


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        ({"lookup_wait_ms": -1}, r"'lookup_wait_ms'\] must be 0 or more, got -1"),
        ({"lookup_deadline_ms": 0}, r"'lookup_deadline_ms'\] must be positive, got 0"),
        ({"lease_ms": "long"}, r"'lease_ms'\] must be a number, got 'long'"),
        ({"lookup_wait_ms": True}, r"'lookup_wait_ms'\] must be 0 or more, got True"),
        ({"lookup_wait": 5}, r"unknown kv_connector_extra_config key\(s\) \['lookup_wait'\]"),
        ({"lookup_wait_ms": float("nan")}, r"'lookup_wait_ms'\] must be finite, got nan"),
        ({"lookup_deadline_ms": "inf"}, r"'lookup_deadline_ms'\] must be finite, got 'inf'"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_key(extra: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        Settings.from_extra(extra)


def test_settings_default_and_a_zero_lookup_wait() -> None:
    assert Settings.from_extra({}).lookup_wait_ms == 10
    assert Settings.from_extra({"lookup_wait_ms": 0}).lookup_wait_ms == 0


def test_a_worker_in_an_idle_step_waits_for_a_transfer_under_way(own_serve: Serve) -> None:
    side, _ = worker_side(own_serve)
    key, blocks = b"w" * 32, [[1, 2, 3, 4]]
    side.wait_for_save(StepPlan(stores=[Transfer(1, "stored", [(key, blocks)])]))
    until(lambda: 1 in side.report().resolved)
    loads = [Transfer(2, "busy", [(key, [[5, 6, 7, 8]])])]
    with stopped_for(own_serve, 0.1):
        side.start_load_kv(StepPlan(loads=loads))
        assert side.transfer_results(StepPlan()) == (set(), set())  # a step that computed: no wait
    until(lambda: side.transfer_results()[0] == {"busy"})
    loads = [Transfer(3, "idle", [(key, [[9, 10, 11, 12]])])]
    with stopped_for(own_serve, 0.1):
        side.start_load_kv(StepPlan(loads=loads, idle=True))
        # One call: it waits for the load that ends once the server continues.
        assert side.transfer_results(StepPlan(idle=True)) == ({"idle"}, set())
    side.shutdown()

"""``LMCachePlatformTier`` against the vLLM release on the path, at class level (runs in the vLLM venv).

``tests/vllm/test_vllm_versions.py`` runs this module for vLLM 0.32 as installed and
for the Python modules alone of 0.33 and 0.34 first on ``PYTHONPATH`` (as
``test_release_fit.py`` does for the connector). It checks what a release can break
without a type error: the base class and its abstract methods, the signatures of the
methods the tier overrides, vLLM's pieces it uses (``AsyncLookupManager``, ``JobResult``,
``OffloadingEvent``, the metric metadata and stats classes), and that vLLM's factory
finds the tier by module path. ``LMCACHE_VLLM_RELEASE`` names the release under test.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from lmcache_platform.vllm.tier import LMCachePlatformTier

RELEASE = os.environ.get("LMCACHE_VLLM_RELEASE", "installed")


def test_the_release_under_test_is_the_one_on_the_path() -> None:
    import vllm

    if RELEASE != "installed":
        first = os.path.realpath(os.environ["PYTHONPATH"].split(os.pathsep)[0])
        assert os.path.realpath(vllm.__file__).startswith(first + os.sep)


def test_vllms_factory_finds_the_tier_by_module_path() -> None:
    config = {"type": "LMCachePlatformTier", "module_path": "lmcache_platform.vllm.tier"}
    assert SecondaryTierFactory.get_tier_class(config) is LMCachePlatformTier


def test_no_abstract_method_is_left() -> None:
    assert issubclass(LMCachePlatformTier, SecondaryTierManager)
    assert not LMCachePlatformTier.__abstractmethods__


def test_every_method_the_tier_overrides_has_the_bases_parameters() -> None:
    own = [n for n, v in vars(LMCachePlatformTier).items() if not n.startswith("_") and inspect.isfunction(v)]
    checked = 0
    for name in own:
        base = getattr(SecondaryTierManager, name, None)
        if base is None:
            continue  # ours alone (job_latency)
        mine = list(inspect.signature(getattr(LMCachePlatformTier, name)).parameters)
        theirs = list(inspect.signature(base).parameters)
        assert mine[: len(theirs)] == theirs, (name, mine, theirs)
        checked += 1
    assert checked >= 12


def test_the_constructor_takes_what_vllms_factory_passes() -> None:
    params = inspect.signature(LMCachePlatformTier.__init__).parameters
    for name in ("offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"):
        assert name in params
    base = inspect.signature(SecondaryTierManager.__init__).parameters
    assert list(base)[1:] == ["offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector"]


def test_vllms_pieces_the_tier_uses_are_there() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import (
        Locality,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingHistogramMetadata,
    )
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

    for name in ("lookup", "flush", "cleanup", "mark_miss", "shutdown", "batch_lookup"):
        assert callable(getattr(AsyncLookupManager, name)), name
    fields = {f.name for f in dataclasses.fields(JobResult)}
    assert {"job_id", "success", "successful_keys", "transfer_time", "transfer_bytes"} <= fields
    assert {f.name for f in dataclasses.fields(OffloadingEvent)} >= {"keys", "medium", "removed", "locality"}
    assert {m.name for m in Medium} >= {"CPU", "STORAGE"} and {x.name for x in Locality} >= {
        "LOCAL",
        "REMOTE",
    }
    for method in ("increase_counter", "observe_histogram"):
        assert callable(getattr(OffloadingConnectorStats, method))
    defs = LMCachePlatformTier.build_metric_definitions({})
    assert all(isinstance(d, (OffloadingCounterMetadata, OffloadingHistogramMetadata)) for d in defs.values())


def test_the_release_specific_members() -> None:
    fields = {f.name for f in dataclasses.fields(JobResult)}
    polling = "tolerates_off_thread_polling" in vars(SecondaryTierManager)
    if RELEASE == "0.34.0":
        assert "deferred_release" in fields and polling
    if RELEASE == "0.33.0":
        assert polling
    if RELEASE == "installed":  # 0.32: neither
        assert "deferred_release" not in fields and not polling
    assert LMCachePlatformTier.tolerates_off_thread_polling is True

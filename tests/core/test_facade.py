"""The engine facade: upstream names, argument checks, all-or-nothing wrapping, test helpers."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import CacheContextConfig, EngineGroupInfo, EngineType, LayoutHints
from lmcache_platform.testing import fake_backend
from support.fakes import context_class, wrapper_class
from support.imports import fresh_run
from support.plugins import backend_class


@pytest.fixture
def fakes(lmcache_registry):
    made = {}
    for device in ("cpu", "cuda"):
        made[device] = (context_class(device), wrapper_class(device))
        lmcache_registry.install(
            device, fake_backend(device, context_class=made[device][0], wrapper_class=made[device][1])
        )
    return made


def test_create_cache_context_dispatches_and_forwards_a_frozen_config(fakes):
    wrappers = [fakes["cpu"][1].wrap(torch.zeros(2, 4, 16, 2, 8)) for _ in range(3)]
    infos = [EngineGroupInfo(layer_indices=[0, 1, 2], block_size=16)]
    hints = LayoutHints(kv_format=lp.KVFormat.FLASH_ATTN)
    ctx = lp.create_cache_context(wrappers, 128, hints, infos, EngineType.SGLANG, False, True)
    assert type(ctx) is fakes["cpu"][0]
    assert ctx.kv_caches == wrappers
    assert ctx.config == CacheContextConfig(
        lmcache_tokens_per_chunk=128,
        layout_hints=hints,
        engine_group_infos=tuple(infos),
        engine_type=EngineType.SGLANG,
        separate_object_groups=False,
        full_sw_kv=True,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.config.full_sw_kv = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        CacheContextConfig(128)  # type: ignore[misc]  # keyword-only


def test_create_cache_context_errors(fakes, lmcache_registry):
    with pytest.raises(ValueError, match="non-empty"):
        lp.create_cache_context([])
    mixed = [fakes["cpu"][1].wrap(torch.zeros(1)), fakes["cuda"][1].wrap(torch.zeros(1))]
    with pytest.raises(ValueError, match="share one device type"):
        lp.create_cache_context(mixed)
    xpu = wrapper_class("xpu")
    with pytest.raises(ValueError, match="No cache-context class registered"):
        lp.create_cache_context([xpu.wrap(torch.zeros(1))])
    with pytest.raises(ValueError, match="must be positive"):
        lp.create_cache_context([fakes["cpu"][1].wrap(torch.zeros(1))], 0)


def test_wrap_kv_caches_wraps_each_layer_by_its_device(fakes):
    tensors = [torch.zeros(2, 3), torch.ones(4)]
    wrappers = lp.wrap_kv_caches(tensors)
    assert [type(w) for w in wrappers] == [fakes["cpu"][1]] * 2
    assert [w.to_tensor() is t for w, t in zip(wrappers, tensors, strict=True)] == [True, True]


def test_wrap_kv_caches_releases_partial_work_and_names_the_layer(lmcache_registry):
    closed = []

    class Tracked(wrapper_class("cpu")):  # type: ignore[misc]  # a class made at run time
        def release(self) -> None:
            closed.append(self.shape)

        @classmethod
        def wrap(cls, tensor):
            if tensor.dim() == 3:
                raise RuntimeError("cannot share this one")
            return super().wrap(tensor)

    lp.register_kv_wrapper("cpu", Tracked.wrap)
    with pytest.raises(lp.WrapError) as excinfo:
        lp.wrap_kv_caches([torch.zeros(1), torch.zeros(2), torch.zeros(1, 1, 1), torch.zeros(3)])
    assert excinfo.value.layer == 2
    assert "layer 2" in str(excinfo.value) and "cannot share this one" in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert closed == [(2,), (1,)]  # both earlier wrappers, newest first


def test_snapshot_restore_of_the_context_table(fakes):
    ctx_cls = lp.snapshot_backends  # upstream name
    lp.get_kv_wrapper_factory("cpu")
    lp.create_cache_context([fakes["cpu"][1].wrap(torch.zeros(1))])
    state = ctx_cls()
    assert state.entries == {"cpu": fakes["cpu"][0]} and state.discovered is False

    lp.restore_backends({})  # deterministic "nothing registered", no discovery
    with pytest.raises(ValueError, match="No cache-context class registered"):
        lp.create_cache_context([fakes["cuda"][1].wrap(torch.zeros(1))])
    other = context_class("cpu")
    lp.restore_backends({"cpu": other})
    assert type(lp.create_cache_context([fakes["cpu"][1].wrap(torch.zeros(1))])) is other

    lp.restore_backends(state)  # taken before discovery of cuda: discovery runs again
    ctx = lp.create_cache_context([fakes["cuda"][1].wrap(torch.zeros(1))])
    assert type(ctx) is fakes["cuda"][0]


def test_snapshot_restore_reset_of_the_wrapper_table(fakes):
    before = lp.snapshot()
    assert before.entries == {} and not before.discovered
    fake = wrapper_class("cpu").wrap
    lp.restore({"cpu": fake})
    assert lp.get_kv_wrapper_factory("cpu") == fake
    with pytest.raises(ValueError, match="No KV-cache wrapper factory registered"):
        lp.get_kv_wrapper_factory("cuda")  # restored tables count as discovered
    lp.reset_for_tests()
    assert backend_class(lp.get_kv_wrapper_factory("cuda")) is fakes["cuda"][1]
    lp.restore(before)
    assert lp.snapshot().entries == {}


def test_create_cache_context_takes_exactly_the_engine_fields_of_the_config():
    import inspect

    from lmcache_platform._types import ENGINE_KEYWORDS

    params = list(inspect.signature(lp.create_cache_context).parameters.values())[1:]
    assert [p.name for p in params] == list(ENGINE_KEYWORDS)
    defaults = {f.name: getattr(CacheContextConfig(), f.name) for f in dataclasses.fields(CacheContextConfig)}
    for p in params:  # the facade's defaults are the config's (tuples may be spelled as ())
        assert p.default == defaults[p.name], p.name
    assert "max_batch_size" not in ENGINE_KEYWORDS  # the server's, not the engine's


def test_import_is_light_and_lazy():
    heavy = {"torch", "lmcache_platform_cpu", "lmcache_platform_cuda", "numpy"}
    assert sorted(fresh_run("import lmcache_platform").modules & heavy) == []


def test_resolving_cpu_never_imports_cuda():
    modules = fresh_run("import torch, lmcache_platform as lp; lp.get_kv_wrapper_factory('cpu')").modules
    assert "lmcache_platform_cuda" not in modules and "lmcache_platform_cpu" in modules


def test_wrap_kv_caches_preflights_each_device_batch_before_wrapping(lmcache_registry):
    seen, wrapped = [], []

    class Checked(wrapper_class("cpu")):  # type: ignore[misc]  # a class made at run time
        @classmethod
        def preflight(cls, tensors):
            seen.append([tuple(t.shape) for t in tensors])
            if len(tensors) > 2:
                raise OSError("not enough shared memory for the batch")

        @classmethod
        def wrap(cls, tensor):
            wrapped.append(tensor)
            return super().wrap(tensor)

    lp.register_kv_wrapper("cpu", Checked.wrap)
    lp.wrap_kv_caches([torch.zeros(1), torch.zeros(2)])
    assert seen == [[(1,), (2,)]] and len(wrapped) == 2
    with pytest.raises(OSError, match="not enough shared memory"):
        lp.wrap_kv_caches([torch.zeros(1), torch.zeros(2), torch.zeros(3)])
    assert len(wrapped) == 2  # nothing wrapped for the failing batch


def test_default_backend_names_the_device_type_that_is_always_available():
    """The seed's public sentinel: engines import it as the fall-back device type."""
    code = (
        "import torch, lmcache_platform as lp\n"
        "from lmcache_platform import DEFAULT_BACKEND\n"
        "info = lp.selected_backend(DEFAULT_BACKEND)\n"
        "print(DEFAULT_BACKEND, torch.empty(0).device.type, info.name, info.status.value)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_PLATFORM_")}
    assert fresh_run(code, env).stdout.split() == ["cpu", "cpu", "cpu", "ok"]
    assert "DEFAULT_BACKEND" in lp.__all__

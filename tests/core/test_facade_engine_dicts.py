"""The facade takes what engines pass: vLLM's ``dict[layer_name, Tensor]`` and SGLang's K/V pairs.

Wrapping goes through the test kit's fake CPU backend (an in-process wrapper); the
cache context built from the result is the real base machinery on host tensors.
"""

from __future__ import annotations

import pytest
import torch

import lmcache_platform as lp
from lmcache_platform import EngineGroupInfo, KVFormat, LayoutError, LayoutHints
from lmcache_platform.testing import fake_backend
from support.cache import HeldWrapper, HostContext

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


@pytest.fixture
def held(lmcache_registry):
    lmcache_registry.install("cpu", fake_backend("cpu", context_class=HostContext, wrapper_class=HeldWrapper))


def vllm_layers(n: int = 3) -> list[torch.Tensor]:
    return lp.allocate_kv_caches(  # type: ignore[return-value]
        KVFormat.VLLM,
        num_layers=n,
        num_blocks=6,
        block_size=4,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float16,
    )


def test_a_dict_in_gives_a_dict_out_in_the_same_order(held):
    layers = vllm_layers()
    kv = {name: t for name, t in zip(reversed(NAMES), layers, strict=True)}
    wrapped = lp.wrap_kv_caches(kv)
    assert list(wrapped) == list(kv)
    assert all(wrapped[n].to_tensor() is kv[n] for n in kv)
    ctx = lp.create_cache_context(wrapped, 8)
    assert ctx.config.layer_names == tuple(reversed(NAMES))
    assert ctx.kv_caches == list(wrapped.values())
    ctx.close()


def test_errors_of_a_dict_registration_name_the_engine_layer(held):
    layers = vllm_layers(2)
    bad = {NAMES[0]: layers[0], NAMES[1]: layers[1], NAMES[2]: torch.zeros(2, 3, 4, 5)}
    wrapped = lp.wrap_kv_caches(bad)
    with pytest.raises(LayoutError, match=r"layer 2 \(model\.layers\.2\.self_attn\.attn\)"):
        lp.create_cache_context(wrapped, 8)
    assert all(w.closed for w in wrapped.values())  # a failed context closes what it took
    with pytest.raises(ValueError, match="not both"):
        lp.create_cache_context(
            lp.wrap_kv_caches(dict(zip(NAMES, vllm_layers(), strict=True))), layer_names=NAMES
        )


def test_wrap_error_carries_the_layer_name_and_nothing_is_left_open(lmcache_registry):
    made: list[HeldWrapper] = []

    class Refuses(HeldWrapper):
        @classmethod
        def wrap(cls, tensor):
            if tensor.dim() == 1:
                raise RuntimeError("no export for this one")
            w = super().wrap(tensor)
            made.append(w)
            return w

    lmcache_registry.install("cpu", fake_backend("cpu", context_class=HostContext, wrapper_class=Refuses))
    kv = {NAMES[0]: torch.zeros(2, 2, 2, 4), NAMES[1]: torch.zeros(3), NAMES[2]: torch.zeros(2, 2, 2, 4)}
    with pytest.raises(lp.WrapError) as err:
        lp.wrap_kv_caches(kv)
    assert (err.value.layer, err.value.layer_name) == (1, NAMES[1])
    assert "layer 1 (model.layers.1.self_attn.attn)" in str(err.value)
    assert len(made) == 1 and made[0].closed


def test_pairs_become_pairs_of_wrappers_and_round_trip(held):
    pools = lp.allocate_kv_caches(
        KVFormat.SGLANG,
        num_layers=2,
        num_blocks=6,
        block_size=4,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float16,
    )
    for k, v in pools:
        k.copy_(torch.arange(k.numel(), dtype=torch.float16).view(k.shape))
        v.copy_(-torch.arange(v.numel(), dtype=torch.float16).view(v.shape))
    wrapped = lp.wrap_kv_caches(pools)
    assert all(isinstance(e, tuple) and len(e) == 2 for e in wrapped)
    infos = [EngineGroupInfo(layer_indices=[0, 1], block_size=4)]
    with lp.create_cache_context(wrapped, 8, LayoutHints(kv_format=KVFormat.SGLANG), infos) as ctx:
        want = [(k[4:12].clone(), v[4:12].clone()) for k, v in pools]
        ctx.store_chunk([[1, 2]])
        for k, v in pools:
            k.zero_()
            v.zero_()
        ctx.retrieve_chunk([[1, 2]])
        for (k, v), (wk, wv) in zip(pools, want, strict=True):
            assert torch.equal(k[4:12], wk) and torch.equal(v[4:12], wv)
            assert not k[:4].any() and not v[12:].any()

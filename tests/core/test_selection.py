"""Selection rules per device type, with fake backends installed like entry points."""

from __future__ import annotations

from typing import Any

import pytest

import lmcache_platform as lp
from lmcache_platform import Availability, Status
from lmcache_platform.testing import RegistryFixture, fake_backend
from support.fakes import backend, context_class, wrapper_class
from support.plugins import backend_class


def owner(device: str) -> Any:
    return backend_class(lp.get_kv_wrapper_factory(device))


def choose_unavailable(registry: RegistryFixture, variant: str, reason: str) -> lp.BackendUnavailableError:
    """Install ``cpu`` and a ``variant`` whose probe declines with ``reason``, choose the variant
    explicitly: the error resolving ``cpu`` then raises (it must not fall back to ``cpu``)."""
    registry.install("cpu", backend("cpu"))
    registry.install(variant, backend("cpu", probe=Availability.no(reason)))
    registry.setenv("LMCACHE_PLATFORM_BACKEND", variant)
    with pytest.raises(lp.BackendUnavailableError) as excinfo:
        owner("cpu")
    return excinfo.value


def test_single_candidate_is_used(lmcache_registry):
    plugin = backend("cpu")
    lmcache_registry.install("cpu", plugin)
    assert owner("cpu") is plugin.lmcache_platform_ipc_wrapper_class("cpu")
    info = lmcache_registry.registry.selected_backend("cpu")
    assert (info.name, info.distribution, info.status) == ("cpu", "fake-backend", Status.OK)


def test_two_variants_are_ambiguous_until_one_is_chosen(lmcache_registry):
    a, b = backend("cpu", tag="a/1"), backend("cpu", tag="b/1")
    lmcache_registry.install("cpu.fast", a, distribution="dist-a")
    lmcache_registry.install("cpu.file", b, distribution="dist-b")
    with pytest.raises(lp.AmbiguousBackendError) as excinfo:
        owner("cpu")
    assert excinfo.value.candidates == ("cpu.fast", "cpu.file")
    assert "LMCACHE_PLATFORM_BACKEND" in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)

    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cuda.raw,cpu.file")
    assert owner("cpu").wire_tag == "b/1"


def test_explicit_choice_never_falls_back(lmcache_registry):
    error = choose_unavailable(lmcache_registry, "cpu.file", "dir missing")
    assert error.reasons == {"cpu.file": "dir missing"}
    assert "other installed backends of this type: cpu" in str(error)

    lmcache_registry.setenv("LMCACHE_PLATFORM_BACKEND", "cpu.nope")
    with pytest.raises(lp.BackendUnavailableError, match="not installed"):
        owner("cpu")


def test_unavailable_backends_are_not_candidates(lmcache_registry):
    lmcache_registry.install("cuda", backend("cuda", probe=Availability.no("no CUDA device visible")))
    lmcache_registry.install("cuda.rocm", backend("cuda", probe=Availability.no("not a HIP build")))
    with pytest.raises(lp.BackendUnavailableError) as excinfo:
        owner("cuda")
    assert excinfo.value.reasons == {"cuda": "no CUDA device visible", "cuda.rocm": "not a HIP build"}
    assert "no CUDA device visible" in str(excinfo.value)
    lmcache_registry.install("cuda.sim", backend("cuda"))
    assert owner("cuda").wire_tag == "cuda.fake/1"


@pytest.mark.parametrize(
    ("device", "wheel"), [("cpu", "lmcache-platform-cpu"), ("cuda", "lmcache-platform-cuda")]
)
def test_not_found_says_which_wheel_to_install(lmcache_registry, device, wheel):
    lmcache_registry.install("xpu", backend("xpu"))
    with pytest.raises(lp.BackendNotFoundError) as excinfo:
        lp.get_kv_wrapper_factory(device)
    message = str(excinfo.value)
    assert f"pip install {wheel}" in message and "Installed backends: xpu" in message
    assert excinfo.value.device_type == device


def test_not_found_for_unknown_device_type(lmcache_registry):
    with pytest.raises(ValueError, match="No KV-cache wrapper factory registered for device type 'tpu'"):
        lp.get_kv_wrapper_factory("tpu")


def test_backend_declining_its_device_type_is_unavailable(lmcache_registry):
    lmcache_registry.install("npu", fake_backend("npu"))  # returns no classes
    with pytest.raises(lp.BackendUnavailableError, match="provides no classes"):
        owner("npu")


def test_manual_registration_is_validated_and_rolled_back(lmcache_registry):
    bad = backend("xpu", api_version=99)
    with pytest.raises(lp.ApiVersionError):
        lp.register_backend(bad, "xpu")
    assert lmcache_registry.registry.backends() == []
    assert dict(lmcache_registry.registry.plugins()) == {}

    good = backend("xpu")
    lp.register_backend(good, "xpu")
    assert owner("xpu") is good.lmcache_platform_ipc_wrapper_class("xpu")
    with pytest.raises(ValueError, match="already registered"):
        lp.register_backend(good, "xpu")
    lp.unregister_backend("xpu")
    with pytest.raises(lp.BackendNotFoundError):
        owner("xpu")


def test_register_kv_wrapper_overrides_backends(lmcache_registry):
    lmcache_registry.install("cpu", backend("cpu"))

    def factory(tensor: Any) -> Any:
        return tensor

    lp.register_kv_wrapper("cpu", factory)
    assert lp.get_kv_wrapper_factory("cpu") is factory


def test_resolved_factory_is_cached_without_pluggy(lmcache_registry, monkeypatch):
    lmcache_registry.install("cpu", backend("cpu"))
    first = lp.get_kv_wrapper_factory("cpu")
    registry = lmcache_registry.registry
    monkeypatch.setattr(registry, "_select", lambda *a: pytest.fail("re-selected"))
    monkeypatch.setattr(registry.engine, "call", lambda *a, **k: pytest.fail("hook called"))
    assert lp.get_kv_wrapper_factory("cpu") == first


def test_wire_classes_allow_list(lmcache_registry):
    raw = wrapper_class("cuda", "cuda.raw/1")
    default = wrapper_class("cuda", "cuda.torch/1")
    lmcache_registry.install(
        "cuda",
        fake_backend(
            "cuda", context_class=context_class("cuda"), wrapper_class=default, wire_classes=[default, raw]
        ),
    )
    assert lmcache_registry.registry.wire_classes_for("cuda") == {"cuda.torch/1": default, "cuda.raw/1": raw}
    with pytest.raises(lp.BackendNotFoundError):
        lmcache_registry.registry.wire_classes_for("cpu")


def test_an_unavailable_explicit_choice_says_what_is_true(lmcache_registry):
    """A vendor's variant, chosen but declined by its probe: registered, unavailable, why, what to do."""
    error = choose_unavailable(lmcache_registry, "cpu.hugetlb", "vm.nr_hugepages is 0")
    assert str(error) == (
        "LMCACHE_PLATFORM_BACKEND chooses 'cpu.hugetlb' for device type 'cpu', but it cannot serve: "
        "'cpu.hugetlb' is registered but unavailable here: vm.nr_hugepages is 0. An explicit choice "
        "never falls back: fix that, or take 'cpu.hugetlb' out of LMCACHE_PLATFORM_BACKEND to let the "
        "selection rule choose among the other installed backends of this type: cpu."
    )
    assert error.reasons == {"cpu.hugetlb": "vm.nr_hugepages is 0"}


def test_nothing_usable_says_each_backend_is_registered_and_why_not(lmcache_registry):
    lmcache_registry.install("cuda", backend("cuda", probe=Availability.no("no CUDA device visible")))
    lmcache_registry.install("cuda.sim", fake_backend("cuda", api_version=0))
    lmcache_registry.setenv("LMCACHE_PLATFORM_DISABLE", "cuda.off")
    lmcache_registry.install("cuda.off", backend("cuda"))
    with pytest.raises(lp.BackendUnavailableError) as excinfo:
        owner("cuda")
    message = str(excinfo.value)
    assert message.startswith("No backend can serve device type 'cuda' here: ")
    assert "'cuda' is registered but unavailable here: no CUDA device visible" in message
    assert "'cuda.off' is registered but disabled by LMCACHE_PLATFORM_DISABLE" in message
    assert "backend 'cuda.sim' from fake-backend 0.0 targets backend API 0" in message


def test_the_primary_suggests_only_variants_that_may_serve(lmcache_registry):
    lmcache_registry.install("cpu", backend("cpu"))
    lmcache_registry.install("cpu.hugetlb", backend("cpu", probe=Availability.no("vm.nr_hugepages is 0")))
    lmcache_registry.install("cpu.file", backend("cpu"))
    assert lp.selected_backend("cpu").why_selected == (
        "the primary backend; to use one of cpu.file, cpu.hugetlb instead, set LMCACHE_PLATFORM_BACKEND=<name>"
    )  # nothing loaded yet: the variants' probes have not spoken
    infos = {i.name: i for i in lp.list_backends()}  # loads every backend
    assert infos["cpu"].why_selected == (
        "the primary backend; to use cpu.file instead, set LMCACHE_PLATFORM_BACKEND=cpu.file; "
        "cpu.hugetlb is unavailable"
    )

"""UUID <-> ordinal mapping of the CUDA backend.

No GPU here: ``FakeDevices`` (support.cuda_fakes) stands in for CUDA device enumeration,
which is the only part that needs hardware; the table and its errors are real.
"""

from __future__ import annotations

import threading

import pytest

from lmcache_platform import DescriptorError
from lmcache_platform_cuda._devices import DEVICES
from support.cuda_fakes import UUIDS, FakeDevices


def test_reordered_visible_devices_map_by_uuid(fake_devices: FakeDevices) -> None:
    # The producer sees [A, B, C]; this process was started with the order reversed.
    fake_devices.set(UUIDS[::-1])
    assert [DEVICES.ordinal_of(u) for u in UUIDS] == [2, 1, 0]
    assert DEVICES.uuid_of(0) == UUIDS[2]


def test_unknown_uuid_names_it_and_the_visible_devices(
    fake_devices: FakeDevices, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    fake_devices.set(UUIDS[:2])
    with pytest.raises(DescriptorError) as info:
        DEVICES.ordinal_of(UUIDS[2])
    message = str(info.value)
    assert UUIDS[2] in message
    assert f"0={UUIDS[0]}" in message and f"1={UUIDS[1]}" in message
    assert "CUDA_VISIBLE_DEVICES='0,1'" in message


def test_no_visible_device_gets_its_own_actionable_message(
    fake_devices: FakeDevices, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    fake_devices.set([])
    with pytest.raises(DescriptorError, match="sees no CUDA device") as info:
        DEVICES.ordinal_of(UUIDS[0])
    assert UUIDS[0] in str(info.value) and "CUDA_VISIBLE_DEVICES=''" in str(info.value)


def test_ordinal_out_of_range_is_refused(fake_devices: FakeDevices) -> None:
    fake_devices.set(UUIDS[:1])
    with pytest.raises(DescriptorError, match="ordinal 1 is not visible"):
        DEVICES.uuid_of(1)


def test_enumerates_once_under_racing_first_lookups(fake_devices: FakeDevices) -> None:
    fake_devices.set(UUIDS)
    barrier = threading.Barrier(32)
    results: list[int] = []

    def lookup() -> None:
        barrier.wait()
        results.append(DEVICES.ordinal_of(UUIDS[1]))

    threads = [threading.Thread(target=lookup) for _ in range(32)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [1] * 32
    assert fake_devices.calls == 1
    DEVICES.ordinal_of(UUIDS[0])
    assert fake_devices.calls == 1  # cached: the visible set cannot change in a process

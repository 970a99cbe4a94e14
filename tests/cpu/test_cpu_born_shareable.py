"""A KV cache born in exported memory (``HostMemoryIPCWrapper.empty``): no copy, every view aliases.

A cache allocated with ``empty`` is already where the export is: wrapping costs no
memory and every view the engine derives, wrapped or not, and the flat buffer itself
alias what the consumer maps. A large cache torch allocated gets the same by having the
export mapped over its own pages, a slice at a time (``test_cpu_in_place.py``). Peak
memory is measured in a fresh process (``VmHWM``, its peak resident set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lmcache_platform.hostmem import Headroom, HostMemoryIPCWrapper
from lmcache_platform_cpu import CpuMemfdIPCWrapper, CpuShmIPCWrapper, MemfdCapacityError, _memfd

KINDS = [CpuMemfdIPCWrapper, CpuShmIPCWrapper]


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.wire_tag)
def test_every_view_of_a_born_shareable_cache_aliases_the_export(cls: type[HostMemoryIPCWrapper]) -> None:
    flat = cls.empty(8 * 1024, dtype=torch.int32)
    assert flat.is_contiguous() and flat.shape == (8192,) and int(flat.abs().sum()) == 0
    layers = [flat[i * 1024 : (i + 1) * 1024].view(4, 256) for i in range(8)]
    address = flat.data_ptr()
    wrappers = [cls.wrap(t) for t in layers[:4]]  # only half of the layers are wrapped
    assert flat.data_ptr() == address and layers[0].data_ptr() == address  # nothing moved
    assert len({tuple(sorted(w.handle.items())) for w in wrappers}) == 1
    seen = cls.from_fields(wrappers[0].fields()).to_tensor()
    flat[3] = 7  # through the flat buffer
    layers[0][0, 5] = 8  # through a wrapped view
    derived = layers[0].view(-1)[10:20]  # a view the engine derived itself
    derived[0] = 9
    assert seen[0, 3].item() == 7 and seen[0, 5].item() == 8 and seen[0, 10].item() == 9
    seen[1, 0] = -1  # and back
    assert flat[256].item() == -1
    del seen
    for w in wrappers:
        w.close()


def test_the_memory_goes_with_the_cache_and_an_empty_cache_needs_none() -> None:
    fds = _memfd.owned()
    cache = CpuMemfdIPCWrapper.empty(2, 3, 64, dtype=torch.bfloat16)
    assert cache.shape == (2, 3, 64) and len(_memfd.owned() - fds) == 1
    w = CpuMemfdIPCWrapper.wrap(cache[1])
    w.close()
    assert len(_memfd.owned() - fds) == 0  # the last export closed: the fd is closed
    assert cache.sum().item() == 0  # the cache itself is untouched
    del cache
    assert CpuMemfdIPCWrapper.empty(0, 4, dtype=torch.float16).shape == (0, 4)
    assert _memfd.owned() == fds


def test_a_cache_that_does_not_fit_is_refused_before_anything_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_memfd, "memory_headroom", lambda: Headroom(1 << 20, "a test limit"))
    fds = _memfd.owned()
    with pytest.raises(
        MemfdCapacityError, match=r"a memfd of 4\.0 MiB does not fit: a test limit leaves 1\.0 MiB"
    ):
        CpuMemfdIPCWrapper.empty(1 << 20, dtype=torch.float32)
    assert _memfd.owned() == fds


#: In a fresh process: peak RSS (VmHWM) added by wrapping 32 per-layer views of one
#: cache, allocated by torch (shared in place) or born in exported memory.
PEAK = r"""
import json, os, sys
import torch
import lmcache_platform as lp
from lmcache_platform_cpu import CpuMemfdIPCWrapper

nbytes = int(sys.argv[2])
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking (pytest) process.
peak = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
if sys.argv[1] == "born":
    flat = CpuMemfdIPCWrapper.empty(nbytes, dtype=torch.uint8)
else:
    flat = torch.empty(nbytes, dtype=torch.uint8)
flat.fill_(1)  # every page touched: the cache is resident
layers = [t.view(-1) for t in flat.chunk(32)]
before = peak()
wrappers = lp.wrap_kv_caches(layers)
print(json.dumps({"before": before, "added": peak() - before, "exports": len({w.memfd_ino for w in wrappers})}))
"""


def peak_added(how: str, nbytes: int) -> dict[str, int]:
    env = {**os.environ, "LMCACHE_PLATFORM_CPU_IPC": "memfd"}
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, how, str(nbytes)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, int] = json.loads(proc.stdout)
    return out


def test_wrapping_a_born_shareable_cache_adds_no_peak_memory(request: pytest.FixtureRequest) -> None:
    nbytes = 256 << 20
    born, in_place = peak_added("born", nbytes), peak_added("in place", nbytes)
    assert born["exports"] == in_place["exports"] == 1
    # The mechanism's bound (one slice at a time), not a speed: at most 5 % or 64 MiB.
    assert born["added"] <= max(nbytes // 20, 64 << 20), born
    assert in_place["added"] <= max(nbytes // 20, 64 << 20), in_place
    print(
        f"\n[peak memory] wrapping a {nbytes >> 20} MiB cache cut into 32 layers: born shareable "
        f"+{born['added'] / 2**20:.0f} MiB, allocated by torch and shared in place "
        f"+{in_place['added'] / 2**20:.0f} MiB (VmHWM)"
    )

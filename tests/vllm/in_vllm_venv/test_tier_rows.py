"""``LMCachePlatformTier``'s rows kept straight in a store (``"remote"`` mode), in process (runs in the vLLM venv).

vLLM's primary region is a ``(rows, bytes)`` view whose rows may lie further apart than
their bytes; the tier copies each row as bytes (never with torch, whose copies in vLLM's
process fan out over the engine's busy threads). A real file store under ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lmcache_platform.remote._tier import RemoteTier
from lmcache_platform.vllm._tier_backends import StoreRows

ROWS, ROW_BYTES = 8, 4096


@pytest.mark.parametrize("gap", [0, 512])
def test_rows_round_trip_through_a_file_store_and_padding_is_never_touched(tmp_path: Path, gap: int) -> None:
    tier = RemoteTier.open(f"file://{tmp_path / 'kv'}", prefix="rows")
    assert tier.wait_ready(10)
    region = np.random.default_rng(7).integers(0, 256, (ROWS, ROW_BYTES + gap), dtype=np.uint8)
    rows = StoreRows(tier, region[:, :ROW_BYTES].data, b"n" * 16, timeout_ms=10_000)
    try:
        keys = [b"%032d" % i for i in range(ROWS)]
        rows.store(keys, list(range(ROWS)))
        before = region.copy()
        region[:, :ROW_BYTES] = 0
        assert rows.load(keys, list(reversed(range(ROWS)))) == ROWS
        assert (region[:, :ROW_BYTES] == before[::-1, :ROW_BYTES]).all()  # each row where asked
        assert (region[:, ROW_BYTES:] == before[:, ROW_BYTES:]).all()  # the gaps untouched
        region[2:, :ROW_BYTES] = 0
        (
            tmp_path
            / "kv"
            / sorted(p.name for p in (tmp_path / "kv").iterdir() if p.name.startswith("e."))[3]
        ).unlink()
        assert rows.load(keys, list(range(ROWS))) == 3  # the leading entries, up to the missing one
    finally:
        rows.close()

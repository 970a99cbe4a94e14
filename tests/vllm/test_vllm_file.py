"""A disk tier with real vLLM engines: KV that outlives the server, and damage that is never served.

``lmcache-platform serve --remote file:///DIR`` (the ``lmcache-platform-file-store``
distribution). Engine A stores a prompt; the server stops cleanly (its write-behind
queue drained to disk) and a new one starts on the same directory with empty memory; a
fresh engine B loads A's prefix from disk and gives A's own prefix-hit output, tokens and
top-5 logprobs. Then entry files are damaged in place: the server refuses and deletes
them, B recomputes and gives the no-connector output.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support import vllm_driver as drv
from support.vllm_driver import Lab, brief, connected, connector_tokens, expect, prompt, same, store, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-file")]


def entries(disk: Path) -> list[Path]:
    return sorted((p for p in disk.iterdir() if p.name.startswith("e.")), key=lambda p: p.stat().st_mtime_ns)


def wait_entries(disk: Path, n: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while len(entries(disk)) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(entries(disk))


def test_a_fresh_engine_loads_from_disk_after_a_restart_and_damage_is_recomputed(
    lab: Lab, ref_gqa, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    server = lab.server("file-tier", args=["--remote", f"file://{disk}"])
    try:
        a = lab.engine("file-a", connected("gqa", server))
        p = prompt(tokens(drv.L3, 91))
        store(a, server, p, chunks=3)
        a_hit = a.run(p)  # A's own prefix-cache hit: the reference for a hit of 768 tokens
        on_disk = wait_entries(disk, 3)
        lab.retire("file-a")
        server.restart()  # SIGTERM (the queue drains), then a new server: its memory is empty
        b = lab.engine("file-b", connected("gqa", server))
        drv.wait_contexts(server)
        drv.wait_linked(b)
        loaded = b.cold(p)
        after_restart = server.status()

        q = prompt(tokens(drv.L3, 92))
        ref_q = ref_gqa.cold(q)
        store(b, server, q, chunks=3)
        wait_entries(disk, 6)
        server.restart()
        drv.wait_contexts(server)  # B's workers register again by themselves (no request needed)
        drv.wait_linked(b)
        for path in entries(disk)[-3:]:  # q's chunks: the newest entries
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        damaged = b.cold(q)
        status = server.status()
        b_counters = b.stats()["counters"]
        left = len(entries(disk))
    finally:
        lab.retire("file-a", "file-b")
        lab.retire_server("file-tier")
    refused = sum(v for k, v in status["remote"].items() if k.startswith("refused_"))
    observed = {
        "on_disk": on_disk,
        "loaded": brief(loaded),
        "remote_loaded_after_restart": after_restart["remote_loaded"],
        "damaged": brief(damaged),
        "refused": refused,
        "removed": status["remote"].get("removed_refused"),
        "entries_left": left,
        "remote_status": status["remote"],
        "engine_b_connector": b_counters,
    }
    expect(
        observed,
        stored_on_disk=on_disk >= 3,
        fresh_engine_loaded_from_disk=connector_tokens(loaded) == 3 * 256
        and after_restart["remote_loaded"] >= 3,
        equal_to_a_hit=same(loaded, a_hit),
        damage_refused_and_removed=refused >= 1 and (status["remote"].get("removed_refused") or 0) >= 1,
        damaged_output_equal_to_no_connector=same(damaged, ref_q),
        damaged_request_finished=damaged["finish_reason"] != "error",
    )

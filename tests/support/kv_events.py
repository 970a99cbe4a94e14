"""A subscriber to vLLM's KV-cache event stream, as a cache-aware router runs one.

Run with the vLLM virtualenv's Python (it has ``zmq`` and ``msgspec``)::

    python -m support.kv_events ENDPOINT OUT

connects a ZMQ ``SUB`` socket to ``ENDPOINT`` (where the engine's publisher binds,
e.g. ``ipc:///dir/events``), decodes each batch with vLLM's own ``KVEventBatch`` and
appends one JSON line per event to ``OUT``: ``{"type", "medium", "block_hashes",
"token_ids"?, "parent_block_hash"?}``. :class:`Subscriber` starts and reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from support.vllm_engines import ROOT, vllm_python


class Subscriber:
    """The subscriber process, started before the engine that publishes."""

    def __init__(self, endpoint: str, out: Path) -> None:
        self.out = out
        out.write_text("")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
        self.proc = subprocess.Popen(
            [str(vllm_python()), "-m", "support.kv_events", endpoint, str(out)], env=env, cwd=ROOT
        )

    def wait_connected(self, timeout: float = 120) -> None:
        """Until the subscriber has imported vLLM and connected (events before that are lost)."""
        deadline = time.monotonic() + timeout
        while not self.out.with_suffix(".connected").exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, "the subscriber did not start"
            time.sleep(0.1)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line]

    def wait(self, pred: Any, timeout: float = 30) -> list[dict[str, Any]]:
        """Events once ``pred(events)`` holds (or what came by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            seen = self.events()
            if pred(seen) or time.monotonic() > deadline:
                return seen
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _hash(h: Any) -> Any:
    return h.hex() if isinstance(h, bytes) else h


def main(endpoint: str, out: str) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.Context().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    Path(out).with_suffix(".connected").write_text("")
    while True:
        _topic, _seq, payload = sock.recv_multipart()
        batch = decoder.decode(payload)
        with open(out, "a") as f:
            for event in batch.events:
                row: dict[str, Any] = {
                    "type": type(event).__name__,
                    "medium": getattr(event, "medium", None),
                    "block_hashes": [_hash(h) for h in getattr(event, "block_hashes", [])],
                }
                if hasattr(event, "token_ids"):
                    row["token_ids"] = list(event.token_ids)
                    row["parent_block_hash"] = _hash(event.parent_block_hash)
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""KV-cache events for routers: the chunks this engine stored in the server, and those it let go.

A cache-aware router follows vLLM's KV-event stream (``kv_events_config``) to know
which prefixes an engine can serve without computing them. vLLM publishes what the
connector's :meth:`take_events` returns beside its own block events, so the router
also sees what the server holds for this engine:

* ``BlockStored`` with medium ``"CPU"`` (the server's host memory) once every rank's
  store of a chunk was answered and the server holds it, naming vLLM's own block
  hashes of the chunk's tokens (the hashes the router already knows from the engine's
  ``"GPU"`` events), the tokens, the block size of those hashes, the parent block's
  hash and the LoRA adapter;
* ``BlockRemoved`` with medium ``"CPU"`` for such chunks the server evicted since, read
  from the server's removal log (the ``removals`` op) at most once per
  :data:`POLL_S`, without ever waiting for the answer (vLLM asks on its steps only: an
  idle engine reports evictions with its next request). After the scheduler's link
  connected again (a restarted server starts empty, with a new removal log) every
  chunk reported is reported removed.

Nothing is collected unless the engine publishes events (``enable_kv_cache_events``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from ..client import AsyncClient, Pending
    from ..protocol import RemovalsResult

_log = logging.getLogger(__name__)

#: The medium our events name: chunks live in the server's host memory.
MEDIUM: Final = "CPU"
#: How often the server's removal log is read (seconds).
POLL_S: Final = 1.0
#: Chunks whose hashes are remembered for their removal events (the oldest are forgotten).
MAX_TRACKED: Final = 1 << 16


@dataclass
class _StoreNote:
    """One store's chunks, as events need them, until every rank answered."""

    keys: list[bytes]
    hashes: list[list[Any]]
    tokens: list[list[int]]
    parent: Any
    lora_id: int | None
    lora_name: str | None
    held: list[int] = field(default_factory=list)


def events_enabled(vllm_config: Any) -> bool:
    """Whether this engine publishes KV-cache events (else nothing is collected)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(getattr(config, "enable_kv_cache_events", False))


class KVEvents:
    """Collects the connector's events on the scheduler's thread; see the module docstring."""

    def __init__(self, *, enabled: bool, hash_block_size: int, hashes_per_chunk: int) -> None:
        self.enabled = enabled
        self._block_size = hash_block_size
        self._per_chunk = hashes_per_chunk
        self._notes: dict[int, _StoreNote] = {}
        self._tracked: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._queue: list[Any] = []
        self._removals: Pending[RemovalsResult] | None = None
        self._cursor = 0
        self._polled_at = 0.0
        self._session = 0

    def note_store(self, ticket: int, request: Any, chunks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Remember what store ``ticket`` moves (chunk indices ``chunks`` of ``request``)."""
        if not self.enabled or not chunks:
            return
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        per, size = self._per_chunk, self._block_size
        raw = list(getattr(request, "block_hashes", ()) or ())
        ids = list(getattr(request, "prompt_token_ids", None) or ())
        first = chunks[0] * per
        lora = getattr(request, "lora_request", None)
        self._notes[ticket] = _StoreNote(
            keys=list(keys),
            hashes=[[maybe_convert_block_hash(h) for h in raw[c * per : (c + 1) * per]] for c in chunks],
            tokens=[ids[c * per * size : (c + 1) * per * size] for c in chunks],
            parent=maybe_convert_block_hash(raw[first - 1]) if first else None,
            lora_id=getattr(lora, "lora_int_id", None) if lora is not None else None,
            lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        )

    def add_held(self, ticket: int, held: Sequence[int]) -> None:
        """Ranks' answers: how many leading chunks of ``ticket`` the server holds."""
        note = self._notes.get(ticket)
        if note is not None:
            note.held.extend(held)

    def resolved(self, ticket: int, ranks: int) -> None:
        """Every rank resolved ``ticket``: the chunks all ``ranks`` hold become one event."""
        note = self._notes.pop(ticket, None)
        if note is None:
            return
        count = min(note.held) if len(note.held) >= ranks else 0
        if count <= 0:
            return
        from vllm.distributed.kv_events import BlockStored

        hashes = [h for chunk in note.hashes[:count] for h in chunk]
        tokens = [t for chunk in note.tokens[:count] for t in chunk]
        self._queue.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=note.parent,
                token_ids=tokens,
                block_size=self._block_size,
                lora_id=note.lora_id,
                medium=MEDIUM,
                lora_name=note.lora_name,
            )
        )
        for key, chunk in zip(note.keys[:count], note.hashes[:count], strict=True):
            self._tracked[key] = chunk
            self._tracked.move_to_end(key)
        while len(self._tracked) > MAX_TRACKED:
            self._tracked.popitem(last=False)

    def take(self, client: AsyncClient | None, namespaces: Sequence[bytes]) -> list[Any]:
        """The events since the last call; reads (and asks again for) the server's removals."""
        if not self.enabled:
            return []
        if client is not None:
            self._poll_removals(client, namespaces)
        out, self._queue = self._queue, []
        return out

    def _poll_removals(self, client: AsyncClient, namespaces: Sequence[bytes]) -> None:
        if client.sessions != self._session:
            if self._session:  # another server, or the same one after a broken link: assume it forgot
                self._gone(list(self._tracked))
                self._removals, self._cursor = None, 0
            self._session = client.sessions
        pending = self._removals
        if pending is not None:
            if not pending.done():
                return
            self._removals = None
            try:
                result = pending.result()
            except Exception as exc:  # the server is away: the next poll asks again from the same cursor
                _log.debug("lmcache-platform scheduler: removals not read: %s", exc)
            else:
                self._removed(result)
        now = time.monotonic()
        if self._tracked and now >= self._polled_at + POLL_S:
            self._polled_at = now
            self._removals = client.removals(namespaces, self._cursor)

    def _removed(self, result: RemovalsResult) -> None:
        if result.missed:
            _log.warning(
                "lmcache-platform scheduler: the server forgot some removals before they were read; "
                "a router may believe chunks are held that are gone (they miss on lookup)"
            )
        self._cursor = result.cursor
        self._gone([key for _, key in result.removed])

    def _gone(self, keys: Sequence[bytes]) -> None:
        gone = [self._tracked.pop(key) for key in keys if key in self._tracked]
        if gone:
            from vllm.distributed.kv_events import BlockRemoved

            self._queue.append(BlockRemoved(block_hashes=[h for c in gone for h in c], medium=MEDIUM))

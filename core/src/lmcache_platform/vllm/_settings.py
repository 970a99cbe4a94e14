"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked once at start-up."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._env import SOCKET_ENV

DEFAULT_TOKENS_PER_CHUNK = 256
#: Deadlines, in milliseconds: a lookup's answer, and a load's or store's.
DEFAULT_LOOKUP_MS = 1000.0
DEFAULT_TRANSFER_MS = 5000.0
#: How long a lookup's hits stay pinned in the server for the load that follows it.
DEFAULT_LEASE_MS = 30_000

_KEYS = ("socket", "tokens_per_chunk", "model_id", "lookup_deadline_ms", "transfer_deadline_ms", "lease_ms")


@dataclass(frozen=True)
class Settings:
    socket: str | None
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK
    model_id: str | None = None
    lookup_ms: float = DEFAULT_LOOKUP_MS
    transfer_ms: float = DEFAULT_TRANSFER_MS
    lease_ms: int = DEFAULT_LEASE_MS

    hint = f"set kv_connector_extra_config['socket'] or {SOCKET_ENV}"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Settings:
        """Read and check the extra config; a bad value raises :class:`ValueError` naming its key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"lmcache-platform: unknown kv_connector_extra_config key(s) {unknown} (known: {list(_KEYS)})"
            )
        socket = extra.get("socket") or os.environ.get(SOCKET_ENV) or None
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"lmcache-platform: model_id must be a non-empty string, got {model_id!r}")
        return cls(
            socket=str(socket) if socket else None,
            tokens_per_chunk=_number(extra, "tokens_per_chunk", DEFAULT_TOKENS_PER_CHUNK, int),
            model_id=model_id,
            lookup_ms=_number(extra, "lookup_deadline_ms", DEFAULT_LOOKUP_MS, float),
            transfer_ms=_number(extra, "transfer_deadline_ms", DEFAULT_TRANSFER_MS, float),
            lease_ms=_number(extra, "lease_ms", DEFAULT_LEASE_MS, int),
        )

    def check_chunk(self, block_sizes: Sequence[int]) -> None:
        for g, size in enumerate(block_sizes):
            if self.tokens_per_chunk % size:
                raise ValueError(
                    f"lmcache-platform: tokens_per_chunk {self.tokens_per_chunk} is not a multiple of "
                    f"KV-cache group {g}'s block size {size}"
                )


def _number(extra: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    value = extra.get(key, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"lmcache-platform: kv_connector_extra_config[{key!r}] must be a number, got {value!r}"
        ) from None
    if isinstance(value, bool) or number <= 0:
        raise ValueError(
            f"lmcache-platform: kv_connector_extra_config[{key!r}] must be positive, got {value!r}"
        )
    return number

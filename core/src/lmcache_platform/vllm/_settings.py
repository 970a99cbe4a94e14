"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked once at start-up."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._env import CUDA_IPC_ENV, SOCKET_ENV

DEFAULT_TOKENS_PER_CHUNK = 256
#: Deadlines, in milliseconds: a lookup's answer, and a load's or store's.
DEFAULT_LOOKUP_MS = 1000.0
DEFAULT_TRANSFER_MS = 5000.0
#: How long a lookup's hits stay pinned in the server for the load that follows it.
DEFAULT_LEASE_MS = 30_000
#: How long a request's first scheduling pass waits for its lookup's answer (sent when the
#: request arrived, moments earlier) before the request waits a step for it instead.
DEFAULT_LOOKUP_WAIT_MS = 10.0

#: ``auto`` (default): the VMM kind for vLLM's extensible KV cache, a legacy kind for
#: allocator memory; ``vmm``, ``torch`` and ``raw`` force one kind.
CUDA_IPC_KINDS = ("auto", "vmm", "torch", "raw")
_KEYS = (
    "socket",
    "tokens_per_chunk",
    "model_id",
    "lookup_deadline_ms",
    "lookup_wait_ms",
    "transfer_deadline_ms",
    "lease_ms",
    "cuda_ipc",
)


@dataclass(frozen=True)
class Settings:
    socket: str | None
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK
    model_id: str | None = None
    lookup_ms: float = DEFAULT_LOOKUP_MS
    lookup_wait_ms: float = DEFAULT_LOOKUP_WAIT_MS
    transfer_ms: float = DEFAULT_TRANSFER_MS
    lease_ms: int = DEFAULT_LEASE_MS
    #: The CUDA IPC kind (:data:`CUDA_IPC_KINDS`): the extra config's, else the environment's.
    cuda_ipc: str = "auto"

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
            lookup_wait_ms=_number(extra, "lookup_wait_ms", DEFAULT_LOOKUP_WAIT_MS, float, zero=True),
            transfer_ms=_number(extra, "transfer_deadline_ms", DEFAULT_TRANSFER_MS, float),
            lease_ms=_number(extra, "lease_ms", DEFAULT_LEASE_MS, int),
            cuda_ipc=_cuda_ipc(extra),
        )

    @property
    def legacy_ipc(self) -> bool:
        """Whether the operator chose a legacy CUDA IPC kind, which cannot share VMM memory."""
        return self.cuda_ipc in ("torch", "raw")

    def check_chunk(self, block_sizes: Sequence[int]) -> None:
        for g, size in enumerate(block_sizes):
            if self.tokens_per_chunk % size:
                raise ValueError(
                    f"lmcache-platform: tokens_per_chunk {self.tokens_per_chunk} is not a multiple of "
                    f"KV-cache group {g}'s block size {size}"
                )


def _number(extra: Mapping[str, Any], key: str, default: Any, kind: type, *, zero: bool = False) -> Any:
    """``extra[key]`` as a positive ``kind`` (or 0, with ``zero``), else a ValueError naming the key."""
    value = extra.get(key, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"lmcache-platform: kv_connector_extra_config[{key!r}] must be a number, got {value!r}"
        ) from None
    if not math.isfinite(number):
        raise ValueError(
            f"lmcache-platform: kv_connector_extra_config[{key!r}] must be finite, got {value!r}"
        )
    if isinstance(value, bool) or number < 0 or (number == 0 and not zero):
        what = "0 or more" if zero else "positive"
        raise ValueError(
            f"lmcache-platform: kv_connector_extra_config[{key!r}] must be {what}, got {value!r}"
        )
    return number


def _cuda_ipc(extra: Mapping[str, Any]) -> str:
    """The CUDA IPC kind: ``cuda_ipc`` in the extra config, else ``$LMCACHE_PLATFORM_CUDA_IPC``."""
    env = os.environ.get(CUDA_IPC_ENV, "").strip()
    value = extra.get("cuda_ipc", env or "auto")
    if value not in CUDA_IPC_KINDS:
        where = "kv_connector_extra_config['cuda_ipc']" if "cuda_ipc" in extra else CUDA_IPC_ENV
        raise ValueError(f"lmcache-platform: {where} must be one of {list(CUDA_IPC_KINDS)}, got {value!r}")
    if "cuda_ipc" in extra and env and env != value:
        raise ValueError(
            f"lmcache-platform: kv_connector_extra_config['cuda_ipc'] is {value!r} but {CUDA_IPC_ENV} is "
            f"{env!r}; set one of them"
        )
    return str(value)

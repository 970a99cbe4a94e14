"""What the two halves of the connector tell each other once per engine step.

Scheduler to workers (:class:`StepPlan`, vLLM's ``KVConnectorMetadata``): the loads
and stores to start. Workers to scheduler (:class:`WorkerReport`, vLLM's
``KVConnectorWorkerMetadata``, one per rank, aggregated by vLLM): which transfers the
server can no longer act on, whether each rank can serve, and its counters.
Both travel between vLLM's processes by its own serialization, inside one engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

#: A block id that stands for "nothing to move here": vLLM's null block in a
#: sliding-window group, or a block the request already had from its local prefix cache.
SKIP = -1

#: One chunk: its key and, per KV-cache group, the block ids holding its tokens.
ChunkMove = tuple[bytes, list[list[int]]]


@dataclass
class Transfer:
    """One load or store of one request's chunks, named by a ticket unique in the engine."""

    ticket: int
    req_id: str
    chunks: list[ChunkMove]
    #: A lookup's lease whose pins this load releases (0: none).
    lease: int = 0


@dataclass
class StepPlan(KVConnectorMetadata):  # type: ignore[misc]
    """Per step: loads to start (asynchronous: they finish through ``get_finished``) and stores."""

    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    #: The step computes nothing: a worker may wait a moment for its transfers to end.
    idle: bool = False


#: Link states a worker reports; the scheduler offers hits only while every rank is "ready".
READY, DOWN, OFF = "ready", "down", "off"


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """One step's news from the workers, summed over ranks by :meth:`aggregate`."""

    #: ticket -> how many ranks' server can no longer act on it (answered, or its link died).
    resolved: dict[int, int] = field(default_factory=dict)
    #: rank label -> READY, DOWN or OFF (the rank runs without the connector).
    states: dict[str, str] = field(default_factory=dict)
    #: store ticket -> per rank that answered it, the leading chunks its server now holds
    #: (for KV-cache events: a chunk is reported stored once every rank holds it).
    held: dict[int, list[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerReport):
            return self
        resolved = dict(self.resolved)
        for ticket, n in other.resolved.items():
            resolved[ticket] = resolved.get(ticket, 0) + n
        held = {ticket: list(counts) for ticket, counts in self.held.items()}
        for ticket, counts in other.held.items():
            held.setdefault(ticket, []).extend(counts)
        return WorkerReport(resolved, {**self.states, **other.states}, held)

"""Device identity: producer UUID <-> this process's device ordinal.

An ordinal means nothing across processes: ``CUDA_VISIBLE_DEVICES=1,0`` in the
engine and ``0,1`` in the server swap them. A descriptor therefore names its device
by UUID, and the receiver maps the UUID to its own ordinal. The visible set cannot
change once CUDA is initialised in a process, so the map is built once (under a
lock, so racing first callers enumerate once) and then read without locking.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from lmcache_platform import DescriptorError


def _enumerate() -> list[str]:
    """UUIDs of the devices visible to this process, by ordinal. Tests replace this."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


class DeviceMap:
    """Lazily built, thread-safe UUID <-> ordinal table of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uuids: tuple[str, ...] | None = None
        self._ordinals: Mapping[str, int] = {}

    def _load(self) -> tuple[str, ...]:
        uuids = self._uuids
        if uuids is None:
            with self._lock:
                if self._uuids is None:
                    found = tuple(_enumerate())
                    self._ordinals = {u: i for i, u in enumerate(found)}
                    self._uuids = found
                uuids = self._uuids
        return uuids

    def uuid_of(self, ordinal: int) -> str:
        """The UUID of local device ``ordinal`` (what a producer puts in a descriptor)."""
        uuids = self._load()
        if not 0 <= ordinal < len(uuids):
            raise DescriptorError(f"CUDA device ordinal {ordinal} is not visible here ({len(uuids)} visible)")
        return uuids[ordinal]

    def ordinal_of(self, uuid: str) -> int:
        """This process's ordinal for the device the producer called ``uuid``."""
        uuids = self._load()
        ordinal = self._ordinals.get(uuid)
        if ordinal is not None:
            return ordinal
        visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
        env_note = "" if visible_env is None else f" (CUDA_VISIBLE_DEVICES={visible_env!r})"
        if not uuids:
            raise DescriptorError(
                f"the KV cache lives on CUDA device {uuid}, but this process sees no CUDA "
                f"device{env_note}; run the server on a host (or container) that can see "
                "that GPU, or use a CPU backend for the engine"
            )
        listing = ", ".join(f"{i}={u}" for i, u in enumerate(uuids))
        raise DescriptorError(
            f"CUDA device {uuid} is not visible to this process{env_note}; visible devices: "
            f"{listing}. Make the producer's GPU visible here (CUDA_VISIBLE_DEVICES, "
            "container --gpus)"
        )

    def reset(self) -> None:
        """Forget the table (tests; after faking a different device set)."""
        with self._lock:
            self._uuids = None
            self._ordinals = {}


#: The process-wide table. Shared by both wrapper kinds.
DEVICES = DeviceMap()

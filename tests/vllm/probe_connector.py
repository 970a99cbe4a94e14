"""The platform's vLLM connector plus what a test needs to see: the blocks of each request.

vLLM loads this module by path (``kv_connector_module_path``); with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the scheduler and worker instances live in the
test's process, so :data:`INSTANCES` reaches both.
"""

from __future__ import annotations

from typing import Any

from lmcache_platform.vllm import LMCachePlatformConnector

INSTANCES: list[ProbeConnector] = []
#: request id -> block ids per KV-cache group, as first allocated (before a sliding
#: window's early blocks are dropped).
BLOCKS: dict[str, tuple[list[int], ...]] = {}


class ProbeConnector(LMCachePlatformConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        INSTANCES.append(self)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        for req in scheduler_output.scheduled_new_reqs:
            BLOCKS.setdefault(req.req_id, tuple(list(g) for g in req.block_ids))
        return super().build_connector_meta(scheduler_output)

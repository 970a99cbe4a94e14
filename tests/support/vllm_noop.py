"""A KV connector that does nothing: what having any connector costs a vLLM engine.

vLLM's engine runs other code once a connector is configured (the connector's calls from
every attention layer and step, connector metadata, KV-transfer output handling), whether
or not the connector moves anything. ``python -m bench.vllm_connector --connector noop``
starts the connector-on engine with this class (``kv_connector_module_path =
"support.vllm_noop"``, ``tests`` on ``PYTHONPATH``), so the no-reuse workload's on/off
ratio separates vLLM's own cost of a connector from ours. Runs in vLLM's venv only.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Never matches, loads or saves: every hook returns at once."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

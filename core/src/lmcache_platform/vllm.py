"""vLLM integration: a KV connector that registers vLLM's KV caches with a platform server.

Load it by module path (``pip install 'lmcache-platform[vllm]'``)::

    KVTransferConfig(
        kv_connector="LMCachePlatformConnector",
        kv_connector_module_path="lmcache_platform.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"socket": "/run/lmcache/server.sock"},
    )

On the worker, :meth:`LMCachePlatformConnector.register_kv_caches` receives vLLM's
``dict[layer_name, Tensor]`` (one strided ``[B, H, N, C]`` view per layer over one
backing allocation), wraps it with :func:`lmcache_platform.wrap_kv_caches` and
registers it with the server, passing the layout vLLM chose (``kv_cache_layout``),
the head size and one :class:`~lmcache_platform.EngineGroupInfo` per KV-cache group.
The translation from vLLM's config is :func:`registration_config`, usable on its own.

This release registers and reports no external hits: the engine runs exactly as
without a connector, and the registered context lets the server move the engine's
blocks. ``import lmcache_platform`` never imports this module or vLLM.

Extra-config keys: ``socket`` (the server's UNIX socket; else the environment variable
``LMCACHE_PLATFORM_SOCKET``), ``tokens_per_chunk`` (default 256, a multiple of every
group's block size).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ._facade import wrap_kv_caches
from ._types import EngineGroupInfo, LayoutHints

if TYPE_CHECKING:
    import torch

    from ._ipc_wrapper import DeviceIPCWrapper
    from .server import Registration, ServerClient

_log = logging.getLogger(__name__)

#: Environment variable naming the server's socket when the extra config does not.
SOCKET_ENV = "LMCACHE_PLATFORM_SOCKET"
DEFAULT_TOKENS_PER_CHUNK = 256


def registration_config(kv_cache_config: Any, layer_names: Sequence[str]) -> dict[str, Any]:
    """``create_cache_context`` keywords for vLLM's ``KVCacheConfig`` and its layer order.

    One engine group per KV-cache group (its layers by position in ``layer_names``, its
    block size and sliding window), the physical layout vLLM resolved as
    ``engine_layout``, and ``head_size`` when every group agrees on it (so an MLA
    latent is told from K and V without guessing).
    """
    index = {name: i for i, name in enumerate(layer_names)}
    groups, head_sizes = [], set()
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = [index[name] for name in group.layer_names if name in index]
        if not layers:
            continue
        if len(layers) != len(group.layer_names):
            missing = sorted(set(group.layer_names) - set(index))
            raise ValueError(f"vLLM KV-cache group {g} names layers the engine did not register: {missing}")
        head_sizes.add(int(spec.head_size))
        window = getattr(spec, "sliding_window", None)
        groups.append(
            EngineGroupInfo(layer_indices=tuple(layers), block_size=int(spec.block_size),
                            sliding_window=int(window) if window else None)
        )  # fmt: skip
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    hints = LayoutHints(
        engine_layout=str(layout) if layout else None,
        head_size=head_sizes.pop() if len(head_sizes) == 1 else None,
    )
    return {"layout_hints": hints, "engine_group_infos": tuple(groups)}


class LMCachePlatformConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Registers vLLM's KV caches with an lmcache-platform server (see the module docs)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra: Mapping[str, Any] = self._kv_transfer_config.kv_connector_extra_config or {}
        self.socket_path: str | None = extra.get("socket") or os.environ.get(SOCKET_ENV)
        self.tokens_per_chunk = int(extra.get("tokens_per_chunk", DEFAULT_TOKENS_PER_CHUNK))
        self.client: ServerClient | None = None
        self.registration: Registration | None = None
        self.kv_caches: dict[str, DeviceIPCWrapper] = {}
        #: vLLM's own per-layer tensors, as registered (what its kernels read and write).
        self.engine_kv_caches: dict[str, torch.Tensor] = {}

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap vLLM's per-layer views (one export per backing allocation) and register them."""
        from .server import ServerClient

        self.engine_kv_caches = dict(kv_caches)
        self.kv_caches = wrap_kv_caches(kv_caches)
        if self.socket_path is None:
            _log.warning("lmcache-platform: no server socket configured (%s); not registering", SOCKET_ENV)
            return
        config = registration_config(self._kv_cache_config, list(kv_caches))
        self.client = ServerClient(self.socket_path)
        self.registration = self.client.register(
            self.kv_caches, lmcache_tokens_per_chunk=self.tokens_per_chunk, **config
        )
        _log.info(
            "lmcache-platform: registered %d layers with %s as context %d",
            len(kv_caches), self.socket_path, self.registration.context,
        )  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load: this release reports no external hits."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing is loading."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing is saved per layer."""

    def wait_for_save(self) -> None:
        """Nothing is saving."""

    def shutdown(self) -> None:
        """Unregister (the server closes its mapping of our memory) and drop the exports."""
        if self.client is not None:
            try:
                if self.registration is not None:
                    self.client.unregister(self.registration.context)
            except Exception as exc:  # the server may be gone; the engine must still stop
                _log.warning("lmcache-platform: unregister failed: %s", exc)
            finally:
                self.client.close()
                self.client = None
        for wrapper in self.kv_caches.values():
            wrapper.close()
        self.kv_caches = {}

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """No external tokens are ever loaded."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

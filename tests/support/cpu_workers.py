"""Engine and server processes of the CPU end-to-end test, driven by the test over pipes.

Nothing is pickled between the processes once they run: every request and reply is
JSON bytes (``support.commands`` over the pipe), and IPC wrappers travel as their
``wire_tag`` plus ``fields()``; the server rebuilds them with ``from_fields`` from
the allow-list of the backend it resolved (``wire_classes_for``).

The engine checks the result itself, independently of the code under test: it
knows how it laid out each layer, so it computes the expected bytes of every layer
with plain indexing and compares whole storages byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from support.commands import PipeChannel, serve_commands

Json = dict[str, Any]


def _serve(conn: Connection, handler: object) -> None:
    """``support.commands``' loop over the pipe: each ``op_<name>`` method answers ``<name>``."""
    ops = {
        name.removeprefix("op_"): getattr(handler, name) for name in dir(handler) if name.startswith("op_")
    }
    serve_commands(PipeChannel(conn), ops)


def engine_main(conn: Connection) -> None:
    _serve(conn, Engine())


def server_main(conn: Connection) -> None:
    _serve(conn, Server())


def our_mappings() -> int:
    """Mappings of our memory in this process, either kind (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(
            1 for line in f if "/dev/shm/lmcache_platform_" in line or "/memfd:lmcache_platform_" in line
        )


def exported(handle: Json) -> bool:
    """Whether the memory ``handle`` names is still exported by this process."""
    if "shm_name" in handle:
        return os.path.exists("/dev/shm/" + handle["shm_name"])
    try:  # a memfd export lives as long as its fd
        return (
            os.readlink(f"/proc/self/fd/{handle['memfd_fd']}") == f"/memfd:{handle['memfd_name']} (deleted)"
        )
    except FileNotFoundError:
        return False


# -- engine -----------------------------------------------------------------------------

#: One token's K/V data in a layer of each format: (tensor, block, offset) -> view.
TOKEN: dict[str, Callable[[Any, int, int], Any]] = {
    "flash_attn": lambda t, b, o: t[:, b, o],
    "flash_attn_hnd": lambda t, b, o: t[:, b, :, o],
    "flashinfer": lambda t, b, o: t[b, :, o],
    "flashinfer_hnd": lambda t, b, o: t[b, :, :, o],
    "mla": lambda t, b, o: t[b, o],
}


def layer_shape(spec: Json) -> tuple[int, ...]:
    from lmcache_platform import KVFormat, kv_cache_shape

    return kv_cache_shape(
        KVFormat(spec["format"]),
        num_blocks=spec["num_blocks"],
        block_size=spec["block_size"],
        num_kv_heads=spec["heads"],
        head_size=spec["head_size"],
    )


class Engine:
    """Allocates paged KV caches like a serving engine, wraps them, checks the results."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.layers: list[Any] = []
        self.specs: list[Json] = []
        self.wrappers: list[Any] = []
        self.before: dict[int, Any] = {}
        self.after: dict[int, Any] = {}

    def _alloc(self, spec: Json, raw: dict[str, Any]) -> Any:
        torch = self.torch
        dtype = getattr(torch, spec["dtype"])
        shape = layer_shape(spec)
        if spec.get("hnd_memory"):  # vLLM: HND memory shown as the NHD logical shape
            assert spec["format"] == "flash_attn"
            phys = (shape[0], shape[1], shape[3], shape[2], shape[4])
            return torch.empty(phys, dtype=dtype).transpose(2, 3)
        if "shared" in spec:  # vLLM hybrid models: layers of two groups share memory
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            base = raw.setdefault(spec["shared"], torch.empty(nbytes, dtype=torch.int8))
            return base.view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype)

    def _storages(self) -> dict[int, Any]:
        """Distinct storages of the layers, as flat uint8 tensors keyed by address."""
        torch = self.torch
        out = {}
        for t in self.layers:
            st = t.untyped_storage()
            out[st.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(st)
        return out

    def _fill(self, seed: int) -> None:
        gen = self.torch.Generator().manual_seed(seed)
        for flat in self._storages().values():  # random bytes: NaNs and all, bit-exact checks
            flat.copy_(self.torch.randint(0, 256, flat.shape, dtype=self.torch.uint8, generator=gen))

    def op_setup(self, layers: list[Json], seed: int) -> Json:
        import lmcache_platform

        self.op_close()
        raw: dict[str, Any] = {}
        self.specs = layers
        self.layers = [self._alloc(spec, raw) for spec in layers]
        del raw  # the engine keeps only its layer views, like vLLM
        self._fill(seed)
        expected = {k: v.clone() for k, v in self._storages().items()}
        self.wrappers = lmcache_platform.wrap_kv_caches(self.layers)
        moved = list(self._storages().values())
        assert len(moved) == len(expected), "views sharing memory must keep sharing it"
        assert all(self.torch.equal(a, b) for a, b in zip(expected.values(), moved, strict=True)), (
            "wrapping changed the engine's KV contents"
        )
        return {"wrappers": [{"tag": type(w).wire_tag, "fields": w.fields()} for w in self.wrappers]}

    def op_snapshot(self) -> Json:
        self.before = {k: v.clone() for k, v in self._storages().items()}
        return {}

    def op_scramble(self, seed: int) -> Json:
        self._fill(seed)
        self.after = {k: v.clone() for k, v in self._storages().items()}
        return {}

    def _view(self, storages: dict[int, Any], i: int) -> Any:
        t = self.layers[i]
        flat = storages[t.untyped_storage().data_ptr()]
        return self.torch.empty(0, dtype=t.dtype).set_(
            flat.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )

    def op_check_retrieved(self, groups: list[Json], transfers: list[Json]) -> Json:
        """Compare every byte with: the scrambled state, plus each chunk's kept tokens
        copied from their source blocks (before scrambling) to their destination blocks."""
        expected = {k: v.clone() for k, v in self.after.items()}
        written = 0
        for g, group in enumerate(groups):
            bs, keep = group["block_size"], group["kept_tokens"]
            for i in group["layer_indices"]:
                token = TOKEN[self.specs[i]["format"]]
                src_view, dst_view = self._view(self.before, i), self._view(expected, i)
                for tr in transfers:
                    n = tr["num_tokens"]
                    for p in range(n - min(n, keep), n):
                        src = token(src_view, tr["src"][g][p // bs], p % bs)
                        token(dst_view, tr["dst"][g][p // bs], p % bs).copy_(src)
                        written += 1
        return {"written_tokens": written, **self._diff(expected)}

    def op_check_untouched(self) -> Json:
        return self._diff(self.after)

    def _diff(self, expected: dict[int, Any]) -> Json:
        actual = self._storages()
        assert actual.keys() == expected.keys()
        bad = sum(int((actual[k] != expected[k]).sum()) for k in actual)
        return {"mismatched_bytes": bad, "total_bytes": sum(v.numel() for v in actual.values())}

    def op_close(self, drop_only: bool = False) -> Json:
        """Close the wrappers (unless ``drop_only``), drop the tensors; report what remains.

        No ``gc.collect()``: reference counting alone must release every segment or memfd.
        """
        handles = [
            json.loads(h) for h in sorted({json.dumps(w.handle) for w in self.wrappers if w.memory_nbytes})
        ]
        if not drop_only:
            for w in self.wrappers:
                w.close()
        self.wrappers, self.layers, self.before, self.after = [], [], {}, {}
        return {"handles": handles, "remaining": [h for h in handles if exported(h)]}


# -- server -----------------------------------------------------------------------------


class Server:
    """Reopens the engine's wrappers, builds the cache context, stores and retrieves."""

    def __init__(self) -> None:
        self.ctx: Any = None
        self.l1: list[list[Any]] = []  # the server's own copy of each stored chunk

    def op_register(self, wrappers: list[Json], config: Json) -> Json:
        import lmcache_platform
        from lmcache_platform import EngineGroupInfo, KVFormat, LayoutHints
        from lmcache_platform._plugins.registry import wire_classes_for

        self.op_close()
        allowed = wire_classes_for("cpu")
        kv = [allowed[w["tag"]].from_fields(w["fields"]) for w in wrappers]
        hints = config.get("hints")
        self.ctx = lmcache_platform.create_cache_context(
            kv,
            lmcache_tokens_per_chunk=config["tokens_per_chunk"],
            layout_hints=None
            if hints is None
            else LayoutHints(
                kv_format=KVFormat(hints["kv_format"]) if hints.get("kv_format") else None,
                block_size=hints.get("block_size"),
                num_kv_heads=hints.get("num_kv_heads"),
            ),
            engine_group_infos=[EngineGroupInfo(**g) for g in config.get("groups", [])],
            separate_object_groups=config.get("separate_object_groups", True),
            full_sw_kv=config.get("full_sw_kv", False),
        )
        return {"status": self.ctx.report_status(), "class": type(self.ctx).__name__}

    def op_store(self, transfers: list[Json]) -> Json:
        ctx = self.ctx
        n_og = ctx.kv_layer_groups_manager.num_object_groups
        for j, tr in enumerate(transfers):
            slot = j % ctx.max_batch_size
            ctx.store_chunk(tr["src"], slot=slot, num_tokens=tr["num_tokens"])
            self.l1.append([ctx.get_temp_object_group_buffer(slot, og).clone() for og in range(n_og)])
        return {}

    def op_retrieve(self, transfers: list[Json], first_chunk: int = 0) -> Json:
        import torch

        ctx = self.ctx
        manager = ctx.kv_layer_groups_manager
        for j, tr in enumerate(transfers, start=first_chunk):
            slot = j % ctx.max_batch_size
            for kg in range(manager.num_kernel_groups):  # garbage first: the object views
                buf = ctx.get_temp_kernel_group_buffer(slot, kg)  # must restore every group
                buf.view(torch.uint8).fill_(0xA5)
            for og, saved in enumerate(self.l1[j]):
                ctx.get_temp_object_group_buffer(slot, og).copy_(saved)
            ctx.retrieve_chunk(tr["dst"], slot=slot, num_tokens=tr["num_tokens"])
        return {}

    def op_close(self) -> Json:
        """Close the context; report how many of our segments are still mapped here.

        No ``gc.collect()``: reference counting alone must release every mapping.
        """
        if self.ctx is not None:
            self.ctx.close()
        self.ctx, self.l1 = None, []
        return {"mappings": our_mappings()}

    def op_open(self, tag: str, fields: Json) -> Json:
        """Reopen one wrapper and drop it again (error paths)."""
        from lmcache_platform._plugins.registry import wire_classes_for

        wrapper = wire_classes_for("cpu")[tag].from_fields(fields)
        shape = list(wrapper.to_tensor().shape)
        wrapper.close()
        return {"shape": shape}


# -- a producer for the gc test ---------------------------------------------------------


def producer_main(conn: Connection, count: int) -> None:
    """Create ``count`` segments, report their names, then wait to be killed."""
    from lmcache_platform_cpu import _shm

    maps = [_shm.create(4096) for _ in range(count)]
    conn.send_bytes(json.dumps([name for name, _ in maps]).encode())
    conn.recv_bytes()  # never answered: the test kills this process

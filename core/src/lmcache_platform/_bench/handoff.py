"""Benchmark sections: handing a KV-cache set to another process, and the one-time migration.

Hand-off: the engine side holds a vLLM-shaped KV-cache set (32 layers of float16,
8 heads of 128, blocks of 16 tokens: by default current vLLM's ``[blocks, 8, 16, 256]``
views of one allocation, with ``--layout per-layer`` older vLLM's
``[2, blocks, 16, 8, 128]`` tensors, one allocation each) and gives it to a spawned receiver, which
opens every layer as a tensor and acknowledges. The time runs from "the engine has
its tensors" to "the acknowledgement is back", for

* ours: ``wrap_kv_caches`` (storage already migrated, as after the engine's first
  wrap), ``wire.encode``, a pipe, ``wire.decode`` and ``to_tensors()`` (as a cache
  context reopens a set);
* torch.multiprocessing sharing through a spawn-context ``Queue``, with the
  ``file_system`` and ``file_descriptor`` strategies (storage already shared, the
  same starting point as ours); on CUDA, torch's CUDA IPC;
* plain pickling of the tensors over the same pipe (copies every byte).

Migration: the first ``wrap`` of fresh tensors, which moves their storage into
shared memory, against ``Tensor.share_memory_()`` with each torch strategy.
"""

from __future__ import annotations

import contextlib
import gc
import json
import pickle
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._errors import LMCachePlatformError
from .._units import format_bytes
from . import child as receiver
from .kvsets import EXPECTED_CORNERS, LAYERS, GiB, MiB, kv_set, no_room, size_params, sizes_of
from .stats import Report, Result, Settings, Skip, SpeedTarget, ratio_rows

if TYPE_CHECKING:
    import torch

#: Pickling copies every byte (several times); above this it only shows the same slope.
PICKLE_MAX = 1 * GiB
#: Ours at 1 GiB must take at most this share of torch's file_system strategy.
VS_TORCH_LIMIT = 0.25
#: Largest over smallest size: "flat" means at most this.
FLAT_LIMIT = 1.2
OURS = "ours (wire + shm)"
PICKLE = "pickle"
STRATEGIES = ("file_system", "file_descriptor")
_TIMEOUT_S = 300.0


class Receiver:
    """The spawned receiving process and its channels (see :mod:`.child`)."""

    def __init__(self) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.queue = ctx.Queue()
        self.proc = ctx.Process(target=receiver.serve, args=(child, self.queue), daemon=True)
        self.proc.start()
        child.close()
        self._mid_trial = False  # between "ready" and the acknowledgement

    def _recv(self) -> dict[str, Any]:
        if not self.conn.poll(_TIMEOUT_S):
            raise RuntimeError(f"the receiver did not answer within {_TIMEOUT_S:g} s")
        try:
            answer: dict[str, Any] = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise RuntimeError(f"the receiver died (exit code {self.proc.exitcode})") from None
        return answer

    def handoff(self, method: str, send: Callable[[], dict[str, float]]) -> dict[str, float]:
        """One timed hand-off: ``send`` ships the set; returns total and stage seconds."""
        self.conn.send_bytes(json.dumps({"method": method}).encode())
        self._recv()  # ready: the previous set is released on the other side
        self._mid_trial = True
        t0 = time.perf_counter()
        stages = send()
        ack = self._recv()
        total = time.perf_counter() - t0
        self._mid_trial = False
        if "received_bytes" in ack:  # a bytes-only baseline: check the count, the caller checks data
            if ack["received_bytes"] != stages.get("sent_bytes"):
                raise RuntimeError(
                    f"hand-off by {method}: {ack['received_bytes']} bytes arrived, "
                    f"{stages.get('sent_bytes')} were sent"
                )
        elif ack["corners"] != EXPECTED_CORNERS or ack["layers"] != LAYERS:
            raise RuntimeError(
                f"hand-off by {method}: the receiver saw {ack['layers']} layers with corner values "
                f"{ack['corners']}, expected {LAYERS} layers with {EXPECTED_CORNERS}"
            )
        return {
            **stages,
            "decode": ack.get("decode", 0.0),
            "to_tensor": ack.get("to_tensor", 0.0),
            "total": total,
        }

    def close(self) -> None:
        if not self._mid_trial:  # mid-trial it awaits a payload, not a command: just stop it
            with contextlib.suppress(OSError):
                self.conn.send_bytes(b'{"method": "stop"}')
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        self.queue.close()
        self.queue.join_thread()


@contextlib.contextmanager
def sharing_strategy(strategy: str) -> Iterator[None]:
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()  # type: ignore[no-untyped-call]
    tmp.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)  # type: ignore[no-untyped-call]


def _trials(
    recv: Receiver, method: str, send: Callable[[], dict[str, float]], runs: int, warmup: int
) -> list[dict[str, float]]:
    for _ in range(warmup):
        recv.handoff(method, send)
    return [recv.handoff(method, send) for _ in range(runs)]


def bench_handoff(report: Report, settings: Settings) -> None:
    """Every method at every size, in one receiver process; ratios are against ours.

    Our trials at all sizes are interleaved (the sets are held together), so a load
    change on a shared machine cannot pass for a dependence on size. Each baseline
    runs one size at a time: its sets are not held together, to save memory.
    """
    device, sizes = settings.device, sizes_of(settings)
    runs = settings.repeats(5, 15)
    held, ours_sizes = 0, []
    for size in sizes:  # every set held at once, plus the one being migrated twice over
        why = no_room(held + 2 * size, held + size, device)
        if why:
            report.skipped.append(Skip("handoff", OURS, why, size_params(size, device, settings.layout)))
        else:
            held += size
            ours_sizes.append(size)
    recv = Receiver()
    try:
        _handoff_ours(report, recv, ours_sizes, device, runs, settings.layout)
        for size in sizes:
            params = size_params(size, device, settings.layout)
            why = no_room(2 * size, size, device)
            if why:
                report.skipped.append(Skip("handoff", "baselines", why, params))
                continue
            if device == "cpu":
                for strategy in STRATEGIES:
                    with sharing_strategy(strategy):
                        _handoff_torch(report, recv, f"torch {strategy}", size, device, runs, params)
            else:
                _handoff_torch(report, recv, "torch CUDA IPC", size, device, runs, params)
            why = (
                f"pickling copies every byte; skipped above {format_bytes(PICKLE_MAX)}"
                if size > PICKLE_MAX
                else no_room(6 * size, 0, device)
            )
            if why:
                report.skipped.append(Skip("handoff", PICKLE, why, params))
            else:
                pickle_runs = settings.repeats(3, 3 if size > 64 * MiB else 5)
                _handoff_pickle(report, recv, size, device, pickle_runs, params)
            gc.collect()  # between sizes, in case anything was caught in a cycle
    finally:
        recv.close()
    main = ratio_rows(report.section("handoff"), OURS, "size_bytes")
    report.results = [r for r in report.results if r.section != "handoff"] + main
    _handoff_targets(report)


def _handoff_ours(
    report: Report, recv: Receiver, sizes: list[int], device: str, runs: int, layout: str
) -> None:
    from .. import wire, wrap_kv_caches

    sets: dict[int, list[torch.Tensor]] = {}
    bases: dict[int, list[Any]] = {}
    made: list[Any] = []

    def sender(tensors: list[torch.Tensor]) -> Callable[[], dict[str, float]]:
        def send() -> dict[str, float]:
            t0 = time.perf_counter()
            wrappers = wrap_kv_caches(tensors)
            t1 = time.perf_counter()
            data = wire.encode(wrappers)
            t2 = time.perf_counter()
            recv.conn.send_bytes(data)
            made.extend(wrappers)
            return {"wrap": t1 - t0, "encode": t2 - t1}

        return send

    trials: dict[int, list[dict[str, float]]] = {}
    message_bytes: dict[int, int] = {}
    try:
        for size in sizes:
            sets[size] = kv_set(size, device, layout)
            try:  # the one-time migration, measured in its own section
                bases[size] = wrap_kv_caches(sets[size])
            except LMCachePlatformError as exc:
                why = str(exc).splitlines()[0]
                report.skipped.append(Skip("handoff", OURS, why, size_params(size, device, layout)))
                del sets[size]
                continue
            message_bytes[size] = len(wire.encode(bases[size]))
            trials[size] = []
        for i in range(runs + 1):  # round-robin over the sizes; the first round warms up
            for size in trials:
                trial = recv.handoff("ours", sender(sets[size]))
                for w in made:
                    w.close()
                made.clear()
                if i:
                    trials[size].append(trial)
    finally:
        for base in bases.values():
            for w in base:
                w.close()
        sets.clear()
    for size, ts in trials.items():
        p = {**size_params(size, device, layout), "message_bytes": message_bytes[size]}
        report.results.append(Result("handoff", OURS, "ms", tuple(t["total"] * 1e3 for t in ts), p))
        for stage in ("wrap", "encode", "decode", "to_tensor"):
            report.results.append(
                Result("handoff stages", f"ours: {stage}", "ms", tuple(t[stage] * 1e3 for t in ts), p)
            )
        transport = [t["total"] - t["wrap"] - t["encode"] - t["decode"] - t["to_tensor"] for t in ts]
        report.results.append(
            Result(
                "handoff stages", "ours: pipe and acknowledgement", "ms", tuple(x * 1e3 for x in transport), p
            )
        )


def _handoff_torch(
    report: Report, recv: Receiver, label: str, size: int, device: str, runs: int, params: dict[str, Any]
) -> None:
    tensors = kv_set(size, device, params["layout"])
    if device == "cpu":
        for t in tensors:
            t.share_memory_()  # type: ignore[no-untyped-call]  # same start as ours: already shared

    def send() -> dict[str, float]:
        recv.queue.put(tensors)
        return {}

    try:
        trials = _trials(recv, "torch", send, runs, warmup=1)
    finally:
        tensors.clear()
    report.results.append(Result("handoff", label, "ms", tuple(t["total"] * 1e3 for t in trials), params))


def _picklable(tensors: list[torch.Tensor]) -> Any:
    """The set as pickle should carry it: views of one allocation as that storage once.

    Pickling each view would serialize the whole shared storage once per layer (32
    times the bytes, and out of memory at 256 MiB); so views travel as the backing
    bytes plus each layer's (shape, stride, offset), rebuilt by :func:`_unpickled`.
    """
    import torch

    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) != 1 or len(tensors) < 2:
        return tensors
    backing = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(tensors[0].untyped_storage())
    return (
        backing,
        str(tensors[0].dtype).removeprefix("torch."),
        [(tuple(t.shape), t.stride(), t.storage_offset()) for t in tensors],
    )


def _unpickled(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, list):
        return obj
    import torch

    backing, dtype, views = obj
    typed = backing.view(getattr(torch, dtype))
    return [typed.as_strided(shape, stride, offset) for shape, stride, offset in views]


def _handoff_pickle(
    report: Report, recv: Receiver, size: int, device: str, runs: int, params: dict[str, Any]
) -> None:
    """Pickle, send, unpickle. The receiver only takes the bytes (nothing unpickles bytes
    from another process); the unpickling of the same bytes is timed here and added."""
    tensors = kv_set(size, device, params["layout"])
    sent: list[bytes] = []

    def send() -> dict[str, float]:
        data = pickle.dumps(_picklable(tensors), protocol=pickle.HIGHEST_PROTOCOL)
        recv.conn.send_bytes(data)
        sent.append(data)
        return {"sent_bytes": float(len(data))}

    def trial() -> dict[str, float]:
        out = recv.handoff("pickle", send)
        t0 = time.perf_counter()
        copies = _unpickled(pickle.loads(sent.pop()))  # noqa: S301 - bytes this process just made
        out["loads"] = time.perf_counter() - t0
        out["total"] += out["loads"]
        if len(copies) != LAYERS or receiver.corner_values(copies) != EXPECTED_CORNERS:
            raise RuntimeError("hand-off by pickle: the unpickled set does not match")
        return out

    try:
        for _ in range(1 if size <= 64 * MiB else 0):
            trial()
        trials = [trial() for _ in range(runs)]
    finally:
        tensors.clear()
    report.results.append(Result("handoff", PICKLE, "ms", tuple(t["total"] * 1e3 for t in trials), params))


def _handoff_targets(report: Report) -> None:
    ours_1g = report.find("handoff", OURS, size_bytes=GiB)
    fs_1g = report.find("handoff", "torch file_system", size_bytes=GiB)
    value = ours_1g.median / fs_1g.median if ours_1g and fs_1g else None
    report.targets.append(
        SpeedTarget.at_most(
            "handoff.vs_torch_file_system",
            f"1 GiB hand-off <= {VS_TORCH_LIMIT:g} x torch file_system strategy",
            value,
            VS_TORCH_LIMIT,
            note="" if value is not None else "1 GiB not measured in this run",
        )
    )
    ours = [r for r in report.section("handoff") if r.case == OURS]
    if len(ours) >= 2:
        lo = min(ours, key=lambda r: r.params["size_bytes"])
        hi = max(ours, key=lambda r: r.params["size_bytes"])
        flat: float | None = hi.median / lo.median
        note = f"{hi.params['size']} over {lo.params['size']}"
    else:
        flat, note = None, "fewer than two sizes measured"
    report.targets.append(
        SpeedTarget.at_most(
            "handoff.flat",
            f"our hand-off is flat in size (largest / smallest <= {FLAT_LIMIT:g})",
            flat,
            FLAT_LIMIT,
            note=note,
        )
    )


def bench_migration(report: Report, settings: Settings) -> None:
    """First ``wrap`` (moves storage into a segment) against ``share_memory_()``."""
    device = settings.device
    if device != "cpu":
        report.skipped.append(
            Skip("migration", "all methods", f"{device} memory is shared in place; nothing migrates")
        )
        return
    for size in sizes_of(settings):
        params = size_params(size, device, settings.layout)
        why = no_room(2 * size, size, device)
        if why:
            report.skipped.append(Skip("migration", "all methods", why, params))
            continue
        runs = settings.repeats(3, 3 if size > 64 * MiB else 5)

        cases: list[tuple[str, str | None]] = [
            ("ours: first wrap", None),
            *((f"share_memory_ ({s})", s) for s in STRATEGIES),
        ]
        for label, strategy in cases:
            try:
                values = [_migrate_once(size, device, strategy, settings.layout) for _ in range(runs)]
            except LMCachePlatformError as exc:
                report.skipped.append(Skip("migration", label, str(exc).splitlines()[0], params))
                continue
            report.results.append(Result("migration", label, "ms", tuple(values), params))
        gc.collect()  # between sizes, in case anything was caught in a cycle
    main = ratio_rows(report.section("migration"), "ours: first wrap", "size_bytes")
    report.results = [r for r in report.results if r.section != "migration"] + main


def _migrate_once(size: int, device: str, strategy: str | None, layout: str = "vllm") -> float:
    """Milliseconds to move a fresh set into shared memory: ours if ``strategy`` is None."""
    from .. import wrap_kv_caches

    tensors = kv_set(size, device, layout)
    wrappers = []
    try:
        if strategy is None:
            t0 = time.perf_counter()
            wrappers = wrap_kv_caches(tensors)
            return (time.perf_counter() - t0) * 1e3
        with sharing_strategy(strategy):
            t0 = time.perf_counter()
            for t in tensors:
                t.share_memory_()  # type: ignore[no-untyped-call]
            return (time.perf_counter() - t0) * 1e3
    finally:
        for w in wrappers:
            w.close()  # the names go; the memory goes with the tensors
        tensors.clear()

"""The Valkey store: pipelined batches on one server, or per node of a Valkey Cluster.

One server: a batch is one pipeline (no transaction) on one connection, so one round
trip. A cluster: the batch is split by the client's slot map into one pipeline per
primary, and the pipelines run in parallel, so still about one round trip. The client's
own cluster pipeline is not used on purpose: it fails a whole batch when one node is
down, where a shared cache should lose only that node's keys (``RemotePartialError``,
also for a batch that went to that node alone; the whole call fails only when it asked
every primary and none answered).
A ``MOVED`` answer or a node that does not answer makes the store refresh its slot map,
at most once a second, in the background.

Every call runs through :class:`~._calls.Calls`, so it returns or raises within its
timeout whatever the network does. Client exceptions become the remote-store errors of
:mod:`lmcache_platform.remote`; none escapes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lmcache_platform.remote import (
    Buffer,
    RemoteError,
    RemotePartialError,
    RemoteTimeout,
    RemoteUnavailable,
)

from ._calls import Calls
from ._config import ValkeyConfig
from ._nodes import NodeGuard
from ._packer import Gathered, gather_packer

if TYPE_CHECKING:
    import valkey

logger = logging.getLogger(__name__)

_REFRESH_PERIOD_S = 1.0
#: Bytes the client's parser reads from the socket at once: large, for chunks of many MiB
#: (with libvalkey's parser, 1 MiB reads move a 64 MiB value about 4x faster than 64 KiB).
_READ_SIZE = 1 << 20
#: A pipeline command: (pipeline, key, value-or-None) -> None.
Queue = Callable[[Any, bytes, Any], None]
_T = TypeVar("_T")


class ValkeyStore:
    """A :class:`~lmcache_platform.remote.RemoteStore` on Valkey or Valkey Cluster."""

    def __init__(self, config: ValkeyConfig) -> None:
        self.config = config
        self.name = config.name
        self._calls = Calls(config.max_calls, config.name)
        self._nodes = NodeGuard(config.name, max(1, config.max_calls // 2))
        self._lock = threading.Lock()
        self._client: Any = None  # valkey.Valkey, or ValkeyCluster once a node answered
        self._refresh_at = 0.0
        self._closed = False

    # -- the RemoteStore protocol --------------------------------------------------------

    def get_many(self, keys: Sequence[bytes], *, timeout: float) -> list[Buffer | None]:
        return self._batch("get", keys, [None] * len(keys), lambda p, k, _: p.get(k), timeout, _value)

    def exists_many(self, keys: Sequence[bytes], *, timeout: float) -> list[bool]:
        return self._batch("exists", keys, [None] * len(keys), lambda p, k, _: p.exists(k), timeout, bool)

    def put_many(
        self, items: Sequence[tuple[bytes, Buffer]], *, ttl: float | None, timeout: float
    ) -> list[bool]:
        px = None if ttl is None else max(1, int(ttl * 1000))
        return self._batch(
            "put",
            [k for k, _ in items],
            [_as_arg(v) for _, v in items],
            lambda p, k, v: p.set(k, v, px=px),
            timeout,
            _stored,
        )

    def put_many_gather(
        self, items: Sequence[tuple[bytes, Sequence[Buffer]]], *, ttl: float | None, timeout: float
    ) -> list[bool]:
        """:meth:`put_many` with each value given as the buffers it is made of, in order: on one
        server, sent to the socket as they are (:class:`~._packer.Gathered`: the tier's entries,
        its header and the chunk's tensors, without a copy); to a cluster, joined first."""
        px = None if ttl is None else max(1, int(ttl * 1000))
        join = self.config.cluster  # the cluster client's connections pack with the default packer
        return self._batch(
            "put",
            [k for k, _ in items],
            [b"".join(parts) if join else Gathered(parts) for _, parts in items],
            lambda p, k, v: p.set(k, v, px=px),
            timeout,
            _stored,
        )

    def delete_many(self, keys: Sequence[bytes], *, timeout: float) -> list[bool]:
        """Remove each key (an entry the server's tier refused as damaged); ``True`` where removed."""
        return self._batch("delete", keys, [None] * len(keys), lambda p, k, _: p.delete(k), timeout, _removed)

    def ping(self, *, timeout: float) -> None:
        if self.config.cluster:
            self._ping_cluster(timeout)
            return
        outcome = self._calls.run([self._ping_standalone], timeout)[0]
        if isinstance(outcome, BaseException):
            raise _remote_error(self.name, "ping", outcome)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        self._calls.close()
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # closing sockets of a dead server: nothing to do but say so
                logger.debug("closing %s: %s", self.name, exc)

    # -- batches -------------------------------------------------------------------------

    def _batch(
        self,
        what: str,
        keys: Sequence[bytes],
        values: Sequence[Any],
        queue: Queue,
        timeout: float,
        answer: Callable[[Any], _T],
    ) -> list[_T]:
        """One pipelined batch; per item, ``answer`` of the reply (of ``None`` for a failed item)."""
        if not keys:
            return []
        if self.config.cluster:
            return self._items(what, self._cluster_batch(what, keys, values, queue, timeout), answer)
        outcome = self._calls.run([lambda: self._pipeline(self._standalone(), keys, values, queue)], timeout)[
            0
        ]
        if isinstance(outcome, BaseException):
            raise _remote_error(self.name, what, outcome)
        return self._items(what, outcome, answer)

    @staticmethod
    def _pipeline(client: Any, keys: Sequence[bytes], values: Sequence[Any], queue: Queue) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, values, strict=True):
            queue(pipe, k, v)
        return list(pipe.execute(raise_on_error=False))

    def _items(self, what: str, results: list[Any], answer: Callable[[Any], _T]) -> list[_T]:
        """Per-item errors (``MOVED``, a node down...) become absent items (``answer(None)``) of a
        :class:`RemotePartialError`, whose other items are answered as a whole call's are. An
        ``OOM`` reply (``maxmemory`` with ``noeviction``) is the store refusing the item, not
        failing: a put answers ``False``, and the tier counts and degrades on refusals."""
        clean = [answer(None if isinstance(r, Exception) else r) for r in results]
        failed = [i for i, r in enumerate(results) if isinstance(r, Exception) and not _refusal(r)]
        if not failed:
            return clean
        first = results[failed[0]]
        if any(_moved(results[i]) for i in failed):
            self._refresh_soon()
        raise RemotePartialError(
            f"{self.name}: {what}: {len(failed)} of {len(results)} items failed "
            f"(first: {type(first).__name__}: {first})",
            results=clean,
            failed=failed,
        )

    def _cluster_batch(
        self, what: str, keys: Sequence[bytes], values: Sequence[Any], queue: Queue, timeout: float
    ) -> list[Any]:
        """Split by node, one pipeline per node in parallel; a failed node fails only its items
        (their replies are its exception)."""
        started = time.monotonic()
        client = self._cluster_within(what, timeout)
        groups = self._route(client, keys)
        left = timeout - (time.monotonic() - started)

        def on(node: Any, idx: list[int]) -> list[Any]:
            conn = client.get_valkey_connection(node)
            return self._pipeline(conn, [keys[i] for i in idx], [values[i] for i in idx], queue)

        outcomes = self._ask([(node.name, functools.partial(on, node, idx)) for node, idx in groups], left)
        results: list[Any] = [None] * len(keys)
        node_errors: list[tuple[str, BaseException]] = []
        for (node, idx), outcome in zip(groups, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                node_errors.append((node.name, outcome))
                for i in idx:
                    results[i] = outcome
            else:
                for i, r in zip(idx, outcome, strict=True):
                    results[i] = r
        if node_errors:
            self._refresh_soon()
            if len(node_errors) == len(groups):
                # Nothing answered. If the call ran out of time (its deadline, or no free
                # slot), it is a timeout, as on one server: the tier pings to tell slow from
                # down. Otherwise the whole call failed only if it asked every primary: a
                # batch that went to a dead or hung node alone (its socket timed out; a
                # write-behind batch of one chunk) is that node's items failing, not the store.
                out_of_time = next((e for _, e in node_errors if isinstance(e, RemoteTimeout)), None)
                if out_of_time is not None:
                    raise out_of_time
                if len(groups) >= len(client.get_primaries()):
                    raise _remote_error(self.name, what, node_errors[0][1])
        return results

    def _ask(
        self, calls: Sequence[tuple[str, Callable[[], Any]]], timeout: float, *, probe: bool = False
    ) -> list[Any]:
        """One call per ``(node, call)``, in parallel: each one's answer, or why it failed or
        was not asked (:class:`NodeGuard`). ``probe``: a ping: resting nodes are asked too,
        and the first answer is enough."""
        outcomes: list[Any] = [self._nodes.refusal(node, probe=probe) for node, _ in calls]
        asked = [n for n, refused in enumerate(outcomes) if refused is None]
        ran = self._calls.run([self._nodes.call(*calls[n]) for n in asked], timeout, first=probe)
        for n, outcome in zip(asked, ran, strict=True):
            outcomes[n] = outcome
        return outcomes

    @staticmethod
    def _route(client: Any, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        """The primary of each key, by the client's slot map (no network)."""
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, k in enumerate(keys):
            node = client.nodes_manager.get_node_from_slot(client.keyslot(k))
            by_node.setdefault(node.name, (node, []))[1].append(i)
        return list(by_node.values())

    def _ping_standalone(self) -> None:
        self._standalone().ping()

    def _ping_cluster(self, timeout: float) -> None:
        """Every primary at once; the cluster answers if one of them does (a dead or hung node
        costs only its keys, and must not make the tier stop calling the others)."""
        started = time.monotonic()
        client = self._cluster_within("ping", timeout)
        primaries = client.get_primaries()
        if not primaries:
            raise RemoteUnavailable(f"{self.name}: ping: the slot map lists no primary")
        left = timeout - (time.monotonic() - started)

        def ping(node: Any) -> Any:
            return client.get_valkey_connection(node).ping()

        outcomes = self._ask(
            [(node.name, functools.partial(ping, node)) for node in primaries], left, probe=True
        )
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if len(errors) == len(outcomes):
            raise _remote_error(self.name, "ping", errors[0])

    # -- clients -------------------------------------------------------------------------

    def _standalone(self) -> valkey.Valkey:
        with self._lock:
            if self._closed:
                raise RemoteUnavailable(f"{self.name}: the store is closed")
            if self._client is None:
                import valkey

                ((host, port),) = self.config.hosts
                kwargs = self.config.client_kwargs()
                kind = valkey.SSLConnection if kwargs.pop("ssl", False) else valkey.Connection
                pool = valkey.ConnectionPool(
                    connection_class=kind,
                    host=host,
                    port=port,
                    db=self.config.db,
                    socket_read_size=_READ_SIZE,
                    command_packer=gather_packer(),
                    **kwargs,
                )
                self._client = valkey.Valkey(connection_pool=pool)
            return self._client  # type: ignore[no-any-return]

    def _cluster_within(self, what: str, timeout: float) -> Any:
        """The cluster client; creating it asks a node for the slot map, so within the deadline."""
        client = self._client
        if client is None:
            made = self._calls.run([self._cluster], timeout)[0]
            if isinstance(made, BaseException):
                raise _remote_error(self.name, what, made)
            client = made
        return client

    def _cluster(self) -> Any:
        """The cluster client, created on first use (creating it asks a node for the slot map)."""
        with self._lock:
            if self._closed:
                raise RemoteUnavailable(f"{self.name}: the store is closed")
            if self._client is not None:
                return self._client
        from valkey.cluster import ClusterNode, ValkeyCluster

        client = ValkeyCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.config.hosts],  # type: ignore[no-untyped-call]
            require_full_coverage=False,
            cluster_error_retry_attempts=0,
            **self.config.client_kwargs(),
        )
        with self._lock:
            winner = self._adopt(client)
        if winner is not client:  # closed meanwhile, or another call made one first
            client.close()  # type: ignore[no-untyped-call]
        if winner is None:
            raise RemoteUnavailable(f"{self.name}: the store is closed")
        return winner

    def _adopt(self, client: Any) -> Any:
        """Under the lock: keep ``client`` unless the store closed or already has one."""
        if self._client is None and not self._closed:
            self._client = client
        return self._client

    def _refresh_soon(self) -> None:
        """Re-read the slot map in the background, at most once per second."""
        now = time.monotonic()
        with self._lock:
            client = self._client
            if client is None or not self.config.cluster or now < self._refresh_at:
                return
            self._refresh_at = now + _REFRESH_PERIOD_S

        def refresh() -> None:
            client.nodes_manager.initialize()

        outcome = self._calls.run([refresh], 0.0)[0]  # do not wait: it runs on its own
        if isinstance(outcome, BaseException) and not isinstance(outcome, RemoteTimeout):
            logger.debug("%s: slot map refresh failed: %s", self.name, outcome)


def _value(reply: Any) -> bytes | None:
    """A ``GET`` reply as ``get_many`` answers it: the bytes, or ``None`` (absent, failed)."""
    return reply if isinstance(reply, bytes) else None


def _stored(reply: Any) -> bool:
    """A ``SET`` reply as ``put_many`` answers it: ``True`` only for the server's OK."""
    return reply is True


def _removed(reply: Any) -> bool:
    """A ``DEL`` reply as ``delete_many`` answers it: ``True`` where a key was removed."""
    return isinstance(reply, int) and reply > 0


def _as_arg(value: Buffer) -> bytes | memoryview:
    """A value the client sends as is (it takes ``bytes`` and byte ``memoryview``, not ``bytearray``)."""
    if isinstance(value, bytes):
        return value
    view = memoryview(value)
    return view if view.format == "B" and view.ndim == 1 and view.contiguous else view.cast("B")


def _refusal(result: Any) -> bool:
    """An item the server refused while answering (``OOM command not allowed``), not a failure."""
    return type(result).__name__ == "OutOfMemoryError" or str(result).startswith("OOM ")


def _moved(result: Any) -> bool:
    return type(result).__name__ in ("MovedError", "AskError", "TryAgainError", "ClusterDownError")


def _remote_error(name: str, what: str, exc: BaseException) -> RemoteError:
    """The remote-store error for a client exception (a RemoteError already is one)."""
    if isinstance(exc, RemoteError):
        return exc
    import valkey.exceptions as vx

    text = f"{name}: {what}: {type(exc).__name__}: {exc}"
    # Anything else (refused connection, bad credentials, a cluster with no slot map) means
    # this store cannot serve the call now.
    err: RemoteError = RemoteTimeout(text) if isinstance(exc, vx.TimeoutError) else RemoteUnavailable(text)
    err.__cause__ = exc
    return err

"""The coordination store over a real etcd: :class:`EtcdStore`, the
:class:`~rallypoint.etcd.store.Store` of production.

It speaks etcd's API through the generated gRPC stubs of the ``etcd3`` client
package (``etcd3.etcdrpc``) over a channel of our own. We do not use the
package's high-level client: it marks an endpoint failed for 300 s after one
error (so a few seconds of etcd downtime would cut a process off for minutes)
and it drops the header revision of transactions, which we use as fencing
tokens and incarnation numbers. A write that times out or loses its connection
raises :class:`~rallypoint.basics.errors.WriteIndeterminate`; a watch from a
compacted revision, :class:`~rallypoint.basics.errors.WatchCompacted`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from rallypoint.basics.errors import (
    LeaseNotFound,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
    WriteIndeterminate,
)
from rallypoint.basics.tls import AUTO, TlsConfig, resolve
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.etcd.store import (
    Compare,
    Delete,
    Get,
    KeyValue,
    LeaseGrant,
    Op,
    Put,
    TxnResult,
    WatchBatch,
    WatchEvent,
    prefix_end,
)

__all__ = ["CLIENT_CONNECT_WAIT_S", "EtcdStore"]


def _b(v: bytes | str) -> bytes:
    return v if isinstance(v, bytes) else v.encode()


def _kv(m: Any) -> KeyValue:
    return KeyValue(
        key=m.key.decode(),
        value=bytes(m.value),
        create_revision=m.create_revision,
        mod_revision=m.mod_revision,
        version=m.version,
        lease=m.lease,
    )


CLIENT_CONNECT_WAIT_S = 5.0  # a CLI's store: how long a connection cut short is redialled before a call fails

_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}

_TARGETS = {
    "version": etcdrpc.Compare.VERSION,
    "create": etcdrpc.Compare.CREATE,
    "mod": etcdrpc.Compare.MOD,
    "value": etcdrpc.Compare.VALUE,
    "lease": etcdrpc.Compare.LEASE,
}
_RESULTS = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}
_TARGET_FIELD = {
    "version": "version",
    "create": "create_revision",
    "mod": "mod_revision",
    "value": "value",
    "lease": "lease",
}


def _lease_of(request: Any) -> int:
    """The lease a request names (for a transaction: the first put that names one)."""
    if isinstance(request, etcdrpc.TxnRequest):
        for op in (*request.success, *request.failure):
            if op.WhichOneof("request") == "request_put" and op.request_put.lease:
                return int(op.request_put.lease)
        return 0
    return int(getattr(request, "ID", 0) or getattr(request, "lease", 0))


class EtcdStore:
    """:class:`~rallypoint.etcd.store.Store` over a real etcd cluster.

    Args:
        endpoints: ``host:port`` of each member's client URL. Requests are spread
            over them (gRPC round robin), so losing a member does not lose the store.
        request_timeout_s: deadline of each unary request. A write past it is
            indeterminate.
        tls: mutual TLS to etcd (:class:`~rallypoint.basics.tls.TlsConfig`); etcd started with
            ``--client-cert-auth`` takes the user from the certificate's common name. The
            members' certificates must name the first endpoint's host (the name checked).
            None: plain; ``AUTO`` (the default): the identity (or plain) a local cluster or
            etcd of this process recorded for these endpoints, and a ConfigError naming the
            endpoints when none did: never a silent fall-back to plain TCP.
        connect_wait_s: wait up to this long for the channel to connect before the first call,
            redialling a connection cut short (a TLS handshake a loaded host's etcd drops): a short-lived
            client (a CLI command) makes few calls and would otherwise fail on the first one. Past it the
            calls go on and fail as usual, naming etcd unreachable. 0: no wait (long-lived processes, whose
            loops retry).
    """

    def __init__(self, endpoints: Sequence[str], *, request_timeout_s: float = 2.0, tls: Any = AUTO,
                 connect_wait_s: float = 0.0) -> None:
        if not endpoints:
            raise StoreError("no etcd endpoints given; pass --cluster HOST:PORT[,HOST:PORT...]")
        self.endpoints = list(endpoints)
        self.request_timeout_s = request_timeout_s
        self.tls: TlsConfig | None = resolve(tls, self.endpoints)
        target = "ipv4:" + ",".join(self.endpoints)
        authority = [("grpc.default_authority", self.endpoints[0])] if self.tls is not None else []
        self._channel = tls_channel(
            target, self.tls,
            options=[*authority,
                ("grpc.lb_policy_name", "round_robin"),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500),
                ("grpc.enable_retries", 0),
            ],
        )
        self._kv = etcdrpc.KVStub(self._channel)
        self._lease = etcdrpc.LeaseStub(self._channel)
        self._watch = etcdrpc.WatchStub(self._channel)
        self._maintenance = etcdrpc.MaintenanceStub(self._channel)
        if connect_wait_s > 0:
            ready = grpc.channel_ready_future(self._channel)
            try:
                ready.result(timeout=connect_wait_s)
            except grpc.FutureTimeoutError:
                ready.cancel()  # unreachable for now: the first call says so

    # -- errors ---------------------------------------------------------------

    def _fail(self, exc: grpc.RpcError, *, write: bool, what: str) -> StoreError:
        code = exc.code()
        detail = exc.details() or ""
        if "lease not found" in detail:
            return StoreError(f"{what}: {detail}")
        if "compacted" in detail:
            return StoreError(f"{what}: {detail}")
        if code in _TRANSIENT:
            if write:
                return WriteIndeterminate(f"{what} may or may not have applied: {code.name} {detail}")
            return StoreUnavailable(f"{what} failed: etcd unreachable ({code.name} {detail})")
        return StoreError(f"{what}: {code.name} {detail}")

    def _call(self, method: Any, request: Any, *, write: bool, what: str) -> Any:
        try:
            return method(request, timeout=self.request_timeout_s, wait_for_ready=False)
        except grpc.RpcError as exc:
            if "requested lease not found" in (exc.details() or ""):
                raise LeaseNotFound(_lease_of(request)) from None
            raise self._fail(exc, write=write, what=what) from None

    # -- key/value ------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        r = self._call(self._kv.Range, etcdrpc.RangeRequest(key=_b(key)), write=False, what=f"get {key}")
        return _kv(r.kvs[0]) if r.kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision they were read at."""
        p = _b(prefix)
        r = self._call(
            self._kv.Range,
            etcdrpc.RangeRequest(key=p, range_end=prefix_end(p)),
            write=False,
            what=f"get prefix {prefix}",
        )
        return [_kv(m) for m in r.kvs], r.header.revision

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        r = self._call(
            self._kv.Put,
            etcdrpc.PutRequest(key=_b(key), value=_b(value), lease=lease),
            write=True,
            what=f"put {key}",
        )
        return r.header.revision

    def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (or its prefix); returns how many keys were deleted."""
        k = _b(key)
        req = etcdrpc.DeleteRangeRequest(key=k, range_end=prefix_end(k) if prefix else b"")
        return self._call(self._kv.DeleteRange, req, write=True, what=f"delete {key}").deleted

    def _op(self, op: Op) -> Any:
        if isinstance(op, Put):
            return etcdrpc.RequestOp(
                request_put=etcdrpc.PutRequest(key=_b(op.key), value=_b(op.value), lease=op.lease)
            )
        k = _b(op.key)
        end = prefix_end(k) if op.prefix else b""
        if isinstance(op, Delete):
            return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=k, range_end=end))
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=k, range_end=end))

    def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """Apply ``success`` if every compare holds, else ``failure``, atomically."""
        cmp = []
        for c in compares:
            m = etcdrpc.Compare(key=_b(c.key), target=_TARGETS[c.target], result=_RESULTS[c.op])
            value = _b(c.value) if c.target == "value" else c.value
            setattr(m, _TARGET_FIELD[c.target], value)
            cmp.append(m)
        req = etcdrpc.TxnRequest(
            compare=cmp,
            success=[self._op(o) for o in success],
            failure=[self._op(o) for o in failure],
        )
        writes = any(not isinstance(o, Get) for o in (*success, *failure))
        r = self._call(self._kv.Txn, req, write=writes, what="transaction")
        reads = [
            [_kv(m) for m in resp.response_range.kvs]
            for resp in r.responses
            if resp.WhichOneof("response") == "response_range"
        ]
        return TxnResult(succeeded=r.succeeded, revision=r.header.revision, reads=reads)

    def compact(self, revision: int) -> None:
        self._call(
            self._kv.Compact, etcdrpc.CompactionRequest(revision=revision), write=True, what="compact"
        )

    def revision(self) -> int:
        """The store's current revision."""
        r = self._call(
            self._kv.Range, etcdrpc.RangeRequest(key=b"\0", limit=1), write=False, what="revision"
        )
        return r.header.revision

    # -- leases ---------------------------------------------------------------

    def grant_lease(self, ttl_s: int) -> LeaseGrant:
        r = self._call(
            self._lease.LeaseGrant, etcdrpc.LeaseGrantRequest(TTL=ttl_s), write=True, what="lease grant"
        )
        if r.error:
            raise StoreError(f"lease grant refused: {r.error}")
        return LeaseGrant(id=r.ID, ttl_s=r.TTL)

    def keepalive(self, lease_id: int) -> int:
        """Refresh ``lease_id``; return its new TTL in seconds, 0 if the lease is gone."""
        try:
            stream = self._lease.LeaseKeepAlive(
                iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=self.request_timeout_s
            )
            for resp in stream:
                return int(resp.TTL)
        except grpc.RpcError as exc:
            raise self._fail(exc, write=False, what=f"keepalive {lease_id:x}") from None
        raise StoreUnavailable(f"keepalive {lease_id:x}: stream closed without an answer")

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke ``lease_id`` and delete its keys. Revoking a lease already gone is not an error."""
        try:
            self._call(
                self._lease.LeaseRevoke,
                etcdrpc.LeaseRevokeRequest(ID=lease_id),
                write=True,
                what=f"revoke lease {lease_id:x}",
            )
        except LeaseNotFound:
            pass

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on ``lease_id``; -1 when it does not exist."""
        r = self._call(
            self._lease.LeaseTimeToLive,
            etcdrpc.LeaseTimeToLiveRequest(ID=lease_id),
            write=False,
            what=f"lease ttl {lease_id:x}",
        )
        return int(r.TTL)

    # -- watches --------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int) -> _EtcdWatch:
        """Watch every key under ``prefix`` from ``start_revision`` on (inclusive).

        Iterating the result yields :class:`WatchBatch` es, the first one empty
        once etcd has created the watch. It raises
        :class:`WatchCompacted` when ``start_revision`` is already compacted and
        :class:`StoreUnavailable` when the stream breaks; resume with a new watch
        from the last batch's revision + 1.
        """
        p = _b(prefix)
        create = etcdrpc.WatchCreateRequest(
            key=p, range_end=prefix_end(p), start_revision=start_revision, prev_kv=True
        )
        return _EtcdWatch(self._watch, etcdrpc.WatchRequest(create_request=create), start_revision)

    def close(self) -> None:
        self._channel.close()


class _EtcdWatch:
    """One etcd watch stream."""

    def __init__(self, stub: Any, create: Any, start_revision: int) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._requests.put(create)
        self._start_revision = start_revision
        self._cancelled = threading.Event()
        self._call = stub.Watch(self._request_iter())

    def _request_iter(self) -> Iterator[Any]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def cancel(self) -> None:
        """Stop the watch; a blocked iteration ends without error."""
        self._cancelled.set()
        self._requests.put(None)
        self._call.cancel()

    def __iter__(self) -> Iterator[WatchBatch]:
        try:
            for resp in self._call:
                if resp.compact_revision:
                    raise WatchCompacted(self._start_revision, resp.compact_revision)
                if resp.canceled:
                    raise StoreUnavailable(f"etcd cancelled the watch: {resp.cancel_reason}")
                if not resp.events:
                    if resp.created:
                        # Tell the consumer the watch is established (it is healthy).
                        yield WatchBatch(revision=resp.header.revision, events=[])
                    continue
                events = [
                    WatchEvent(
                        type="delete" if e.type == kv_pb2.Event.DELETE else "put",
                        kv=_kv(e.kv),
                        prev=_kv(e.prev_kv) if e.HasField("prev_kv") else None,
                    )
                    for e in resp.events
                ]
                yield WatchBatch(revision=resp.header.revision, events=events)
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return
            raise StoreUnavailable(f"watch stream broke: {exc.code().name} {exc.details()}") from None
        if not self._cancelled.is_set():
            raise StoreUnavailable("watch stream ended")

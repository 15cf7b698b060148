"""Worker-to-worker pushes: over the peer's data plane (plain TCP, zero-copy; see
:mod:`rallypoint.workers.dataplane`) when it has one, else as a gRPC ``Push`` stream
(:func:`rallypoint.proto.codec.chunks`) on one cached channel per peer; bounded retries.

Transient failures (:data:`~rallypoint.basics.retry.TRANSIENT_RPC_CODES`, the set every
call between workers retries on) are retried with the shared policy
(:func:`~rallypoint.basics.retry.retrying`: exponential backoff at most 1 s apart, on the
channels' clock) until the push is cancelled, which is its stop condition: the peer
unreachable, a deadline, overload, this worker or the peer fenced (a fence lifts when
etcd answers again and the lease is alive, however long etcd was away;
FAILED_PRECONDITION is also what a peer's ended incarnation gets).
A push is cancelled when its job is unloaded or recovery moved its consumer (the
producer's output log still holds the value and sends it to the new place), so a
value is never dropped while its consumer may still need it. A failure that is not
transient is logged and dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from tenacity import RetryCallState

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.retry import retrying, transient_rpc
from rallypoint.basics.tls import KEEPALIVE, TlsConfig
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from rallypoint.workers import meter
from rallypoint.workers.dataplane import DataPlaneClient, DataPlaneError, Status

PUSH_TIMEOUT_S = 120.0
PUSH_WARN_S = 30.0  # a push still retrying is logged this often


class NotAllowed(Exception):
    """The sender may not act now (fenced); the push is retried."""


class PeerChannels:
    """The channels this worker pushes on, one per peer address, kept for the process.

    ``clock``: what retries wait on (every push, and the in-memory tier's copies).
    """

    def __init__(self, tls: TlsConfig | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._tls = tls
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.WorkerRuntimeStub] = {}
        self._data = DataPlaneClient(timeout_s=PUSH_TIMEOUT_S, tls=tls)

    def stub(self, address: str, worker: str = "") -> pb_grpc.WorkerRuntimeStub:
        """The stub of the peer at ``address``; with ``worker``, one whose certificate must name that worker."""
        key = f"{worker}@{address}" if worker else address
        with self._lock:
            stub = self._stubs.get(key)
            if stub is None:
                self._channels[key] = tls_channel(address, self._tls, KEEPALIVE, worker=worker or None)
                stub = self._stubs[key] = pb_grpc.WorkerRuntimeStub(self._channels[key])
            return stub

    def send(self, address: str, header: pb.TransferHeader, leaves: list[Any], *, data_plane: bool = False) -> bool:
        """One attempt: push the value; returns whether the peer already had it."""
        if data_plane:
            duplicate = self._data.send(address, header, leaves)
        else:
            duplicate = bool(self.stub(address, header.to.worker_id).Push(codec.chunks(header, leaves), timeout=PUSH_TIMEOUT_S).duplicate)
        meter.transferred("sent", leaves)  # docs/metrics.md
        return duplicate

    def push(self, address: str, header: pb.TransferHeader, leaves: list[Any], *, may_act: Callable[[], None],
             cancelled: Callable[[], bool], log: Any, data_plane: bool = False,
             send: Callable[[], bool] | None = None) -> bool | None:
        """Push with retries; returns ``duplicate``, or None when it was not delivered (logged).

        ``may_act`` raises :class:`NotAllowed` while the sender is fenced; ``cancelled``
        ends the retries (the job was unloaded). ``send``: one attempt made otherwise (a
        multi-host slice's members each send their shards: :mod:`rallypoint.workers.gang.pieces`).
        """

        def attempt() -> bool | None:
            if cancelled():
                return None
            may_act()
            if send is not None:
                return send()
            return self.send(address, header, leaves, data_plane=data_plane)

        def retryable(exc: BaseException) -> bool:
            return isinstance(exc, NotAllowed) or transient_rpc(exc) or (
                isinstance(exc, DataPlaneError) and exc.retryable)

        where = {"to_worker": header.to.worker_id, "address": address, "consumer": header.consumer_node,
                 "arg": header.arg, "step": header.step, "microbatch": header.microbatch}
        clock = self.clock
        warned = [clock.monotonic()]

        def still_retrying(state: RetryCallState) -> None:
            if clock.monotonic() - warned[0] >= PUSH_WARN_S:
                warned[0] = clock.monotonic()
                exc = state.outcome.exception() if state.outcome else None
                log.warning("push.retrying", attempts=state.attempt_number, error=f"{type(exc).__name__}: {exc}",
                            **where)

        try:
            # Until it is delivered, or cancelled (its stop condition): a value is never dropped while its
            # consumer may still need it.
            return retrying(clock=clock, what="push", retry_if=retryable, should_stop=cancelled, initial_s=0.05,
                            max_s=1.0, jitter_s=0.05, before_sleep=still_retrying)(attempt)
        except NotAllowed:
            if not cancelled():  # unreachable: only a cancellation stops the retries
                log.warning("push.failed", error="fenced", **where)
        except DataPlaneError as exc:
            if exc.status is Status.NO_JOB:  # the consumer's worker no longer holds the job
                log.info("push.no_job", error=str(exc), **where)
            elif not cancelled():
                log.warning("push.failed", code=exc.status.name if exc.status else "CONNECTION", error=str(exc),
                            **where)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the consumer's worker no longer holds the job
                log.info("push.no_job", error=exc.details(), **where)
            elif not cancelled():
                log.warning("push.failed", code=exc.code().name, error=exc.details(), **where)
        except Exception as exc:  # a push thread must never die silently
            if not cancelled():
                log.warning("push.failed", error=f"{type(exc).__name__}: {exc}", **where)
        return None

    def close(self) -> None:
        with self._lock:
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for ch in channels:
            ch.close()
        self._data.close()


class PushPools:
    """The pushes of one job's outputs to other workers: one thread pool per consumer worker
    incarnation (a stuck peer holds up no other), and a count of pushes not yet ended."""

    def __init__(self, job: str, threads: int) -> None:
        self.job, self.threads = job, threads
        self._pools: dict[tuple[str, int], futures.ThreadPoolExecutor] = {}
        self._pending = 0
        self._cv = threading.Condition()

    def submit(self, target: tuple[str, int], fn: Callable[..., None], *args: Any) -> futures.Future[None]:
        """Run ``fn(*args)`` on the target's pool; the future ends when it ran or was cancelled."""
        if target not in self._pools:
            self._pools[target] = futures.ThreadPoolExecutor(max_workers=self.threads,
                                                             thread_name_prefix=f"push-{self.job}-{target[0]}")
        with self._cv:
            self._pending += 1
        future = self._pools[target].submit(fn, *args)
        future.add_done_callback(self._ended)
        return future

    def _ended(self, _future: futures.Future[None]) -> None:
        with self._cv:
            self._pending -= 1
            self._cv.notify_all()

    def keep_only(self, targets: set[tuple[str, int]]) -> None:
        """Drop the pools of consumers no route names (moved away: the output log has their values)."""
        for target in [t for t in self._pools if t not in targets]:
            self._pools.pop(target).shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        self.keep_only(set())

    def wait_idle(self, timeout_s: float) -> tuple[bool, int]:
        """Wait until every push submitted so far has ended; whether they did, and how many are left."""
        with self._cv:
            done = self._cv.wait_for(lambda: self._pending <= 0, timeout_s)
            return done, self._pending

"""Retries of calls between workers: one set of transient codes, the shared policy on the injected clock.

A push of a value (workers/transfer.py) retries until it is delivered or cancelled (its
stop condition); a copy of a checkpoint to its holder (workers/checkpoints/replicas.py) retries for at
most ``PUSH_RETRY_S`` of its clock. Both on ``TRANSIENT_RPC_CODES``; neither on a cancellation.
No test here waits: the clock is a FakeClock.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from rallypoint.basics.clock import FakeClock
from rallypoint.basics.retry import TRANSIENT_RPC_CODES
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.checkpoints.replicas import PUSH_RETRY_S, Replicator
from rallypoint.workers.transfer import PeerChannels

C = grpc.StatusCode


class RpcFailed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _add(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    info = warning = error = _add


class Failing:
    """``send`` that fails ``failures`` times with ``code``, then delivers."""

    def __init__(self, code: grpc.StatusCode, failures: int) -> None:
        self.code, self.failures, self.calls = code, failures, 0

    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            raise RpcFailed(self.code)
        return False


def channels(send: Failing) -> tuple[PeerChannels, FakeClock]:
    clock = FakeClock()
    peers = PeerChannels(clock=clock)
    peers.send = send  # type: ignore[method-assign]
    return peers, clock


HEADER = pb.TransferHeader(job="j", consumer_node="n", arg="x", step=3)


@pytest.mark.parametrize("code", sorted(TRANSIENT_RPC_CODES, key=lambda c: c.name))
def test_a_push_retries_each_transient_code_on_the_injected_clock_until_delivered(code: grpc.StatusCode) -> None:
    send = Failing(code, 40)
    peers, clock = channels(send)
    t0 = clock.monotonic()
    try:
        assert peers.push("a:1", HEADER, [], may_act=lambda: None, cancelled=lambda: False, log=Log()) is False
    finally:
        peers.close()
    assert send.calls == 41
    assert 30 <= clock.monotonic() - t0 <= 45  # backoff capped at 1 s (+ jitter): waited on the fake clock only


def test_a_push_stops_when_cancelled_and_never_retries_a_cancellation_or_a_missing_job() -> None:
    send = Failing(C.UNAVAILABLE, 10**6)
    peers, _ = channels(send)
    log = Log()
    try:
        assert peers.push("a:1", HEADER, [], may_act=lambda: None, cancelled=lambda: send.calls >= 5, log=log) is None
        assert send.calls == 5 and not [e for e, _ in log.events if e == "push.failed"]  # cancelled: not a failure
        for code in (C.CANCELLED, C.NOT_FOUND, C.INVALID_ARGUMENT):
            once = Failing(code, 10**6)
            peers.send = once  # type: ignore[method-assign]
            assert peers.push("a:1", HEADER, [], may_act=lambda: None, cancelled=lambda: False, log=log) is None
            assert once.calls == 1, code
    finally:
        peers.close()


class Holder:
    """A replica holder's stub: fails ``failures`` times with ``code``, then stores."""

    def __init__(self, code: grpc.StatusCode, failures: int) -> None:
        self.code, self.failures, self.calls = code, failures, 0

    def PushReplica(self, chunks: Any, timeout: float) -> pb.PushReplicaResponse:
        list(chunks)
        self.calls += 1
        if self.calls <= self.failures:
            raise RpcFailed(self.code)
        return pb.PushReplicaResponse(stored=True)


class FakePeers:
    def __init__(self, holder: Holder) -> None:
        self.clock, self.holder = FakeClock(), holder

    def stub(self, address: str, worker: str = "") -> Holder:
        return self.holder


def push_replica(holder: Holder) -> tuple[Replicator, FakePeers]:
    peers = FakePeers(holder)
    target = pb.ReplicaPeer(slice="s", worker_id="h", address="h:1", incarnation=7)
    rep = Replicator(peers, [target], cluster="c", worker_id="w1", incarnation=3, log=Log())  # type: ignore[arg-type]
    states = {"p": [np.arange(4, dtype=np.float32)]}
    try:
        rep._push(target, CheckpointCommit("j", "s", 10, "/none/10", "sum"), states)
    finally:
        rep.close()
    return rep, peers


@pytest.mark.parametrize("code", sorted(TRANSIENT_RPC_CODES, key=lambda c: c.name))
def test_a_checkpoint_copy_retries_the_same_transient_codes_as_a_push(code: grpc.StatusCode) -> None:
    rep, _ = push_replica(Holder(code, 3))
    assert rep.pushed == [("s", 10, "h")]


def test_a_checkpoint_copy_gives_up_after_its_limit_on_the_injected_clock_and_never_retries_a_cancellation() -> None:
    holder = Holder(C.UNAVAILABLE, 10**6)
    t0 = FakeClock().monotonic()
    rep, peers = push_replica(holder)
    assert rep.pushed == [] and PUSH_RETRY_S <= peers.clock.monotonic() - t0 <= PUSH_RETRY_S + 1.1
    once = Holder(C.CANCELLED, 10**6)
    rep, _ = push_replica(once)
    assert rep.pushed == [] and once.calls == 1

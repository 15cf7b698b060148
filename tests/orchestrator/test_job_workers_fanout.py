"""Rewires and fetches go to every worker at once, each with a deadline that follows from its bytes.

Workers here are in-process gRPC servers that answer ``Rewire`` and ``FetchState`` as
scripted (slow, stuck, streaming at a pace), over real loopback channels.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from rallypoint.recovery.decide import Verdict
from rallypoint.orchestrator.job.workers import JobWorkers, transfer_deadline_s
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc


class Scripted(pb_grpc.WorkerRuntimeServicer):
    """``Rewire`` waits at a barrier of all workers (or forever: ``stuck``); ``FetchState``
    streams ``chunks`` values of ``chunk_bytes`` each, ``pace_s`` apart, then hangs if ``stuck``."""

    def __init__(self, barrier: threading.Barrier, *, stuck: bool = False, chunks: int = 1, chunk_bytes: int = 8,
                 pace_s: float = 0.0) -> None:
        self.barrier, self.stuck, self.chunks, self.chunk_bytes, self.pace_s = barrier, stuck, chunks, chunk_bytes, pace_s
        self.release = threading.Event()

    def Rewire(self, request: pb.RewireRequest, context: Any) -> pb.RewireResponse:
        if self.stuck:
            self.release.wait(30)
        else:
            self.barrier.wait(10)  # every worker's rewire is in flight at once, or this times out
        return pb.RewireResponse(resent=len(request.resend_to), log_from=request.from_step)

    def FetchState(self, request: pb.FetchStateRequest, context: Any) -> Iterator[pb.StateValue]:
        for i in range(self.chunks):
            time.sleep(self.pace_s)
            yield pb.StateValue(state=f"{request.to.worker_id}-{i}",
                                leaves=[pb.Tensor(dtype="uint8", shape=[self.chunk_bytes], data=bytes(self.chunk_bytes))])
        if self.stuck:
            self.release.wait(30)


@pytest.fixture
def servers() -> Iterator[list[tuple[grpc.Server, Scripted]]]:
    started: list[tuple[grpc.Server, Scripted]] = []
    yield started
    for server, servicer in started:
        servicer.release.set()
        server.stop(grace=None)


def workers_of(servers: list[tuple[grpc.Server, Scripted]], scripts: dict[str, Scripted], **settings: Any) -> JobWorkers:
    jw = JobWorkers("j", **settings)
    for w, servicer in scripts.items():
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_WorkerRuntimeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, servicer))
        jw.identity[w] = pb.Identity(cluster="c", worker_id=w, incarnation=1)
        jw._stub(w, f"127.0.0.1:{port}")
    return jw


def test_the_deadline_is_a_base_plus_the_bytes_at_a_conservative_bandwidth() -> None:
    assert transfer_deadline_s(0, base_s=5, bytes_per_s=1e6) == 5
    assert transfer_deadline_s(3_000_000, base_s=5, bytes_per_s=1e6) == 8
    with pytest.raises(ValueError, match="bandwidth > 0"):
        JobWorkers("j", transfer_bytes_per_s=0)


def test_survivors_are_rewired_at_once_and_a_stuck_one_fails_at_its_bytes_deadline(servers: list) -> None:  # type: ignore[type-arg]
    barrier = threading.Barrier(3)
    jw = workers_of(servers, {"w0": Scripted(barrier), "w1": Scripted(barrier), "w2": Scripted(barrier),
                              "stuck": Scripted(barrier, stuck=True)}, transfer_base_s=0.5, transfer_bytes_per_s=1e6)
    jw.log_bytes["stuck"] = 1_000_000  # its log: a resend may move 1 MB, one more second at 1 MB/s
    reqs = {w: jw.rewire_request(w, [], ["n"], 4, 8) for w in ("w0", "w1", "w2", "stuck")}
    t0 = time.monotonic()
    answers, failed = jw.rewire_all(reqs)
    took = time.monotonic() - t0
    assert sorted(answers) == ["w0", "w1", "w2"] and all(a.log_from == 4 for a in answers.values())
    assert list(failed) == ["stuck"] and failed["stuck"].code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed["stuck"].verdict is Verdict.SUSPECT
    assert 1.4 <= took < 6, f"the stuck rewire ended after {took:.2f} s, not at its 1.5 s deadline"
    jw.close()


def test_fetches_run_at_once_a_steady_stream_outlives_the_base_and_a_stalled_one_is_cut(servers: list) -> None:  # type: ignore[type-arg]
    # base 1 s at 1 MB/s: "steady" sends 0.3 MB every 0.25 s (2 s in all, its allowance grows
    # faster than the clock); "stalled" sends 0.3 MB and then nothing (cut at 1.3 s).
    barrier = threading.Barrier(1)
    jw = workers_of(servers, {"steady": Scripted(barrier, chunks=8, chunk_bytes=300_000, pace_s=0.25),
                              "stalled": Scripted(barrier, stuck=True, chunk_bytes=300_000)},
                    transfer_base_s=1.0, transfer_bytes_per_s=1e6)
    t0 = time.monotonic()
    states, failed = jw.fetch_all()
    took = time.monotonic() - t0
    assert [s.state for s in states] == [f"steady-{i}" for i in range(8)]
    assert list(failed) == ["stalled"] and failed["stalled"].code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "past its deadline" in failed["stalled"].details
    assert 1.9 <= took < 6, f"the fetches took {took:.2f} s: not at once, or the stalled one was not cut"
    with pytest.raises(Exception, match="stalled"):
        jw.fetch()
    jw.close()

"""The leader's link to each worker: an ``Attach`` stream whose heartbeats say the worker lives.

The coordinator (:mod:`~rallypoint.orchestrator.service.coordinator`) keeps one :class:`WorkerLink` per
registered worker incarnation while it leads. A broken stream is the fast signal of a dead process:
a short ``Ping`` tells a worker gone (``suspect(..., reason="connection_lost")``) from a stream that
only broke, which is opened again with backoff. The time of the last heartbeat (``heard_at``) is
what the coordinator's silence check reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc

from rallypoint.basics.clock import Clock
from rallypoint.basics.retry import retrying
from rallypoint.basics.tls import TlsConfig
from rallypoint.basics.tls import channel as tls_channel
from rallypoint.etcd.cluster_view import WorkerInfo
from rallypoint.orchestrator.job.failures import classify_rpc_error
from rallypoint.recovery.decide import Verdict
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

LINK_BACKOFF_S = 0.1  # a broken Attach stream is opened again after 0.1 s, 0.2 s, ... up to 1 s (plus jitter)
LINK_BACKOFF_MAX_S = 1.0
LINK_JITTER_S = 0.02


class WorkerLink:
    """The leader's ``Attach`` stream to one worker incarnation, in its own thread.

    Args:
        info: the worker incarnation; term: the leader's term (each request names both).
        cluster, coordinator_id: who asks. interval_s: the heartbeat period asked of the worker.
        tls: the channel's identity. clock: the injected clock.
        suspect: called once the worker is found lost (``suspect(info, reason=..., detail=...)``).
    """

    def __init__(self, info: WorkerInfo, term: int, *, cluster: str, coordinator_id: str, interval_s: float,
                 tls: TlsConfig | None, clock: Clock, suspect: Callable[..., None]) -> None:
        self.info, self.term, self.cluster, self.coordinator_id = info, term, cluster, coordinator_id
        self.interval_s, self.clock, self.suspect = interval_s, clock, suspect
        self._stop = threading.Event()
        self._channel = tls_channel(info.address, tls, worker=info.worker)  # it must be that worker
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=f"link-{info.worker}", daemon=True)
        self.heard_at = clock.monotonic()  # the last heartbeat (or the link's start)
        self.suspected = False  # the silence was reported once

    def _identity(self) -> pb.Identity:
        return pb.Identity(
            cluster=self.cluster, worker_id=self.info.worker, incarnation=self.info.incarnation, term=self.term
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._channel.close()

    def _probe(self) -> Verdict | None:
        """A short Ping after a broken stream: None if the same incarnation answers."""
        try:
            self._stub.Ping(pb.PingRequest(to=self._identity()), timeout=0.5)
            return None
        except grpc.RpcError as exc:
            return classify_rpc_error(exc.code(), exc.details())

    def _attach(self) -> str:
        """One Attach stream, until it breaks: ``"done"`` (stopped, or the worker found lost),
        ``"answered"`` (it sent heartbeats, then broke) or ``"silent"`` (it broke before any)."""
        answered = False
        self._call = self._stub.Attach(
            pb.AttachRequest(
                to=self._identity(),
                coordinator_id=self.coordinator_id,
                interval_s=self.interval_s,
            )
        )
        try:
            for _hb in self._call:
                answered = True
                self.heard_at = self.clock.monotonic()
                if self._stop.is_set():
                    return "done"
        except grpc.RpcError as exc:
            if self._stop.is_set():
                return "done"
            verdict = classify_rpc_error(exc.code(), exc.details())
            if verdict is Verdict.LOST:
                verdict = self._probe() or Verdict.SUSPECT
            if verdict is Verdict.LOST:
                self.suspect(self.info, reason="connection_lost", detail=exc.details() or "")
                return "done"
        if self._stop.is_set():
            return "done"
        return "answered" if answered else "silent"

    def _run(self) -> None:
        """Attach again after each break: tenacity's backoff while the worker stays silent,
        started afresh (from the shortest wait) each time it answered."""
        while not self._stop.is_set():
            outcome = retrying(clock=self.clock, what=f"attaching to worker {self.info.worker}",
                               retry_if_result=lambda o: o == "silent", should_stop=self._stop.is_set,
                               initial_s=LINK_BACKOFF_S, max_s=LINK_BACKOFF_MAX_S, jitter_s=LINK_JITTER_S)(self._attach)
            if outcome != "answered":
                return
            self.clock.wait(self._stop, LINK_BACKOFF_S)

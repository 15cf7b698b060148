"""The coordinator's gRPC service: clients submit jobs to the leader and watch them."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from rallypoint.orchestrator.executor import JOBSPEC_FILE, JobExecutor, JobFailed, run_dir
from rallypoint.etcd.logs import get_logger
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from rallypoint.orchestrator.coordinator import Coordinator

TERMINAL_EVENTS = frozenset({"job.finished", "job.failed"})


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """``SubmitJob``: only the leader runs jobs; a job name runs once at a time."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self.log = get_logger("rallypoint.service", cluster=coordinator.keys.cluster,
                              coordinator=coordinator.config.coordinator_id)

    def SubmitJob(self, request: pb.JobSpec, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        yield from self._run(request, context, resume=False)

    def ResumeJob(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        root = request.checkpoint_dir or self.c.config.checkpoint_dir
        if not root:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "no checkpoint directory: give --checkpoint-dir (the one the job ran with)")
        try:
            spec_path = run_dir(Path(root).absolute(), request.job, create=False) / JOBSPEC_FILE
            spec = pb.JobSpec.FromString(spec_path.read_bytes())
        except (JobFailed, OSError) as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, f"cannot resume job {request.job!r}: {exc}")
        if request.checkpoint_dir:
            spec.checkpoint_dir = request.checkpoint_dir
        yield from self._run(spec, context, resume=True)

    def _run(self, request: pb.JobSpec, context: grpc.ServicerContext, *, resume: bool) -> Iterator[pb.JobEvent]:
        election = self.c.election
        if not election.is_leader:
            leader = election.current_leader()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"coordinator {self.c.config.coordinator_id} does not lead (leader: {leader[0] if leader else 'none'})")
        with self._lock:
            if request.job in self._running:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"job {request.job!r} is already running; wait for it or pick another name")
            self._running.add(request.job)
        events: queue.Queue[pb.JobEvent] = queue.Queue()
        executor = JobExecutor(request, store=self.c.store, keys=self.c.keys, election=election, emit=events.put,
                               clock=self.c.clock, checkpoint_root=self.c.config.checkpoint_dir, resume=resume)

        def run() -> None:
            try:
                executor.run()
            except Exception as exc:  # a bug must not leave the client waiting forever
                self.log.exception("job.internal_error", job=request.job)
                events.put(pb.JobEvent(job=request.job, event="job.failed",
                                       detail=json.dumps({"reason": f"internal error in the executor: {exc!r}"})))
            finally:
                with self._lock:
                    self._running.discard(request.job)

        threading.Thread(target=run, name=f"job-{request.job}", daemon=True).start()
        self.log.info("job.submitted", job=request.job, steps=request.steps, slices=len(request.slices))
        while True:
            ev = events.get()
            if context.is_active():
                yield ev
            if ev.event in TERMINAL_EVENTS:
                return


def serve_jobs(coordinator: Coordinator) -> CoordinatorService:
    """Mount the job service on the coordinator's gRPC server (before :meth:`Coordinator.run`)."""
    service = CoordinatorService(coordinator)
    pb_grpc.add_CoordinatorServicer_to_server(service, coordinator.server)
    return service

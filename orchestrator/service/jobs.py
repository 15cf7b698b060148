"""The coordinator's gRPC service: clients submit jobs to the leader and watch them.

The service keeps a registry of the jobs this coordinator runs (one
:class:`JobExecutor` each, in its own thread; :mod:`~rallypoint.orchestrator.service.registry`)
and fans each one's events out to every stream that follows it: the ``SubmitJob`` or
``ResumeJob`` call that started it and any number of ``WatchJob`` calls
(:mod:`~rallypoint.orchestrator.service.fanout`). It calls an executor only through
:class:`~rallypoint.orchestrator.job.view.JobHandle` and reads it through its ``view()``.

``SubmitJob`` checks the request's names, its checkpoint directory, its ``on_nonfinite``
(:mod:`~rallypoint.orchestrator.job.metrics`) and its code bundle (the bytes against their
sha256, one present for host sources: :func:`~rallypoint.orchestrator.job.runs.check_code`) first,
and refuses a job
name whose run has commits unless the request asks for a new run (``new_run``;
:mod:`~rallypoint.orchestrator.job.runs`), and a job with a slice whose programs no worker of the
pool can run (:mod:`~rallypoint.recovery.platforms`): nothing is written for a refused request.

It listens to the coordinator's leadership (:meth:`Coordinator.add_leadership_listener`): on
lead(term) it adopts every job a lost or deposed leader ran, and on step_down(reason) it hands
its jobs off unless the term may come back (:mod:`~rallypoint.orchestrator.service.adoption`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from rallypoint.basics import authz
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.basics.errors import ConfigError, RallypointError, StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.keys import check_name
from rallypoint.etcd.records import parsed
from rallypoint.orchestrator.job.executor import JOBSPEC_FILE, JobExecutor, JobFailed, run_dir
from rallypoint.recovery.nonfinite import nonfinite_mode
from rallypoint.orchestrator.service.verbs import JobControl, start_thread, watched
from rallypoint.orchestrator.job.state import FINAL_RECORD_STATES
from rallypoint.orchestrator.observe.timeline import TimelineRecorder
from rallypoint.orchestrator.service.adoption import JobAdoption
from rallypoint.orchestrator.service.fanout import EventFanOut, stream_events
from rallypoint.orchestrator.service.registry import JobRun, RunRegistry
from rallypoint.recovery.platforms import platform_refusal, pool_platforms
from rallypoint.orchestrator.job.runs import check_init_from, check_spec_names, previous_run, refusal
from rallypoint.orchestrator.job.runs import check_checkpoint_root, check_code, read_spec, request_checkpoint_dir
from rallypoint.orchestrator.job.runs import within
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from rallypoint.orchestrator.service.coordinator import Coordinator

ENDED_STATE = {"job.finished": "succeeded", "job.failed": "failed", "job.suspended": "suspended",
               "job.cancelled": "cancelled"}

ADOPT_WAIT_S = 10.0  # WatchJob of a job recorded as running that this leader has not started yet: how long to wait
DEFAULT_MAX_WATCHERS = 128  # WatchJob streams one coordinator serves at once (CoordinatorConfig.max_watchers)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """``SubmitJob``, ``ResumeJob``, ``WatchJob``: only the leader runs jobs; a job name runs once at a time."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator
        self.runs = RunRegistry(clock=self.c.clock.monotonic)  # the jobs run here now, those ended lately
        self._lock = threading.Lock()  # of the count of WatchJob streams
        self._watching = 0  # WatchJob streams open now (each holds a server thread), at most max_watchers
        self.timeline = TimelineRecorder(wall=self.c.clock.wall)  # what the dashboard shows of the jobs run here
        self.log = get_logger("rallypoint.service", cluster=coordinator.keys.cluster,
                              coordinator=coordinator.config.coordinator_id)
        self.control = JobControl(self)  # cancel, suspend, the auto-resume, the history's retention (service/verbs.py)
        self.adoption = JobAdoption(coordinator, self.runs, root=self._root, log=self.log,  # service/adoption.py
                                    start=lambda spec, checkpoint_root: self._start(
                                        spec, resume=True, adopted=True, checkpoint_root=checkpoint_root))
        coordinator.add_leadership_listener(self.on_lead, self.on_step_down)
        coordinator.add_fence_listener(self.on_fenced)

    # -- the RPCs ---------------------------------------------------------------------------

    def SubmitJob(self, request: pb.JobSpec, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        self._check_leader(context)
        try:  # names and the checkpoint directory reach the file system: checked before anything is written
            check_spec_names(request)
            nonfinite_mode(request)  # "stop", "warn" or "" (stop): anything else is refused here
            if request.checkpoint_dir:
                request.checkpoint_dir = request_checkpoint_dir(request.checkpoint_dir, self._root())
            root = request.checkpoint_dir or self._root()
            if root:
                within(Path(root), Path(root) / request.job, "the job's folder")
            check_init_from(request, self._root())
            check_code(request)
            check_checkpoint_root(request, root)
            if request.code.sha256 and not root:
                raise ConfigError("its code bundle (host sources) is shared with the workers through the run "
                                  "directory, and there is no checkpoint directory: give --checkpoint-dir")
        except (RallypointError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {request.job!r}: {exc}")
        request.owner = authz.peer_identity(context) or ""  # the certificate's word, not the client's
        if self._refuse_a_resubmit(request, context):  # the same submit again (its key): follow the run it started
            self.log.info("job.submit_repeated", job=request.job, submit_id=request.submit_id)
            yield from self._watch(request.job, context)
            return
        self._refuse_other_platforms(request, context)
        try:
            run = self._start(request, resume=False, adopted=False)
        except (RallypointError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {request.job!r}: {exc}")
        if run is None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"job {request.job!r} is already running; wait for it or pick another name")
        assert run is not None
        self.log.info("job.submitted", job=request.job, steps=request.steps, slices=len(request.slices))
        assert run.first is not None
        yield from stream_events(run.events, run.first, context, self.log)

    def ResumeJob(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        self._check_leader(context)
        try:
            check_name("job", request.job)
            root = request_checkpoint_dir(request.checkpoint_dir, self._root())
        except RallypointError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot resume job {request.job!r}: {exc}")
        if not root:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "no checkpoint directory: give --checkpoint-dir (the one the job ran with)")
        try:
            kv = self.c.store.get(self.c.keys.job(request.job))  # the leader's record binds the run's files
            record = kv.json() if kv is not None else None
            rd = run_dir(Path(root).absolute(), request.job, create=False, record=record)
            spec_path = rd / JOBSPEC_FILE
            spec = pb.JobSpec.FromString(read_spec(rd, record))
            if spec.job != request.job:
                raise JobFailed(f"{spec_path} is the spec of job {spec.job!r}, not of {request.job!r}")
            check_spec_names(spec)
        except (JobFailed, OSError, ValueError) as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, f"cannot resume job {request.job!r}: {exc}")
        if request.checkpoint_dir:
            spec.checkpoint_dir = root
        self.control.refuse_settled(request.job, context)  # a succeeded run is complete; a stop asked is withdrawn
        self._refuse_other_platforms(spec, context)
        run = self._start(spec, resume=True, adopted=False)
        if run is None:  # it runs here already (this leader adopted it): follow it
            yield from self._watch(request.job, context)
            return
        self.log.info("job.resume_requested", job=request.job)
        assert run.first is not None
        yield from stream_events(run.events, run.first, context, self.log)

    def WatchJob(self, request: pb.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        self._check_leader(context)
        cap = int(getattr(self.c.config, "max_watchers", 0) or 0) or DEFAULT_MAX_WATCHERS
        with self._lock:
            full = self._watching >= cap
            if not full:
                self._watching += 1
        if full:
            self.log.warning("watch.refused", job=request.job, watching=cap)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"coordinator {self.c.config.coordinator_id} already serves {cap} WatchJob streams (its "
                          f"limit, --max-watchers); try again later, or read the job's record in etcd "
                          f"({self.c.keys.job(request.job)})")
        try:
            yield from self._watch(request.job, context)
        finally:
            with self._lock:
                self._watching -= 1

    def CancelJob(self, request: pb.JobControlRequest, context: grpc.ServicerContext) -> pb.JobControlReply:
        self._check_leader(context)
        return self.control.stop(request, "cancel", context)

    def SuspendJob(self, request: pb.JobControlRequest, context: grpc.ServicerContext) -> pb.JobControlReply:
        self._check_leader(context)
        return self.control.stop(request, "suspend", context)

    @property
    def watching(self) -> int:
        """WatchJob streams open now."""
        with self._lock:
            return self._watching

    # -- running jobs ------------------------------------------------------------------------

    def _root(self) -> str:
        return self.c.config.checkpoint_dir

    def running(self, job: str) -> JobRun | None:
        """The run of ``job`` this coordinator has now (None: it runs none)."""
        return self.runs.get(job)

    def start_resumed(self, spec: pb.JobSpec, *, checkpoint_root: str, auto: bool) -> JobRun | None:
        """Resume ``spec``'s run with nobody following it (clients come through WatchJob); None: it runs here."""
        run = self._start(spec, resume=True, adopted=False, checkpoint_root=checkpoint_root, auto_resumed=auto)
        if run is not None:
            if run.first is not None:
                run.events.unsubscribe(run.first)
        return run

    def _refuse_other_platforms(self, spec: pb.JobSpec, context: grpc.ServicerContext) -> None:
        """A job with a slice whose programs were lowered for no platform the pool's workers have is
        refused (FAILED_PRECONDITION), naming the slice, its platforms and those on offer."""
        try:
            offered = pool_platforms(read_cluster(self.c.store, self.c.keys))
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the workers of the pool: {exc}")
        why = platform_refusal(spec, offered)
        if why is not None:
            self.log.warning("job.refused_platform", job=spec.job, reason=why)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {spec.job!r}: {why}")

    def _refuse_a_resubmit(self, spec: pb.JobSpec, context: grpc.ServicerContext) -> bool:
        """A job name whose run has commits is not started over unless the submit asks for a new run
        (``new_run``): an accidental resubmit must not cost the way back to its checkpoints.

        True: the submit repeats one that started the job's current run (the same ``submit_id``, e.g. retried
        after a lost connection): the caller follows that run instead of starting another."""
        run = self.runs.get(spec.job)
        if run is not None:
            return bool(spec.submit_id) and run.executor.view().submit_id == spec.submit_id
        root = spec.checkpoint_dir or self._root()
        try:
            prev = previous_run(self.c.store, self.c.keys, spec.job, Path(root).absolute() if root else None)
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the runs of job {spec.job!r}: {exc}")
        record = (prev.record if prev is not None else None) or {}
        if spec.submit_id and record.get("submit_id") == spec.submit_id:
            ended = self.runs.ended_here(spec.job)
            if record.get("state", "") not in FINAL_RECORD_STATES or ended:
                return True
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"this submit of job {spec.job!r} ran already (run {prev.run if prev else ''}, "
                          f"{record.get('state')}); `rallypoint status {spec.job}` shows it")
        if record.get("state", "") not in FINAL_RECORD_STATES and record.get("run_dir") and not spec.new_run:
            # Recorded as running under a lost leader: this leader adopts it (a client that retried its
            # submit after losing the old leader follows it: WatchJob).
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"job {spec.job!r} is recorded as {record.get('state')} (run {prev.run if prev else ''}): "
                          f"the leader adopts it; `rallypoint status {spec.job}` shows it")
        why = refusal(prev)
        if why and not spec.new_run:
            self.log.warning("job.resubmit_refused", job=spec.job, run=prev.run if prev else "")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return False

    def _check_leader(self, context: grpc.ServicerContext) -> None:
        election = self.c.election
        if not election.is_leader:
            try:
                leader = election.current_leader()
            except StoreError:
                leader = None
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"coordinator {self.c.config.coordinator_id} does not lead (leader: "
                          f"{leader[0] if leader else 'none'})")

    def _start(self, spec: pb.JobSpec, *, resume: bool, adopted: bool, checkpoint_root: str | None = None,
               auto_resumed: bool = False) -> JobRun | None:
        """Start an executor for ``spec`` in a thread and register it; None if the job runs here already.

        The run's first subscriber (``run.first``: the stream that asked for it) is
        subscribed before the executor starts, so it sees every event.
        """
        events = EventFanOut(spec.job)

        def emit(ev: pb.JobEvent) -> None:  # the dashboard's recorder (with the job's view now), then the clients
            try:
                view = executor.view()
            except Exception as exc:  # the dashboard must never keep an event from the clients
                self.log.warning("dashboard.view_failed", job=spec.job, event_name=ev.event, error=repr(exc))
                view = None
            self.timeline.observe(view, ev)
            events.publish(ev)

        def make() -> JobRun:
            made = JobRun(job=spec.job, term=self.c.election.term or 0, adopted=adopted, events=events,
                          executor=JobExecutor(
                              spec, store=self.c.store, keys=self.c.keys, election=self.c.election, emit=emit,
                              clock=self.c.clock, checkpoint_root=self._root() if checkpoint_root is None
                              else checkpoint_root, resume=resume, adopted=adopted, hooks=self.c.config.hooks,
                              keep_runs=getattr(self.c.config, "keep_runs", 0),  # retention of earlier runs
                              auto_resumed=auto_resumed))  # resumed by the leader once room returned (verbs.py)
            made.first = events.subscribe()  # before the executor starts: the stream that asked sees every event
            if getattr(self.c, "metrics", None) is not None:
                self.c.metrics.job_started(spec.job, made.executor)  # docs/metrics.md
            return made

        run = self.runs.add(spec.job, make)
        if run is None:
            return None
        executor = run.executor

        def main() -> None:
            try:
                executor.run()
            except Exception as exc:  # a bug must not leave the clients waiting forever
                self.log.exception("job.internal_error", job=spec.job)
                emit(pb.JobEvent(job=spec.job, event="job.failed",
                                 detail=json.dumps({"reason": f"internal error in the executor: {exc!r}"})))
            finally:
                if events.last is None:
                    emit(pb.JobEvent(job=spec.job, event="job.failed",
                                     detail=json.dumps({"reason": "the executor ended without a result"})))
                self.runs.ended(run)
            term = self.c.election.term
            if events.last is not None and events.last.event == "job.handed_off" and term is not None \
                    and not self.c.stopping:
                # It handed off (a write of its term was refused) but this coordinator leads:
                # nobody else will adopt the job, so this leader does, from its record.
                self.log.warning("job.readopting", job=spec.job, term=term)
                self.on_lead(term)

        threading.Thread(target=main, name=f"job-{spec.job}", daemon=True).start()
        return run

    def _watch(self, job: str, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        """``job.watching`` with the job's progress, then its events to the end (see ``WatchJob``)."""
        deadline = self.c.clock.monotonic() + ADOPT_WAIT_S
        while True:
            run, ended = self.runs.lookup(job)
            if run is not None:
                q = run.events.subscribe()
                x = run.executor.view()
                placement = {s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                             for s, p in x.placement.items()}
                yield pb.JobEvent(job=job, event="job.watching", step=x.completed,
                                  detail=json.dumps({"state": x.state.value, "adopted": run.adopted,
                                                     "term": run.term, "placement": placement, **watched(x)}))
                yield from stream_events(run.events, q, context, self.log)
                return
            if ended is not None:  # it ended here moments ago: the client missed its end
                state = ENDED_STATE.get(ended.event, "failed")
                yield pb.JobEvent(job=job, event="job.watching", step=int(ended.step),
                                  detail=json.dumps({"state": state, "adopted": False}))
                yield ended
                return
            self._check_leader(context)
            try:
                kv = self.c.store.get(self.c.keys.job(job))
            except StoreError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the record of job {job!r}: {exc}")
            if kv is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"cluster {self.c.keys.cluster!r} has no job {job!r}")
            record = parsed(kv, "job")
            if record is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the record of job {job!r} in etcd is malformed (logged as record.bad); "
                              f"`rallypoint status {job}` shows it")
            state = record.get("state", "")
            if state in FINAL_RECORD_STATES:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"job {job!r} is over ({state}) and this leader did not run its end; "
                              f"`rallypoint status {job}` shows its record")
            if not record.get("run_dir"):
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"job {job!r} is recorded as {state} under term {record.get('term')}, but it ran "
                              "without checkpoints: a new leader cannot adopt it; submit it again")
            if self.c.clock.monotonic() > deadline:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"job {job!r} is recorded as {state} under term {record.get('term')}, but this "
                              f"leader has not adopted it within {ADOPT_WAIT_S:.0f}s; see its log "
                              "(job.adoption_*)")
            if not context.is_active():
                return
            time.sleep(0.2)  # adoption may be starting

    # -- leadership ------------------------------------------------------------------------------

    def on_lead(self, term: int) -> None:
        """This coordinator leads ``term``: adopt the jobs of a lost leader (in a thread), and resume the jobs
        suspended for higher-priority ones when room returns (another thread, for as long as the term leads)."""
        threading.Thread(target=self.adoption.adopt_all, args=(term,), name=f"adopt-{term}", daemon=True).start()
        start_thread(self.control, term, lambda: self.adoption.term_holds(term))

    def on_fenced(self, worker: str, incarnation: int, reason: str) -> None:
        """The leader fenced a worker: every executor that runs on it recovers now."""
        for r in self.runs.all():
            r.executor.worker_fenced(worker, incarnation, reason)

    def on_step_down(self, reason: str) -> None:
        """This coordinator stopped leading: hand its jobs off, unless its term may come back (service/adoption.py)."""
        self.adoption.step_down(reason)


def serve_jobs(coordinator: Coordinator) -> CoordinatorService:
    """Mount the job service on the coordinator's gRPC server (before :meth:`Coordinator.run`)."""
    service = CoordinatorService(coordinator)
    pb_grpc.add_CoordinatorServicer_to_server(service, coordinator.server)
    return service

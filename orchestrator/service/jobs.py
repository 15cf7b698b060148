"""The coordinator's gRPC service: clients submit jobs to the leader and watch them.

The service keeps a registry of the jobs this coordinator runs (one
:class:`JobExecutor` each, in its own thread) and fans each one's events out to every
stream that follows it: the ``SubmitJob`` or ``ResumeJob`` call that started it and any
number of ``WatchJob`` calls.

``SubmitJob`` checks the request's names, its checkpoint directory, its ``on_nonfinite``
(:mod:`~rallypoint.orchestrator.job.metrics`) and its code bundle (the bytes against their
sha256, one present for host sources: :func:`~rallypoint.orchestrator.job.runs.check_code`) first,
and refuses a job
name whose run has commits unless the request asks for a new run (``new_run``;
:mod:`~rallypoint.orchestrator.job.runs`), and a job with a slice whose programs no worker of the
pool can run (:mod:`~rallypoint.recovery.platforms`): nothing is written for a refused request.

It listens to the coordinator's leadership (:meth:`Coordinator.add_leadership_listener`):

* **on lead(term)** it adopts every job a lost or deposed leader ran: it reads the job
  records (``keys.jobs``), and each one whose state is not final (``succeeded`` /
  ``failed``) and that it does not run itself now is started again from its
  ``<run_dir>/jobspec.pb`` with ``adopted=True`` (the executor releases the old term's
  device leases, unloads its runtimes and loads every slice from the newest consistent
  cut). A job record without a ``run_dir`` (a job without checkpoints) cannot be
  adopted: that is logged (``job.adoption_impossible``) and nothing is written.
* **on step_down(reason)** it stops every executor (``executor.stop``: each ends with
  ``job.handed_off``, which tells its clients to follow the job to the new leader) when
  the term cannot come back: the coordinator stops, or its leader lease is gone. When
  only the lease's local deadline passed (etcd briefly away) the lease is kept and the
  term may come back: the executors pause on their own and go on under the same term,
  or hand off by themselves once the term is over.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from rallypoint.etcd.cluster_view import parse_job_records, read_cluster
from rallypoint.basics.errors import ConfigError, RallypointError, StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.basics.retry import retrying
from rallypoint.etcd.keys import check_name
from rallypoint.orchestrator.job.executor import JOBSPEC_FILE, JobExecutor, JobFailed, run_dir
from rallypoint.orchestrator.job.metrics import nonfinite_mode
from rallypoint.orchestrator.service.verbs import JobControl, start_thread, watched
from rallypoint.orchestrator.job.view import JobHandle
from rallypoint.orchestrator.job.state import END_EVENTS, FINAL_RECORD_STATES, STREAM_END_EVENTS
from rallypoint.orchestrator.observe.timeline import TimelineRecorder
from rallypoint.recovery.platforms import platform_refusal, pool_platforms
from rallypoint.orchestrator.job.runs import adoptable_run_dir, check_spec_names, previous_run, refusal
from rallypoint.orchestrator.job.runs import check_code, request_checkpoint_dir, within
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from rallypoint.orchestrator.service.coordinator import Coordinator

TERMINAL_EVENTS = END_EVENTS  # the job stopped running (a client stops following it): job/state.py
ENDED_STATE = {"job.finished": "succeeded", "job.failed": "failed", "job.suspended": "suspended",
               "job.cancelled": "cancelled"}

ADOPT_WAIT_S = 10.0  # WatchJob of a job recorded as running that this leader has not started yet: how long to wait
HANDOFF_WAIT_S = 5.0  # on a final step-down: how long to wait for the executors to hand off
OLD_TERM_WAIT_S = 60.0  # on lead: how long to wait for an executor of an older term here to end before adopting
AWAIT_TERM_POLL_S = 0.1  # after a step-down that kept the lease: how often to look whether the term is over
KEEP_ENDED = 4  # ended jobs whose last event (final states included) WatchJob still answers with ...
KEEP_ENDED_S = 300.0  # ... for this long: a client that lost its stream just as the job ended
DEFAULT_MAX_WATCHERS = 128  # WatchJob streams one coordinator serves at once (CoordinatorConfig.max_watchers)
SUBSCRIBER_QUEUE_MAX = 256  # events a stream may fall behind the job before it is dropped (the job never waits)


class _Subscriber(queue.Queue[pb.JobEvent]):
    """One stream's events, bounded; ``dropped`` says why it was cut off (it fell too far behind)."""

    def __init__(self) -> None:
        super().__init__(maxsize=SUBSCRIBER_QUEUE_MAX)
        self.dropped = ""


@dataclass
class _Run:
    """One job this coordinator runs: its executor, thread and subscribers."""

    job: str
    term: int
    adopted: bool
    executor: JobHandle  # the JobExecutor (its emit is publish)
    first: queue.Queue[pb.JobEvent] | None = None  # the stream that started it, subscribed before it starts
    subscribers: list[queue.Queue[pb.JobEvent]] = field(default_factory=list)
    last: pb.JobEvent | None = None  # the executor's last event, once it ended
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, ev: pb.JobEvent) -> None:
        """The executor's ``emit``: every subscriber gets every event (thread-safe). It never blocks:
        a subscriber whose queue is full (its client reads too slowly) is dropped, not waited for."""
        with self.lock:
            if self.last is not None:
                return  # nothing after the end
            if ev.event in STREAM_END_EVENTS:
                self.last = ev
            subs = list(self.subscribers)
        for q in subs:
            try:
                q.put_nowait(ev)
            except queue.Full:
                self._drop(q, ev)

    def _drop(self, q: queue.Queue[pb.JobEvent], ev: pb.JobEvent) -> None:
        self.unsubscribe(q)
        if isinstance(q, _Subscriber):
            q.dropped = (f"this stream fell {q.maxsize} events behind job {self.job!r} (at {ev.event} step {ev.step}) "
                         "and was dropped; the job goes on: follow it again with WatchJob")

    def subscribe(self) -> queue.Queue[pb.JobEvent]:
        q = _Subscriber()
        with self.lock:
            if self.last is not None:
                q.put(self.last)
            else:
                self.subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[pb.JobEvent]) -> None:
        with self.lock:
            if q in self.subscribers:
                self.subscribers.remove(q)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """``SubmitJob``, ``ResumeJob``, ``WatchJob``: only the leader runs jobs; a job name runs once at a time."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator
        self._runs: dict[str, _Run] = {}
        self._ended: OrderedDict[str, tuple[pb.JobEvent, float]] = OrderedDict()  # job -> (its end, when)
        self._lock = threading.Lock()
        self._watching = 0  # WatchJob streams open now (each holds a server thread), at most max_watchers
        self.timeline = TimelineRecorder()  # what the dashboard shows of the jobs run here
        self.log = get_logger("rallypoint.service", cluster=coordinator.keys.cluster,
                              coordinator=coordinator.config.coordinator_id)
        self.control = JobControl(self)  # cancel, suspend, the auto-resume, the history's retention (service/verbs.py)
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
            check_code(request)
            if request.code.sha256 and not root:
                raise ConfigError("its code bundle (host sources) is shared with the workers through the run "
                                  "directory, and there is no checkpoint directory: give --checkpoint-dir")
        except (RallypointError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {request.job!r}: {exc}")
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
        yield from self._stream(run, run.first, context)

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
            spec_path = run_dir(Path(root).absolute(), request.job, create=False) / JOBSPEC_FILE
            spec = pb.JobSpec.FromString(spec_path.read_bytes())
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
        yield from self._stream(run, run.first, context)

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

    def running(self, job: str) -> _Run | None:
        """The run of ``job`` this coordinator has now (None: it runs none)."""
        with self._lock:
            return self._runs.get(job)

    def start_resumed(self, spec: pb.JobSpec, *, checkpoint_root: str, auto: bool) -> _Run | None:
        """Resume ``spec``'s run with nobody following it (clients come through WatchJob); None: it runs here."""
        run = self._start(spec, resume=True, adopted=False, checkpoint_root=checkpoint_root, auto_resumed=auto)
        if run is not None:
            if run.first is not None:
                run.unsubscribe(run.first)
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
        with self._lock:
            run = self._runs.get(spec.job)
        if run is not None:
            return bool(spec.submit_id) and run.executor.view().submit_id == spec.submit_id
        root = spec.checkpoint_dir or self._root()
        try:
            prev = previous_run(self.c.store, self.c.keys, spec.job, Path(root).absolute() if root else None)
        except StoreError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot read the runs of job {spec.job!r}: {exc}")
        record = (prev.record if prev is not None else None) or {}
        if spec.submit_id and record.get("submit_id") == spec.submit_id:
            with self._lock:
                ended = spec.job in self._ended
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
               auto_resumed: bool = False) -> _Run | None:
        """Start an executor for ``spec`` in a thread and register it; None if the job runs here already.

        The run's first subscriber (``run.first``: the stream that asked for it) is
        subscribed before the executor starts, so it sees every event.
        """
        with self._lock:
            if spec.job in self._runs:
                return None

            def emit(ev: pb.JobEvent) -> None:  # the dashboard's recorder (with the job's view now), then the clients
                try:
                    view = executor.view()
                except Exception as exc:  # the dashboard must never keep an event from the clients
                    self.log.warning("dashboard.view_failed", job=spec.job, event_name=ev.event, error=repr(exc))
                    view = None
                self.timeline.observe(view, ev)
                run.publish(ev)

            executor: JobHandle = JobExecutor(
                spec, store=self.c.store, keys=self.c.keys, election=self.c.election, emit=emit, clock=self.c.clock,
                checkpoint_root=self.c.config.checkpoint_dir if checkpoint_root is None else checkpoint_root,
                resume=resume, adopted=adopted, hooks=self.c.config.hooks,
                keep_runs=getattr(self.c.config, "keep_runs", 0),  # retention of earlier runs (runs.py)
                auto_resumed=auto_resumed)  # resumed by the leader once room returned (service/verbs.py)
            run = _Run(job=spec.job, term=self.c.election.term or 0, adopted=adopted, executor=executor)
            run.first = run.subscribe()  # before the executor starts: the stream that asked for it sees every event
            if getattr(self.c, "metrics", None) is not None:
                self.c.metrics.job_started(spec.job, executor)  # docs/metrics.md
            self._runs[spec.job] = run
            self._ended.pop(spec.job, None)

        def main() -> None:
            try:
                executor.run()
            except Exception as exc:  # a bug must not leave the clients waiting forever
                self.log.exception("job.internal_error", job=spec.job)
                emit(pb.JobEvent(job=spec.job, event="job.failed",
                                 detail=json.dumps({"reason": f"internal error in the executor: {exc!r}"})))
            finally:
                if run.last is None:
                    emit(pb.JobEvent(job=spec.job, event="job.failed",
                                     detail=json.dumps({"reason": "the executor ended without a result"})))
                with self._lock:
                    if self._runs.get(spec.job) is run:
                        del self._runs[spec.job]
                    if run.last is not None and run.last.event in TERMINAL_EVENTS:
                        self._ended[spec.job] = (run.last, time.monotonic())
                        while len(self._ended) > KEEP_ENDED:
                            self._ended.popitem(last=False)
                run.done.set()
            term = self.c.election.term
            if run.last is not None and run.last.event == "job.handed_off" and term is not None \
                    and not self.c.stopping:
                # It handed off (a write of its term was refused) but this coordinator leads:
                # nobody else will adopt the job, so this leader does, from its record.
                self.log.warning("job.readopting", job=spec.job, term=term)
                self.on_lead(term)

        threading.Thread(target=main, name=f"job-{spec.job}", daemon=True).start()
        return run

    def _stream(self, run: _Run, q: queue.Queue[pb.JobEvent], context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        """The run's events from ``q`` until its last one, or until the client goes away."""
        try:
            while True:
                dropped = getattr(q, "dropped", "")
                if dropped:  # it fell too far behind: the client hears why, the job goes on
                    self.log.warning("watch.dropped", job=run.job, reason=dropped)
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, dropped)
                try:
                    ev = q.get(timeout=0.5)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                yield ev
                if ev.event in STREAM_END_EVENTS:
                    return
        finally:
            run.unsubscribe(q)

    def _watch(self, job: str, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        """``job.watching`` with the job's progress, then its events to the end (see ``WatchJob``)."""
        deadline = time.monotonic() + ADOPT_WAIT_S
        while True:
            with self._lock:
                run = self._runs.get(job)
                kept = self._ended.get(job)
            ended = kept[0] if kept is not None and time.monotonic() - kept[1] < KEEP_ENDED_S else None
            if run is not None:
                q = run.subscribe()
                x = run.executor.view()
                placement = {s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                             for s, p in x.placement.items()}
                yield pb.JobEvent(job=job, event="job.watching", step=x.completed,
                                  detail=json.dumps({"state": x.state.value, "adopted": run.adopted,
                                                     "term": run.term, "placement": placement, **watched(x)}))
                yield from self._stream(run, q, context)
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
            record = kv.json()
            state = record.get("state", "")
            if state in FINAL_RECORD_STATES:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"job {job!r} is over ({state}) and this leader did not run its end; "
                              f"`rallypoint status {job}` shows its record")
            if not record.get("run_dir"):
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"job {job!r} is recorded as {state} under term {record.get('term')}, but it ran "
                              "without checkpoints: a new leader cannot adopt it; submit it again")
            if time.monotonic() > deadline:
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
        threading.Thread(target=self._adopt_all, args=(term,), name=f"adopt-{term}", daemon=True).start()
        start_thread(self.control, term, lambda: self._term_holds(term))

    def _term_holds(self, term: int) -> bool:
        return self.c.election.term == term and not self.c.stopping

    def _adopt_all(self, term: int) -> None:
        try:
            kvs, _ = retrying(clock=self.c.clock, what="reading the job records", log=self.log, retry_on=StoreError,
                              should_stop=lambda: not self._term_holds(term), initial_s=0.25, max_s=1.0)(
                lambda: self.c.store.get_prefix(self.c.keys.jobs))
        except StoreError as exc:
            self.log.warning("job.adoption_scan_failed", term=term, error=str(exc))
            return
        parsed, bad = parse_job_records(kvs, self.c.keys)
        for name in bad:
            self.log.warning("job.adoption_impossible", job=name, reason="the job record is not JSON")
        for job, record in parsed.items():
            if not self._term_holds(term):
                return
            state = record.get("state", "")
            if state in FINAL_RECORD_STATES:
                continue
            try:
                self._adopt(job, record, term)
            except Exception as exc:  # one job must not keep the others from being adopted
                self.log.exception("job.adoption_failed", job=job, error=repr(exc))

    def _adopt(self, job: str, record: dict[str, Any], term: int) -> None:
        with self._lock:
            run = self._runs.get(job)
        if run is not None and run.term == term:
            return  # this coordinator runs it under this term (it paused and kept its term)
        if run is not None:  # an executor of an older term of ours: it hands off, then the job is adopted
            run.executor.stop(f"this coordinator leads a newer term ({term})")
            if not run.done.wait(OLD_TERM_WAIT_S):
                self.log.error("job.adoption_failed", job=job, term=term,
                               reason=f"the executor of term {run.term} did not end within {OLD_TERM_WAIT_S:.0f}s")
                return
        old_term, state = record.get("term"), record.get("state", "")
        rd = record.get("run_dir") or ""
        if not rd:
            self.log.error("job.adoption_impossible", job=job, state=state, old_term=old_term,
                           reason="the job ran without checkpoints (no run_dir in its record): nothing to "
                                  "restart it from; submit it again")
            return
        try:  # the record's run_dir came from etcd: checked before it is read
            checked = adoptable_run_dir(rd, job, self._root())
            spec = pb.JobSpec.FromString((checked / JOBSPEC_FILE).read_bytes())
            if spec.job != job:
                raise ValueError(f"it is the spec of job {spec.job!r}")
            check_spec_names(spec)
            if spec.checkpoint_dir:
                request_checkpoint_dir(spec.checkpoint_dir, self._root())
        except (OSError, ValueError, RallypointError) as exc:
            self.log.error("job.adoption_impossible", job=job, state=state, old_term=old_term,
                           reason=f"cannot use its job spec {Path(rd) / JOBSPEC_FILE}: {exc}")
            return
        if not self._term_holds(term):
            return
        # The run's checkpoint root: run_dir is <root>/<job>/<run>.
        started = self._start(spec, resume=True, adopted=True, checkpoint_root=str(checked.parent.parent))
        if started is None:
            return  # a ResumeJob started it meanwhile
        if started.first is not None:
            started.unsubscribe(started.first)  # nobody asked for it: clients come through WatchJob
        self.log.info("job.adopting", job=job, old_term=old_term, state=state, step_done=record.get("step_done"),
                      cut=record.get("cut"), run_dir=rd, term=term)

    def on_fenced(self, worker: str, incarnation: int, reason: str) -> None:
        """The leader fenced a worker: every executor that runs on it recovers now."""
        with self._lock:
            runs = list(self._runs.values())
        for r in runs:
            r.executor.worker_fenced(worker, incarnation, reason)

    def on_step_down(self, reason: str) -> None:
        """This coordinator stopped leading: hand its jobs off, unless its term may come back."""
        keeper = self.c.election.keeper
        may_return = not self.c.stopping and keeper is not None and not keeper.fence.dead
        with self._lock:
            runs = list(self._runs.values())
        if not runs:
            return
        if may_return:
            # Only the local deadline passed (etcd away): the lease is kept, and the same term
            # resumes if etcd answers in time. The executors pause (they cannot write); a thread
            # hands them off once that term is over for good.
            self.log.warning("job.paused_with_the_term", reason=reason, jobs=sorted(r.job for r in runs))
            threading.Thread(target=self._await_term, args=(runs, keeper, reason), name="await-term",
                             daemon=True).start()
            return
        self._hand_off(runs, reason, wait_s=HANDOFF_WAIT_S)

    def _hand_off(self, runs: list[_Run], reason: str, *, wait_s: float) -> None:
        for r in runs:
            r.executor.stop(reason)
        deadline = time.monotonic() + wait_s
        for r in runs:
            r.done.wait(max(0.0, deadline - time.monotonic()))
        self.log.info("job.handed_off_all", reason=reason, jobs=sorted(r.job for r in runs),
                      still_running=sorted(r.job for r in runs if not r.done.is_set()))

    def _await_term(self, runs: list[_Run], keeper: Any, reason: str) -> None:
        """After a step-down that kept the lease: wait until the term comes back (the same lease
        leads again) or is over for good (the lease is gone or replaced, another term leads here,
        the coordinator stops); then hand off the runs of that term."""
        terms = {r.term for r in runs}
        while True:
            election = self.c.election
            if election.keeper is keeper and election.term in terms:
                return  # the same term leads again: the executors go on where they paused
            if self.c.stopping or election.keeper is not keeper or keeper.fence.dead or (
                    election.term is not None and election.term not in terms):
                break
            if all(r.done.is_set() for r in runs):
                return
            time.sleep(AWAIT_TERM_POLL_S)
        self._hand_off([r for r in runs if not r.done.is_set()], f"{reason}; the term is over", wait_s=0.0)


def serve_jobs(coordinator: Coordinator) -> CoordinatorService:
    """Mount the job service on the coordinator's gRPC server (before :meth:`Coordinator.run`)."""
    service = CoordinatorService(coordinator)
    pb_grpc.add_CoordinatorServicer_to_server(service, coordinator.server)
    return service

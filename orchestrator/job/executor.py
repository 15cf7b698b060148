"""The graph executor: runs one job on the cluster, from the leader, through host losses.

The executor owns and wires its collaborators, each the one writer of its facts (``docs/runtime.md``,
"The executor: one owner per fact"); the workers' events are :mod:`~rallypoint.orchestrator.job.events`,
losses and stalls :mod:`~rallypoint.orchestrator.job.losses`. Outside code reads the job through
:meth:`JobExecutor.view` and calls it through :class:`~rallypoint.orchestrator.job.view.JobHandle`.

It places every virtual slice on a worker's devices (device leases, fenced on the
term that started the job), records the placement in etcd, loads each worker with the
exported programs of its slices and its routes, and then only **grants steps**:
workers run instances as their inputs arrive and push outputs straight to each other,
and a bounded window of steps is in flight. The executor hears completions (and
scalar metrics, and checkpoint commits), never tensors, until it fetches the final state.

The job's lifecycle is :class:`~rallypoint.orchestrator.job.state.JobState`, moved only
by :meth:`JobExecutor._set_state` (which refuses what :data:`job_state.TRANSITIONS`
does not allow). :meth:`JobExecutor.step` is one iteration of the running loop: hold
the term, check registrations and the progress watchdog every ``ETCD_CHECK_S``,
handle one event. A lost worker starts a :class:`~rallypoint.orchestrator.job.recovery_machine.Recovery`
(docs/recovery.md); a stall (no progress for the job's ``stall_timeout_s``) is a
``job.stalled`` event and a recovery of the workers the job waits on. Spares warm the
job's programs (:mod:`rallypoint.orchestrator.job.warm`) once the job has moved after its
placement or a recovery, and again whenever the spares change. A loss spike rolls the job back, a conviction
moves it off a worker computing wrong numbers (job/rollback.py). A suspend or cancel (job/stop.py), looked at on
every iteration, stops the job at a step boundary with every slice saved there: SUSPENDED or CANCELLED, its run
kept (a cancel without a final cut ends it at once).

The executor writes only under its own term (:class:`~rallypoint.orchestrator.control.election.TermWriter`);
when that term ends (:meth:`JobExecutor.stop`, or a newer term, or the lease gone) it
ends with ``job.handed_off``: the job is not failed, the next leader adopts it (``adopted=True``: from its
etcd record and newest consistent cut). Device leases and loaded runtimes are released in ``finally``.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import grpc
from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import NotLeader, RallypointError, StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.basics.tls import tls_of
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.records import parsed
from rallypoint.etcd.store import Store
from rallypoint.orchestrator.control.election import LeaderElection
from rallypoint.orchestrator.job.cut import JobCut
from rallypoint.orchestrator.job.goodput import StepTimes
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.orchestrator.job.drains import JobDrains
from rallypoint.orchestrator.job.events import JobEvents
from rallypoint.orchestrator.job.losses import JobLosses
from rallypoint.orchestrator.job.finish import JobEnd
from rallypoint.orchestrator.job.loads import JobLoads
from rallypoint.orchestrator.job.metrics import JobMetrics
from rallypoint.orchestrator.job.placement import JobPlacement
from rallypoint.orchestrator.job.ports import JobRecoveryPort, JobStragglerPort
from rallypoint.orchestrator.job.progress import JobProgress
from rallypoint.orchestrator.job.record import EventLog, JobRecorder, RecordHistory
from rallypoint.orchestrator.job.recoveries import JobRecoveries
from rallypoint.orchestrator.job.rollback import JobRollbacks, RollBack
from rallypoint.orchestrator.job.recovery import JobSettings
from rallypoint.orchestrator.job.state import TRANSITIONS, HandedOff, JobFailed, JobState, JobStopped
from rallypoint.orchestrator.job.stop import JobStop, StopRequest, stop_request
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.orchestrator.job.view import JobView
from rallypoint.orchestrator.job.warm import SpareWarmer
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.orchestrator.job.recovery_machine import Recovery
from rallypoint.orchestrator.job.runs import JOBSPEC_FILE, run_dir, spec_digest, start_run
from rallypoint.orchestrator.job.stragglers import StragglerWatch, busy_reason
from rallypoint.orchestrator.job.watchdog import ProgressWatchdog
from rallypoint.orchestrator.job.window import StepWindow
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import flat_state_digest
from rallypoint.recovery.decide import Budget, Fail
from rallypoint.recovery.remap import NoRoom
from rallypoint.recovery.replay import Graph

__all__ = ["JOBSPEC_FILE", "JobExecutor", "JobFailed", "JobState", "run_dir"]

LOSS_GRACE_S = 0.05  # after one loss, how long to gather others that happened with it
ETCD_CHECK_S = 1.0  # how often registrations and the watchdog are checked (a hung worker's stream stays open)
STEP_WAIT_S = 0.1  # the running loop's wait for an event: a drain under way advances at least this often


class JobExecutor:
    """Runs one submitted, resumed or adopted job to its end; reports through ``emit``.

    Args:
        spec: the job, as the client submitted it (or as saved, to resume or adopt).
        store, keys: the coordination store and the cluster's key schema.
        election: the leader's election; the executor writes under the term it has now.
        emit: receives each :class:`pb.JobEvent`.
        checkpoint_root: where runs keep checkpoints when the spec names no directory
            ("": the job runs without checkpoints; recovery then replays from step 0).
        resume: start every slice from the newest consistent cut of the job's last run.
        adopted: as ``resume``, for a job a lost or deposed leader ran (``job.adopted``).
        hooks: fault hooks for tests.
        budget: setbacks each recovery absorbs, by source.
        loss_grace_s: after one loss, how long to gather others that happened with it.
        workers: the RPCs to the job's workers (default: gRPC with the store's TLS identity).
        keep_runs: retention of the job name's earlier runs when a new run starts (0: keep all).
        auto_resumed: the leader resumes the job by itself, room having returned (service/verbs.py).
    """

    def __init__(self, spec: pb.JobSpec, *, store: Store, keys: Keys, election: LeaderElection,
                 emit: Callable[[pb.JobEvent], None], clock: Clock = SYSTEM_CLOCK, checkpoint_root: str = "",
                 resume: bool = False, adopted: bool = False, hooks: ExecutorHooks = ExecutorHooks(),
                 budget: Budget = Budget(), loss_grace_s: float = LOSS_GRACE_S,
                 workers: JobWorkers | None = None, keep_runs: int = 0, auto_resumed: bool = False) -> None:
        self.spec, self.store, self.keys, self.clock, self.emit = spec, store, keys, clock, emit
        self.log = get_logger("rallypoint.executor", cluster=keys.cluster, job=spec.job, term=election.term or 0)
        self.resume, self.adopted = resume or adopted, adopted
        self.hooks, self.budget = hooks, budget
        root = spec.checkpoint_dir or checkpoint_root
        self.checkpoint_root = Path(root).absolute() if root else None
        self.run_dir: Path | None = None
        self.run_id, self.spec_sha256 = "", ""  # this run of the job name, its jobspec.pb's hash (job/runs.py)
        self.keep_runs = keep_runs
        self.auto_resumed = auto_resumed
        self.graph = Graph.from_spec(spec)
        self.state = JobState.PLACING
        try:  # what the spec asks for recoveries; one it cannot have fails the job when it runs (_prepare)
            asked, self._invalid = JobSettings.from_spec(spec), ""
        except ValueError as exc:
            asked, self._invalid = None, str(exc)
        self._asked = asked
        self.settings: JobSettings | None = None  # the settings checked, once the run begins
        # The collaborators, each the one owner of its part of the job (docs/runtime.md has the table).
        self.term = JobTerm(spec.job, store=store, keys=keys, election=election, clock=clock, log=self.log,
                            on_unpaused=self._unpaused, resume=self.resume)
        self.progress = JobProgress(spec, self.graph)
        self.job_cut = JobCut(self.term, self.progress)  # moves the cut, the commits and the log floor (job/cut.py)
        self.places = JobPlacement(spec, self.term, clock=clock, log=self.log, event=self.event, settings=asked,
                                   leased=hooks.leased)
        self.term.places, self.term.steps = lambda: self.places.slices, spec.steps  # what commits are checked against
        self.workers = workers if workers is not None else JobWorkers(spec.job, tls_of(store), clock=clock)
        self.loads = JobLoads(spec, self.workers, self.term, self.places.slices, clock=clock, log=self.log,
                              settings=asked)
        self.drains = JobDrains(spec, self.graph, term=self.term, placement=self.places, loads=self.loads,
                                progress=self.progress, clock=clock, log=self.log, event=self.event, grant=self._grant,
                                hold=lambda h: self._grant(self.progress.grants.hold(h, self.workers)),
                                running=lambda: self.state is JobState.RUNNING,
                                record=lambda: self._record_quietly(), suspend=lambda r: self.stopper.request(r),
                                settings=asked)
        self.port = JobRecoveryPort(self.graph, term=self.term, placement=self.places, loads=self.loads,
                                    progress=self.progress, on_restored=self._restored, job_cut=self.job_cut)
        self.history = RecordHistory(term=self.term.term, log=self.log)  # the record's lists, bounded
        self.recorder = JobRecorder(spec.job, keys=keys, txn=self.term.txn, view=self.view, history=self.history,
                                    window=lambda: self.worker_events.window.steps, log=self.log)  # jobs/<job>
        self.record, self._record_quietly = self.recorder.record, self.recorder.quietly
        self.recovery = JobRecoveries(self.port, budget=budget, clock=clock, log=self.log, microbatches=spec.microbatches,
                                      hooks=hooks, on_replayed=lambda rec: self.job_metrics.replayed(rec))
        self.stragglers = StragglerWatch(spec, JobStragglerPort(  # docs/elastic.md
            spec.job, term=self.term, placement=self.places, loads=self.loads, progress=self.progress,
            drains=self.drains, busy=self.busy, event=self.event), clock=clock, log=self.log)
        self.step_times = StepTimes({n.name: n.slice for n in spec.nodes})  # docs/metrics.md
        self.job_metrics = JobMetrics(spec, log=self.log, event=self.event, wall=clock.wall)  # <run dir>/metrics.jsonl, non-finite
        self.event_log = EventLog(term=self.term.term, log=self.log, clock=clock)  # <run dir>/events.jsonl (rallypoint logs)
        self.emit = self.event_log.tee(self.job_metrics.tee(emit))
        self.losses = JobLosses(spec, self.graph, workers=self.workers, loads=self.loads, progress=self.progress,
                                placement=self.places, drains=self.drains, recovery=self.recovery, budget=budget,
                                loss_grace_s=loss_grace_s, settings=asked, clock=clock, set_state=self._set_state,
                                event=self.event)  # job/losses.py
        self.rollbacks = JobRollbacks(  # spikes rolled back, skipped batches, verifications (job/rollback.py)
            spec, term=self.term, progress=self.progress, job_cut=self.job_cut, loads=self.loads, port=self.port,
            recovery=self.recovery, drains=self.drains, stopping=lambda: self.state is JobState.STOPPING,
            log=self.log, event=self.event, grant=self._grant, recover=self.losses.recover, record=self.record,
            window=lambda: self.worker_events.window.steps, clock=clock, budget=budget, places=self.places,
            tls=tls_of(store))
        self.worker_events = JobEvents(  # what the workers' events move (job/events.py)
            spec, self.graph, workers=self.workers, loads=self.loads, progress=self.progress, placement=self.places,
            drains=self.drains, recovery=self.recovery, stragglers=self.stragglers, step_times=self.step_times,
            metrics=self.job_metrics, job_cut=self.job_cut, rollbacks=self.rollbacks, adopted=self.adopted, log=self.log,
            event=self.event, emit=self.emit,
            grant=self._grant, recover=self.losses.recover, record=self._record_quietly)
        self.stopper = JobStop(  # a suspend or cancel, at a step boundary (job/stop.py)
            spec.job, placed=lambda: {s: p.worker for s, p in self.places.slices.items() if p.worker in self.loads.loaded},
            progress=self.progress, drains=self.drains, recovery=self.recovery, interrupt=self.term.interrupt,
            set_state=self._set_state, event=self.event, log=self.log)
        self.started_at = clock.wall()  # when the run began (an adopted or resumed run keeps its first start)
        self.watchdog: ProgressWatchdog | None = None
        self.warmer: SpareWarmer | None = None
        self._checked = float("-inf")
        self.end = JobEnd(spec, workers=self.workers, term=self.term, places=self.places, losses=self.losses,
                          recovery=self.recovery, drains=self.drains, progress=self.progress, clock=clock, log=self.log,
                          hooks=hooks, step=self.step, set_state=self._set_state,
                          settled=self.rollbacks.settled)  # the final cut and state (finish.py)
        self.started_mono, self.ended_mono = clock.monotonic(), None  # ended: when run() ended (steps/s stops)

    # -- what outside code reads and asks (job/view.py) ------------------------------------------

    def view(self) -> JobView:
        """The job now, as outside code reads it (job/view.py): copies of what each owner holds."""
        p, end = self.progress, self.ended_mono if self.ended_mono is not None else self.clock.monotonic()
        return JobView(
            job=self.spec.job, state=self.state, steps=self.spec.steps, priority=self.spec.priority,
            submit_id=self.spec.submit_id, owner=self.spec.owner, code_sha256=self.spec.code.sha256,
            spec_sha256=self.spec_sha256, term=self.term.term or 0,
            run_id=self.run_id, run_dir=self.run_dir, adopted=self.adopted, resumed=self.resume,
            auto_resumed=self.auto_resumed, policy=self.settings.policy if self.settings else "",
            completed=p.completed, start_step=p.start, cut=p.cut, placement=MappingProxyType(dict(self.places.slices)),
            done_through=MappingProxyType({n.name: p.done_through(n.name) for n in self.graph.nodes}),
            replayed=MappingProxyType(dict.copy(p.replayed)), compute_s=MappingProxyType(dict.copy(p.compute_s)),
            redone_s=float(p.redone_s), step_times=MappingProxyType(dict.copy(self.step_times.by_slice)),
            recoveries=tuple(self.recovery.records), recovery_entries=tuple(self.recovery.entries()),
            failures=tuple(dict(f) for f in self.port.failures), drain_records=tuple(self.drains.drain_records),
            resharded=tuple(self.places.resharded), stop=self.stopper.pending,
            stalls=self.watchdog.stalls if self.watchdog else 0, integrity=self.rollbacks.to_json(), started_at=self.started_at,
            running_s=end - self.started_mono, at=self.clock.wall())

    def request_stop(self, request: StopRequest) -> bool:
        """A suspend or cancel the leader took (service/verbs.py), carried out at the next step boundary."""
        return self.stopper.request(request)

    # -- state and record --------------------------------------------------------------------------

    def _set_state(self, new: JobState, **fields: Any) -> None:
        """The one way the job's state moves; records it in etcd (a handed-off job writes nothing)."""
        old = self.state
        if new not in TRANSITIONS[old]:
            raise AssertionError(f"job {self.spec.job}: no transition {old.value} -> {new.value}")
        self.state = new
        self.log.info("job.state", previous=old.value, state=new.value, **fields)
        if new is JobState.HANDED_OFF:
            return
        (self.recorder.record if new.is_terminal else self.recorder.quietly)(**fields)

    def event(self, event: str, step: int = 0, **detail: Any) -> None:
        self.emit(pb.JobEvent(job=self.spec.job, event=event, step=step, detail=json.dumps(detail)))

    def stop(self, reason: str) -> None:
        """This coordinator's term ended: end the run soon with ``job.handed_off`` (thread-safe)."""
        self.term.stop(reason)
        self.log.info("job.stop_requested", reason=reason)

    def _unpaused(self) -> None:
        if self.watchdog is not None:
            self.watchdog.progressed()  # a pause is not a stall: the quiet period starts again
        self._grant()

    # -- start ------------------------------------------------------------------------

    def _prepare(self) -> None:
        try:
            if self._asked is None:
                raise ValueError(self._invalid)
            self.settings = self._asked
            self.watchdog = ProgressWatchdog(self.clock, self.settings.stall_timeout_s,
                                             compile_timeout_s=self.settings.compile_timeout_s,
                                             window_s=self.settings.failure_policy.window_s)
            self.recovery.configure(self.settings.failure_policy)
            self.warmer = SpareWarmer(self.spec, self.workers, cluster=self.keys.cluster, term=self.term.term,
                                      max_spares=self.settings.warm_spares, log=self.log, gangs=self.places.gangs,
                                      clock=self.clock)
        except ValueError as exc:
            raise JobFailed(str(exc)) from None
        if self.resume:
            if self.checkpoint_root is None:
                raise JobFailed("no checkpoint directory: a job without checkpoints cannot be resumed or adopted")
            earlier = self.term.until_etcd("reading the job record", lambda: self.store.get(self.keys.job(self.spec.job)))
            old = parsed(earlier, "job") or {}
            self.run_dir = run_dir(self.checkpoint_root, self.spec.job, create=False, record=old)  # LATEST bound to it
            self.run_id, self.spec_sha256 = self.run_dir.name, spec_digest(self.run_dir, old)  # run_files.py
            if old.get("run") == self.run_id:  # the same run goes on: its first start, its recoveries so far
                self.started_at = float(old.get("started_at") or self.started_at)
                self.recovery.adopt(old.get("recoveries", []), self.term.term)  # docs/recovery.md
                self.history.adopt(old.get("recoveries_earlier"))
                self.rollbacks.adopt(old)  # the batches it skips, its rollbacks (docs/integrity.md)
            asked = self.term.until_etcd("reading the job's control", lambda: self.store.get(self.keys.control(self.spec.job)))
            if asked is not None and self.adopted:  # a suspend or cancel the lost leader had not carried out
                self.stopper.request(stop_request(asked.value, self.log))
        else:  # a new run: the previous one is kept under its run id (runs.py; the service refused a resubmit)
            self.run_id, self.run_dir, self.spec_sha256 = start_run(
                self.spec, self.store, self.keys, self.term.txn, self.checkpoint_root, self.keep_runs, self.log,
                now=self.clock.wall())
        self.term.open_run(self.run_dir)
        self.loads.open_run(self.run_dir)
        self.event_log.open(self.run_dir)
        self.job_metrics.open(self.run_dir, self.settings.on_nonfinite)  # a resumed or adopted run appends
        self.rollbacks.configure(self.settings.spikes, self.settings.on_nonfinite, self.run_dir,
                                 self.settings.checkpoint_every, self.settings.log_limit_bytes)
        self.drains.open_run(self.run_dir is not None and self.settings.checkpoint_every > 0)
        self.stragglers.configure(self.settings.stragglers, self.settings.checkpoint_every if self.run_dir else 0)
        self.worker_events.window = StepWindow(self.spec.window, checkpoint_every=self.settings.checkpoint_every,  # window.py
            checkpoints=self.run_dir is not None, steps=self.spec.steps, log_limit_bytes=self.settings.log_limit_bytes)
        if self.resume:  # what an earlier executor left (device leases, loaded runtimes) goes first
            self.term.leases().release(self.spec.job)
            self.loads.unload_everywhere(read_cluster(self.store, self.keys))

    def _load_all_from_cut(self, workers: set[str] | None) -> dict[str, str] | Fail:
        """Resume or adopt: the slices of ``workers`` (None: all) from the newest cut that restores; those lost (or Fail)."""
        newest = self.port.load_newest_cut(self.budget, workers)
        if isinstance(newest, Fail):
            return newest
        c, commits, failed = newest
        self.progress.begin(c, commits)
        self.rollbacks.seed(self.run_dir, c)  # the spike detector's baseline: the steps before the cut
        self.event("job.adopted" if self.adopted else "job.resumed", step=c, checkpoint_step=c, auto=self.auto_resumed)
        return self.port.lost_at_load(self.budget, failed, c)

    # -- running ------------------------------------------------------------------------

    def _grant(self, workers: list[str] | None = None) -> None:
        """Grant every worker (or ``workers``) what the job's grants say now (the window, the holds, the cut).
        Asynchronous: failures come back as ``grant_failed`` events (``_grant_failed``)."""
        self.workers.grant(self.progress.grants.now(self.workers.workers if workers is None else workers,
                                                    self.progress.cut))

    def step(self, timeout_s: float = 0.25) -> None:
        """One iteration of the running loop: hold the term, a stop asked, the periodic checks, one event."""
        self.term.hold()
        self._grant(self.progress.grants.hold(self.stopper.check(self.state), self.workers))  # a stop's hold, if begun
        if self.clock.monotonic() - self._checked >= ETCD_CHECK_S:
            self._checked = self.clock.monotonic()
            lost, alive = self.places.as_lead_losses(self.term.gone(
                {w: self.workers.identity[w].incarnation for w in self.workers.workers} | self.places.gang_members()))
            if lost:
                self.losses.recover(lost, unload=alive)
                return
            self._grant(self.progress.grants.retry(self.workers.workers))  # refused grants, again
            self._warm_check()
            assert self.watchdog is not None
            quiet = self.watchdog.check(self.losses.compiling(self.watchdog))
            if quiet is not None:
                self.losses.stalled(quiet, self.watchdog)
                return
        self.rollbacks.poll()  # a rollback that waited for a recovery or a drain; a verification's result
        if self.state is not JobState.STOPPING:
            self.drains.poll()  # the newest reading of drain and yield requests, if any (read off this thread)
        if self.drains.drains:
            if self.drains.parked_waiting and self.watchdog is not None:
                self.watchdog.progressed()  # a job waiting for its parked slices' room is not stalled
            moved = self.drains.step()
            self.job_cut.floors(moved.floors)  # a move's spares log from the drain step only
            if moved.lost:
                self.losses.recover(dict(moved.lost))
                return
        try:
            kind, (worker, gen, item) = self.workers.events.get(timeout=min(timeout_s, STEP_WAIT_S))
        except queue.Empty:
            return
        assert self.watchdog is not None
        try:
            self.worker_events.handle(kind, worker, gen, item, self.watchdog)
        except RollBack as rb:  # a loss spike (or a value not finite) under a rollback policy (job/rollback.py)
            self.rollbacks.roll_back(rb.spike)

    def worker_fenced(self, worker: str, incarnation: int, reason: str) -> None:
        """The leader fenced ``worker`` (any thread): if this job runs on that incarnation, recover it."""
        self.worker_events.fenced(worker, incarnation, reason)

    def _restored(self, recovery: Recovery) -> None:
        """The recovery's lost slices run again: the cut becomes the one restored from, back to RUNNING."""
        self.job_cut.restored(*self.port.restore_point(recovery))
        rec = recovery.record
        self._set_state(JobState.RUNNING, recovery=rec.number)
        assert self.watchdog is not None
        self.watchdog.progressed()
        self.event("job.recovered", step=self.progress.completed, **rec.to_json(), placement=self.places.to_json())
        self.log.info("recovery.restored", **rec.to_json())
        self._warm_soon(f"recovery {rec.number}")
        self._grant()

    # -- what slows the job, and the warm spares ------------------------------------------------------

    def busy(self) -> str:
        """Why the job is not running undisturbed now ("" when it is): no straggler is judged meanwhile."""
        active = self.recovery.active
        return busy_reason(self.state, drain=self.drains.busy(), recovery=active.record.number if active else None,
                           warming=self.warmer is not None and self.warmer.warming,
                           all_granted=self.progress.all_granted)

    def _warm_soon(self, reason: str) -> None:
        if self.warmer is not None:
            self.warmer.soon(reason, self.progress.completed)

    def _warm_check(self) -> None:
        if self.warmer is not None:
            self.warmer.check(self.clock.monotonic(), self.progress.completed, self.recovery.active is not None,
                              lambda: read_cluster(self.store, self.keys), exclude=frozenset(self.workers.workers))

    # -- the whole run ----------------------------------------------------------------------

    def begin(self) -> None:
        """PLACING -> LOADING -> RUNNING: place, load (from the newest cut when resuming or adopting), grant."""
        self.started_mono = self.clock.monotonic()
        self._prepare()
        self._set_state(JobState.PLACING, adopted=self.adopted, resumed=self.resume)
        try:
            placed = self._place()
        finally:
            self.places.withdraw_yields()
        if isinstance(placed, NoRoom):  # the placement's decision, carried out here
            raise JobFailed(placed.reason)
        gone, alive = self.places.as_lead_losses(placed)  # lost while placed: not loaded (a gang with its member)
        load = {p.worker for p in self.places.slices.values()} - set(gone) if gone else None
        self._set_state(JobState.LOADING)
        lost = self._load_all_from_cut(load) if self.resume else self.port.lost_at_load(self.budget, self.loads.load(load, 0, {}), 0)
        if isinstance(lost, Fail):  # the loads' decision, carried out here
            raise JobFailed(lost.reason)
        self._set_state(JobState.RUNNING)
        self.event("job.started", step=self.progress.completed, run=self.run_id, placement=self.places.to_json(),
                   resumed=self.resume, adopted=self.adopted, **self.worker_events.window.choice.to_json())
        self._warm_soon("placed")
        self.progress.widen(self.worker_events.window.steps)
        if gone or lost:  # workers lost while the job was placed or loading: an ordinary recovery moves their slices
            self.losses.recover({**gone, **lost}, unload=alive)
        else:
            self._grant()

    def _place(self) -> dict[str, str] | NoRoom:
        return self.places.place(lambda: read_cluster(self.store, self.keys), adopting=self.adopted,
                                 resuming=self.resume and not self.adopted)

    def finish(self) -> pb.JobEvent:
        """The final cut committed, FINISHING: fetch the final state; the ``job.finished`` event (sent by :meth:`run`)."""
        states = self.end.fetch()
        trees = {s.name: s.treedef for s in self.spec.states}
        detail = {"wall_s": round(self.clock.monotonic() - self.started_mono, 3),
                  "state_digest": flat_state_digest(states, trees), "start_step": self.progress.start,
                  "adopted": self.adopted, **self.summary()}
        return pb.JobEvent(job=self.spec.job, event="job.finished", step=self.spec.steps, states=states,
                           detail=json.dumps(detail))

    def run(self) -> JobState:
        """Run the job to its end: :meth:`begin`, :meth:`step` until every step is done, :meth:`finish`.

        Never raises: the end is a ``job.finished``, ``job.failed`` or ``job.handed_off``
        event and state. The terminal event goes out last, after the devices are released
        and the final state is recorded in etcd, so a client that sees it sees a settled cluster.
        """
        terminal = pb.JobEvent(job=self.spec.job, event="job.failed",
                               detail=json.dumps({"reason": "the executor ended without a result"}))
        final, reason = JobState.FAILED, ""
        try:
            self.begin()
            while self.progress.completed < self.spec.steps:
                self.step()
            self.end.final_cut(self.run_dir is not None and self.settings is not None
                               and self.settings.checkpoint_every > 0)
            terminal = self.finish()
            final = JobState.SUCCEEDED
        except JobStopped as exc:  # suspended or cancelled on request (job/stop.py): the run is kept
            reason, final = str(exc), exc.state
            self.log.warning("job.stopped", state=final.value, reason=reason, step=self.progress.completed)
            self.recovery.supersede(reason)
            self.drains.abort(reason)
            terminal = pb.JobEvent(job=self.spec.job, event=f"job.{final.value}", step=self.progress.completed,
                                   detail=json.dumps({"reason": reason, "run": self.run_id, "cut": self.progress.cut,
                                                      "stop": self.stopper.pending.to_json() if self.stopper.pending
                                                      else {}, **self.summary()}))
        except (HandedOff, NotLeader) as exc:
            reason = f"{exc}; the next leader adopts the job"
            self.log.warning("job.handed_off", reason=reason, step=self.progress.completed)
            terminal = pb.JobEvent(job=self.spec.job, event="job.handed_off", step=self.progress.completed,
                                   detail=json.dumps({"reason": reason}))
            final = JobState.HANDED_OFF
        except (RallypointError, grpc.RpcError) as exc:
            reason = str(exc) if isinstance(exc, RallypointError) else f"{exc.code().name} {exc.details()}"
            self.log.error("job.failed", reason=reason)
            terminal = pb.JobEvent(job=self.spec.job, event="job.failed",
                                   detail=json.dumps({"reason": reason, **self.summary()}))
        finally:
            self.ended_mono = self.clock.monotonic()
            self._cleanup()
            try:
                self._set_state(final, **({"reason": reason} if reason and final is not JobState.SUCCEEDED else {}))
            except (StoreError, NotLeader) as exc:
                self.log.warning("job.record_failed", error=str(exc))
            self.emit(terminal)
        return final

    def summary(self) -> dict[str, Any]:
        """Failures, recoveries and replay counts, as ``job.finished`` reports them."""
        return {"failures": self.port.failures, "recoveries": self.recovery.to_json(), **self.progress.summary(),
                "corrupt_checkpoints": self.port.corrupt, "drains": self.drains.to_json(), **self.places.summary(),
                "stalls": self.watchdog.stalls if self.watchdog else 0, "window": self.worker_events.window.steps,
                "output_log_peak": self.worker_events.log_peak, "stragglers": self.stragglers.decisions,
                "final_cut_s": self.end.final_cut_s, **self.rollbacks.summary()}

    def _cleanup(self) -> None:
        """Release what the job holds, whatever ended it; a term that is over releases nothing in etcd."""
        try:
            self.workers.close()
        except Exception as exc:  # closing must not hide why the run ended
            self.log.warning("job.close_failed", error=repr(exc))
        if self.term.over:
            return  # the next leader releases what this term held (and plans the warm spares again)
        if self.warmer is not None:
            self.warmer.release()  # best effort, bounded: the spares drop what they hold for the job
        self.places.release_all()


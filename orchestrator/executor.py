"""The graph executor: runs one job on the cluster, from the leader, through host losses.

It places every virtual slice on a worker's devices (device leases, fenced on the
term that started the job), records the placement in etcd, loads each worker with the
exported programs of its slices and its routes, and then only **grants steps**:
workers run instances as their inputs arrive and push outputs straight to each other,
and a bounded window of steps is in flight. The executor hears completions (and
scalar metrics, and checkpoint commits), never tensors, until it fetches the final state.

The job's lifecycle is :class:`~rallypoint.orchestrator.job_state.JobState`, moved only
by :meth:`JobExecutor._set_state` (which refuses what :data:`job_state.TRANSITIONS`
does not allow). :meth:`JobExecutor.step` is one iteration of the running loop: hold
the term, check registrations and the progress watchdog every ``ETCD_CHECK_S``,
handle one event. A lost worker starts a :class:`~rallypoint.orchestrator.recovery_machine.Recovery`
(docs/recovery.md); a stall (no progress for the job's ``stall_timeout_s``) is a
``job.stalled`` event and a recovery of the workers the job waits on. Spares warm the
job's programs (:mod:`rallypoint.orchestrator.job_warm`) once the job has moved after its
placement or a recovery, and again whenever the spares change.

The executor writes only under its own term (:class:`~rallypoint.orchestrator.election.TermWriter`);
when that term ends (:meth:`JobExecutor.stop`, or a newer term, or the lease gone) it
ends with ``job.handed_off``: the job is not failed, the next leader adopts it
(``adopted=True``: from its etcd record and newest consistent cut). Device leases
and loaded runtimes are released in ``finally``, whatever ended the run.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.basics.errors import AllocationError, NotLeader, RallypointError, StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.basics.logs import get_logger
from rallypoint.basics.retry import retrying
from rallypoint.etcd.store import Delete, Store
from rallypoint.orchestrator.election import LeaderElection
from rallypoint.orchestrator.failures import Verdict, WorkerCallFailed
from rallypoint.orchestrator.goodput import StepTimes
from rallypoint.orchestrator.hooks import ExecutorHooks
from rallypoint.orchestrator.job_cluster import ETCD_OUTAGE_S
from rallypoint.orchestrator.job_placement import JobPlacement
from rallypoint.orchestrator.job_recovery import RecoveryRecord, RecoverySettings
from rallypoint.orchestrator.job_state import TRANSITIONS, HandedOff, JobFailed, JobState
from rallypoint.orchestrator.job_warm import SpareWarmer
from rallypoint.orchestrator.placement import instances_per_step
from rallypoint.orchestrator.recovery_machine import Recovery, classify_setback
from rallypoint.orchestrator.stragglers import StragglerWatch
from rallypoint.orchestrator.watchdog import ProgressWatchdog, laggards
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import RESHARD_TOLERANCE, flat_state_digest
from rallypoint.recovery.decide import Budget, Fail, FallBack, Refence, Setback, Source, decide

__all__ = ["JOBSPEC_FILE", "JobExecutor", "JobFailed", "JobState", "run_dir"]

LOSS_GRACE_S = 0.05  # after one loss, how long to gather others that happened with it
ETCD_CHECK_S = 1.0  # how often registrations and the watchdog are checked (a hung worker's stream stays open)
DRAIN_POLL_S = 0.1  # how often drain and yield requests are read: a drain lands a step or two after it is asked
JOBSPEC_FILE = "jobspec.pb"
LATEST_FILE = "LATEST"


def run_dir(root: Path, job: str, *, create: bool) -> Path:
    """The checkpoint directory of the job's newest run under ``root`` (a new one when ``create``)."""
    base = root / job
    if create:
        name = time.strftime("run-%Y%m%dT%H%M%S-") + uuid.uuid4().hex[:6]
        (base / name).mkdir(parents=True)
        (base / LATEST_FILE).write_text(name + "\n")
        return base / name
    latest = base / LATEST_FILE
    if not latest.exists():
        raise JobFailed(f"no run of job {job!r} under {root}: nothing to resume (is --checkpoint-dir right?)")
    return base / latest.read_text().strip()


class JobExecutor(JobPlacement):
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
    """

    def __init__(self, spec: pb.JobSpec, *, store: Store, keys: Keys, election: LeaderElection,
                 emit: Callable[[pb.JobEvent], None], clock: Clock = SYSTEM_CLOCK, checkpoint_root: str = "",
                 resume: bool = False, adopted: bool = False, hooks: ExecutorHooks = ExecutorHooks(),
                 budget: Budget = Budget(), loss_grace_s: float = LOSS_GRACE_S) -> None:
        log = get_logger("rallypoint.executor", cluster=keys.cluster, job=spec.job, term=election.term or 0)
        super().__init__(spec, store=store, keys=keys, election=election, clock=clock, emit=emit, log=log)
        self.resume, self.adopted = resume or adopted, adopted
        self.hooks, self.budget, self.loss_grace_s = hooks, budget, loss_grace_s
        root = spec.checkpoint_dir or checkpoint_root
        self.checkpoint_root = Path(root).absolute() if root else None
        self.start = 0  # the step the current runtimes started from (resume)
        self.watchdog: ProgressWatchdog | None = None
        self.machines: list[Recovery] = []
        self.redone_s = 0.0
        self.compute_s: Counter[str] = Counter()  # per node, device-seconds of first runs
        self.log_peak = {"memory_bytes": 0, "spilled_bytes": 0}
        self._commits: dict[str, int] = {}
        self._step_count: Counter[int] = Counter()
        self._metrics: dict[int, list[tuple[str, int, float]]] = defaultdict(list)
        self._ungranted: set[str] = set()
        self._checked = self._drains_polled = float("-inf")
        self._t0 = clock.monotonic()
        self._stop_reason: str | None = None
        self._stop_lock = threading.Lock()
        self.warmer: SpareWarmer | None = None
        self.stragglers = StragglerWatch(self)  # docs/elastic.md: a straggling slice moves to a spare
        self.step_times = StepTimes({n.name: n.slice for n in spec.nodes})  # docs/metrics.md
        self.ended_mono: float | None = None  # when run() ended (the metrics' steps/s stops there)

    # -- state ----------------------------------------------------------------------

    def _set_state(self, new: JobState, **fields: Any) -> None:
        """The one way the job's state moves; records it in etcd (a handed-off job writes nothing)."""
        old = self.state
        if new not in TRANSITIONS[old]:
            raise AssertionError(f"job {self.spec.job}: no transition {old.value} -> {new.value}")
        self.state = new
        self.log.info("job.state", previous=old.value, state=new.value, **fields)
        if new is JobState.HANDED_OFF:
            return
        if new.is_terminal:
            self.record(**fields)
        else:
            self._record_quietly(**fields)

    def _record_quietly(self, **fields: Any) -> None:
        """Record progress, unless etcd is away (the next record catches up)."""
        try:
            self.record(**fields)
        except (StoreError, NotLeader) as exc:
            self.log.warning("job.record_failed", error=str(exc))

    def stop(self, reason: str) -> None:
        """This coordinator's term ended: end the run soon with ``job.handed_off`` (thread-safe)."""
        with self._stop_lock:
            if self._stop_reason is None:
                self._stop_reason = reason
        self.log.info("job.stop_requested", reason=reason)

    # -- the term ---------------------------------------------------------------------

    def hold_term(self) -> None:
        """Return while this executor's term holds; wait out an etcd outage; hand off when the term is over.

        A leader whose lease deadline passed (etcd unreachable, or its quorum lost) is
        not deposed yet: if etcd answers before the lease expires, the coordinator takes
        the same term again and the job goes on where it was.
        """
        def check() -> None:
            if self._stop_reason is not None:
                raise HandedOff(f"the coordinator stepped down: {self._stop_reason}")
            if self.writer.over:
                raise HandedOff(f"term {self.term} is over")
            if not self.writer.holds:
                raise NotLeader(f"job {self.spec.job}", f"term {self.term} is not held right now")
            self.election.check()

        try:
            check()
            return
        except NotLeader as exc:
            self.log.warning("job.paused", reason=exc.reason)
        try:
            retrying(clock=self.clock, what="holding the term", log=self.log, retry_on=NotLeader,
                     stop_after_s=ETCD_OUTAGE_S, initial_s=0.25, max_s=0.25, jitter_s=0.0)(check)
        except NotLeader as exc:
            raise JobFailed(f"etcd stayed unreachable for {ETCD_OUTAGE_S:.0f}s ({exc.reason}); the next leader "
                            f"adopts the job, or resume it with `rallypoint resume {self.spec.job}`") from None
        self.log.info("job.unpaused")
        if self.watchdog is not None:
            self.watchdog.progressed()  # a pause is not a stall: the quiet period starts again
        self._grant()

    # -- start ------------------------------------------------------------------------

    def _prepare(self) -> None:
        try:
            self.settings = RecoverySettings.from_spec(self.spec)
            self.watchdog = ProgressWatchdog(self.clock, self.settings.stall_timeout_s)
            self.warmer = SpareWarmer(self.spec, self.workers, cluster=self.keys.cluster, term=self.term,
                                      max_spares=self.settings.warm_spares, log=self.log)
        except ValueError as exc:
            raise JobFailed(str(exc)) from None
        if self.resume:
            if self.checkpoint_root is None:
                raise JobFailed("no checkpoint directory: a job without checkpoints cannot be resumed or adopted")
            self.run_dir = run_dir(self.checkpoint_root, self.spec.job, create=False)
            self._take_over()
            return
        # A new run: commits of an earlier run of this job name no longer count.
        self.writer.txn([], [Delete(self.keys.checkpoints(self.spec.job), prefix=True)])
        if self.checkpoint_root is not None:
            self.run_dir = run_dir(self.checkpoint_root, self.spec.job, create=True)
            (self.run_dir / JOBSPEC_FILE).write_bytes(self.spec.SerializeToString())

    def _take_over(self) -> None:
        """Resume or adopt: what an earlier executor left (device leases, loaded runtimes) goes first."""
        self.leases().release(self.spec.job)
        snap = read_cluster(self.store, self.keys)
        for w, ws in snap.workers.items():
            self.workers.unload_stale(w, ws.info.address, pb.Identity(cluster=self.keys.cluster, worker_id=w,
                                                                      incarnation=ws.info.incarnation, term=self.term))

    def _load_all_from_cut(self) -> dict[str, str]:
        """Resume or adopt: every slice from the newest consistent cut that restores; returns the workers lost."""
        commits, before, corrupt_count = self.commits(), None, 0
        while True:
            c = self.cut_step(commits, before)
            failed = self.load(None, c, commits)
            if not any(f.verdict is Verdict.CORRUPT for f in failed.values()):
                break
            self.reset_all()
            setback = classify_setback(failed, c, {})
            corrupt_count += 1
            decision = decide(setback, corrupt_count, self.budget)
            if not isinstance(decision, FallBack):
                raise JobFailed("; ".join(str(f) for f in failed.values()))
            self.log.warning("resume.corrupt_checkpoint", step=c, error=setback.detail)
            if decision.drop is not None:
                self.drop_commit(*decision.drop, setback.detail)
            commits, before = self.commits(), c
        self.start = self.completed = self.cut = c
        self.event("job.adopted" if self.adopted else "job.resumed", step=c, checkpoint_step=c)
        return self._lost_at_load(failed, c)

    def _lost_at_load(self, failed: dict[str, WorkerCallFailed], cut: int) -> dict[str, str]:
        """The workers lost while the job was loading (a recovery moves them); any other failure fails the job."""
        if not failed:
            return {}
        setback = classify_setback(failed, cut, {w: self.registered(w) for w in failed})
        decision = decide(setback, 1, self.budget)
        if isinstance(decision, Refence):
            self.log.warning("job.lost_while_loading", workers=sorted(decision.lost), reason=decision.reason)
            return dict(decision.lost)
        w, f = next(iter(failed.items()))
        raise JobFailed(f"worker {w} could not load the job: {f}")

    # -- running ------------------------------------------------------------------------

    def _grant(self, workers: list[str] | None = None) -> None:
        """Grant every worker (or ``workers``) the current window and cut.

        Asynchronous: failures come back as ``grant_failed`` events (``_grant_failed``).
        Workers held for a drain get no step at or past their drain step.
        """
        self.grant(workers)

    def _grant_failed(self, worker: str, failure: WorkerCallFailed) -> None:
        """A worker whose process is gone is lost; any other refusal is granted again later
        (``_ungranted``): one that does not answer (hung, partitioned) is lost once its etcd
        registration is gone, which the periodic check sees."""
        if failure.verdict is Verdict.LOST:
            self._recover({worker: str(failure)})
            return
        self._ungranted.add(worker)
        self.log.info("job.grant_refused", worker=worker, code=failure.code.name, verdict=failure.verdict.value)

    def step(self, timeout_s: float = 0.25) -> None:
        """One iteration of the running loop: hold the term, the periodic checks, one event."""
        self.hold_term()
        if self.clock.monotonic() - self._checked >= ETCD_CHECK_S:
            self._checked = self.clock.monotonic()
            lost = self.lost_in_etcd()
            if lost:
                self._recover(lost)
                return
            if self._ungranted:
                retry, self._ungranted = sorted(self._ungranted & set(self.workers.workers)), set()
                self._grant(retry)
            self._warm_check()
            assert self.watchdog is not None
            quiet = self.watchdog.check()
            if quiet is not None:
                self._stalled(quiet)
                return
        if self.clock.monotonic() - self._drains_polled >= DRAIN_POLL_S:
            self._drains_polled = self.clock.monotonic()
            self.poll_drains()
        if self.drains:
            self.step_drains()
        try:
            kind, (worker, gen, item) = self.workers.events.get(timeout=min(timeout_s, DRAIN_POLL_S))
        except queue.Empty:
            return
        self._handle(kind, worker, gen, item)

    def worker_fenced(self, worker: str, incarnation: int, reason: str) -> None:
        """The leader fenced ``worker`` (any thread): if this job runs on that incarnation, recover it."""
        to, gen = self.workers.identity.get(worker), self.workers.generation.get(worker)
        if to is not None and gen is not None and to.incarnation == incarnation:
            self.workers.events.put(("fenced", (worker, gen, reason)))

    def _handle(self, kind: str, worker: str, gen: int, item: Any) -> None:
        if kind == "warmed":  # a round of WarmJob requests answered (job_warm.py)
            self.log.info("job.warmed", **item)
            self.event("job.warmed", step=self.completed, **item)
            return
        if not self.workers.current(worker, gen):
            return  # a runtime given up on
        if kind == "grant_failed":
            self._grant_failed(worker, item)
            return
        if kind == "fenced":
            self._recover({worker: f"fenced by the leader ({item})"})
            return
        self._last_heard[worker] = self.clock.monotonic()
        if kind == "ended":
            self._recover({worker: f"event stream ended: {item}"})
            return
        assert self.watchdog is not None
        self.watchdog.progressed()
        if item.checkpoint_slice:
            self._on_commit(item.checkpoint_slice, int(item.checkpoint_step))
            return
        if item.error:
            where = f"node {item.node!r} failed at step {item.step}" if item.node else "the job failed"
            raise JobFailed(f"{where} on worker {worker}: {item.error}")
        self.log_peak["memory_bytes"] = max(self.log_peak["memory_bytes"], int(item.log_bytes))
        self.log_peak["spilled_bytes"] = max(self.log_peak["spilled_bytes"], int(item.log_spilled_bytes))
        self._count(worker, gen, item)
        self._advance()

    def _count(self, worker: str, gen: int, item: pb.InstanceDone) -> None:
        step, node = int(item.step), item.node
        for m in self.machines:
            m.observe(worker, gen, node, step)
        self.on_instance(worker, node, step)
        if item.program_source:  # a node's first call on this runtime: where its executable came from
            for m in self.machines:
                m.record.first_call(worker, gen, self.graph.node(node).slice, item.program_source, item.compile_s)
        if step < self.completed or item.microbatch in self._done[(node, step)]:
            self.replayed[node] += 1
            self.redone_s += item.compute_s
            return
        self._done[(node, step)].add(item.microbatch)
        self.stragglers.instance(item)
        self._step_count[step] += 1
        self.compute_s[node] += item.compute_s
        self.step_times.instance(node, step, item.compute_s)
        self._metrics[step].extend((name, item.microbatch, v) for name, v in item.metrics.items())

    def _advance(self) -> None:
        steps, window = self.spec.steps, max(1, self.spec.window)
        while self.completed < steps and self._step_count[self.completed] == instances_per_step(self.spec, self.completed):
            s = self.completed
            by_name: dict[str, list[tuple[int, float]]] = defaultdict(list)
            for name, mb, v in self._metrics.pop(s, []):
                by_name[name].append((mb, v))
            metrics = {name: float(np.mean([v for _, v in sorted(vals)])) for name, vals in by_name.items()}
            self.emit(pb.JobEvent(job=self.spec.job, event="step.done", step=s, metrics=metrics))
            self.step_times.step_done(s)
            for n in self.spec.nodes:
                self._done.pop((n.name, s), None)
            del self._step_count[s]
            self.completed += 1
            if self.completed % 10 == 0:
                self._record_quietly()
        for m in self.machines:
            m.progressed()
        if self.completed + window > self.granted and self.granted < steps:
            self.granted = min(self.completed + window, steps)
            self._grant()
        self.stragglers.advanced()

    def _on_commit(self, slice_name: str, step: int) -> None:
        self.on_saved(slice_name, step)
        self._commits[slice_name] = max(step, self._commits.get(slice_name, 0))
        cut = min((self._commits.get(s, 0) for s in self._ckpt_slices), default=0)
        if cut > self.cut:
            self.cut = cut
            self.log_floor = {n: f for n, f in self.log_floor.items() if f > cut}
            self.log.info("job.cut", step=cut)
            self._grant()

    # -- losses and stalls ----------------------------------------------------------------------

    def _stalled(self, quiet: float) -> None:
        """No progress for the stall timeout: report it, and recover the workers the job waits on."""
        assert self.watchdog is not None
        worker_of = {s: p.worker for s, p in self.placement.items()}
        blamed = laggards([(n.name, n.slice) for n in self.graph.nodes], self.done_through, worker_of, self.spec.steps)
        reason = (f"no progress for {quiet:.1f}s (stall timeout {self.watchdog.timeout_s:g}s) at step {self.completed}: "
                  + ("; ".join(f"{w}: {why}" for w, why in sorted(blamed.items())) or "no node is behind"))
        decision = decide(Setback(Source.STALL, workers=blamed, detail=reason), self.watchdog.stalls, self.budget)
        self.log.warning("job.stalled", reason=reason, stalls=self.watchdog.stalls, limit=self.budget.stall,
                         decision=type(decision).__name__)
        self.event("job.stalled", step=self.completed, reason=reason, workers=sorted(blamed),
                   stalls=self.watchdog.stalls, limit=self.budget.stall)
        if isinstance(decision, Refence):
            self._recover({w: f"stalled: {why}" for w, why in decision.lost.items()})
        elif isinstance(decision, Fail):
            raise JobFailed(decision.reason)

    def _gather(self, lost: dict[str, str]) -> None:
        """Other workers lost at the same moment: their streams break within the grace period."""
        deadline = time.monotonic() + self.loss_grace_s
        kept = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                kind, (worker, gen, item) = self.workers.events.get(timeout=left)
            except queue.Empty:
                break
            if kind == "ended" and self.workers.current(worker, gen):
                lost.setdefault(worker, f"event stream ended: {item}")
            else:
                kept.append((kind, (worker, gen, item)))
        for ev in kept:  # back in order, ahead of anything newer
            self.workers.events.put(ev)

    def _recover(self, lost: dict[str, str]) -> None:
        """Start a recovery of ``lost`` and run it until the lost slices run again."""
        assert self.settings is not None
        now = self.clock.monotonic()
        self._gather(lost)
        rec = RecoveryRecord(number=len(self.recoveries) + 1, lost={}, reasons=dict(lost), detected_at=time.time(),
                             detected_mono=now,
                             detection_s=max(now - self._last_heard.get(w, now) for w in lost))
        for m in self.machines:
            m.supersede(f"recovery {rec.number} started")
        parked = self.abort_drains(f"recovery {rec.number} started")
        self.recoveries.append(rec)
        frontier = {n.name: self.done_through(n.name) for n in self.graph.nodes}
        self._set_state(JobState.RECOVERING, recovery=rec.number, lost=sorted(lost))
        self.event("job.recovering", step=self.completed, recovery=rec.number, lost=lost)
        machine = Recovery(self, rec, lost, policy=self.settings.policy, budget=self.budget, clock=self.clock,
                           log=self.log, frontier=frontier, microbatches=self.spec.microbatches, hooks=self.hooks,
                           parked=parked)
        self.machines.append(machine)
        machine.run_to_replay()

    def restored(self, recovery: Recovery) -> None:
        rec = recovery.record
        rec.generations = dict(self.workers.generation)
        self._set_state(JobState.RUNNING, recovery=rec.number)
        assert self.watchdog is not None
        self.watchdog.progressed()
        self.event("job.recovered", step=self.completed, **rec.to_json(),
                   placement={s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                              for s, p in self.placement.items()})
        self.log.info("recovery.restored", **rec.to_json())
        self._warm_soon(f"recovery {rec.number}")
        self._grant()

    # -- warm spares ----------------------------------------------------------------------

    def _warm_soon(self, reason: str) -> None:
        if self.warmer is not None:
            self.warmer.soon(reason, self.completed)

    def _warm_check(self) -> None:
        """Plan the warm spares again when :meth:`SpareWarmer.due` says so."""
        recovering = any(not m.phase.is_terminal for m in self.machines)
        reason = self.warmer.due(self.clock.monotonic(), self.completed, recovering) if self.warmer else None
        if reason is None:
            return
        try:
            snap = read_cluster(self.store, self.keys)
        except StoreError as exc:
            self.log.warning("job.warm_unplanned", error=str(exc))
            return
        assert self.warmer is not None
        self.warmer.refresh(snap, reason, exclude=frozenset(self.workers.workers))

    # -- the whole run ----------------------------------------------------------------------

    def begin(self) -> None:
        """PLACING -> LOADING -> RUNNING: place, load (from the newest cut when resuming or adopting), grant."""
        self._t0 = self.clock.monotonic()
        self._prepare()
        self._set_state(JobState.PLACING, adopted=self.adopted, resumed=self.resume)
        try:
            self._place()
        finally:
            self._withdraw_yields()
        self._set_state(JobState.LOADING)
        lost = self._load_all_from_cut() if self.resume else self._lost_at_load(self.load(None, 0, {}), 0)
        self._set_state(JobState.RUNNING)
        self._warm_soon("placed")
        self.granted = min(self.completed + max(1, self.spec.window), self.spec.steps)
        if lost:  # workers lost while the job was loading: an ordinary recovery moves their slices
            self._recover(lost)
        else:
            self._grant()

    def finish(self) -> pb.JobEvent:
        """FINISHING: fetch the final state; the ``job.finished`` event (sent by :meth:`run`)."""
        self._set_state(JobState.FINISHING)
        try:
            states = self.workers.fetch()
        except WorkerCallFailed as exc:
            raise JobFailed(f"could not fetch the final state: {exc}") from None
        for m in self.machines:
            m.supersede("the job ended")
        self.abort_drains("the job ended")
        trees = {s.name: s.treedef for s in self.spec.states}
        detail = {"wall_s": round(self.clock.monotonic() - self._t0, 3), "state_digest": flat_state_digest(states, trees),
                  "start_step": self.start, "adopted": self.adopted, **self.summary()}
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
            while self.completed < self.spec.steps:
                self.step()
            terminal = self.finish()
            final = JobState.SUCCEEDED
        except (HandedOff, NotLeader) as exc:
            reason = f"{exc}; the next leader adopts the job"
            self.log.warning("job.handed_off", reason=reason, step=self.completed)
            terminal = pb.JobEvent(job=self.spec.job, event="job.handed_off", step=self.completed,
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
                self._set_state(final, **({"reason": reason} if reason and final is JobState.FAILED else {}))
            except (StoreError, NotLeader) as exc:
                self.log.warning("job.record_failed", error=str(exc))
            self.emit(terminal)
        return final

    def summary(self) -> dict[str, Any]:
        """Failures, recoveries and replay counts, as ``job.finished`` reports them."""
        return {"failures": self.failures, "recoveries": [r.to_json() for r in self.recoveries],
                "replayed_instances": dict(sorted(self.replayed.items())), "redone_s": round(self.redone_s, 4),
                "compute_s": {n: round(v, 4) for n, v in sorted(self.compute_s.items())},
                "corrupt_checkpoints": self.corrupt, "drains": [d.to_json() for d in self.drain_records],
                "resharded": self.resharded, "exact": not self.resharded,
                **({"tolerance": RESHARD_TOLERANCE} if self.resharded else {}), "stalls": self.watchdog.stalls if self.watchdog else 0,
                "output_log_peak": self.log_peak, "stragglers": self.stragglers.decisions}

    def _cleanup(self) -> None:
        """Release what the job holds, whatever ended it; a term that is over releases nothing in etcd."""
        try:
            self.workers.close()
        except Exception as exc:  # closing must not hide why the run ended
            self.log.warning("job.close_failed", error=repr(exc))
        if self.writer.over:
            return  # the next leader releases what this term held (and plans the warm spares again)
        if self.warmer is not None:
            self.warmer.release()  # best effort, bounded: the spares drop what they hold for the job
        try:
            self.leases().release(self.spec.job)
        except (StoreError, AllocationError, NotLeader) as exc:
            self.log.warning("job.release_failed", error=str(exc))

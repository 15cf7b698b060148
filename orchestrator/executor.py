"""The graph executor: runs one job on the cluster, from the leader, through host losses.

It places every virtual slice on a worker's devices (device leases, fenced on the
leader's term), records the placement in etcd, loads each worker with the exported
programs of its slices and its routes, and then only **grants steps**: workers run
instances as their inputs arrive and push outputs straight to each other, and a
bounded window of steps is in flight. The executor hears completions (and scalar
metrics, and checkpoint commits), never tensors, until it fetches the final state.

Recovery (docs/recovery.md). When a worker's event stream breaks, or its etcd
registration is gone, the executor fences it (revokes its lease), moves its slices
to spare devices (:func:`rallypoint.recovery.remap.plan_remap`), and asks the replay planner
(:func:`rallypoint.recovery.replay.plan_replay`) what re-runs from the newest consistent cut
``c``. Under ``partial`` the moved slices load their checkpoint at ``c`` and re-run
from there, and every surviving worker is rewired: its routes point at the new
places and its output log sends the replaying nodes their inputs of steps ``>= c``
again; nothing else re-runs. Under ``restart-all`` (and when a partial plan would
need a survivor to re-run, e.g. after falling back past a corrupt checkpoint) every
slice reloads from ``c``. A failure during a recovery joins it.

Lifecycle (one state machine, every transition through ``_set_state``)::

    PLACING -> LOADING -> RUNNING <-> RECOVERING, RUNNING -> FINISHING -> SUCCEEDED
        \\_________\\___________\\__________\\____-> FAILED (with a reason)
"""

from __future__ import annotations

import enum
import json
import queue
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from rallypoint.etcd.clock import SYSTEM_CLOCK, Clock
from rallypoint.etcd.commits import CheckpointCommit, consistent_cut, read_commit_records, read_commits
from rallypoint.orchestrator.devices import DeviceLeases, fence_worker
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.orchestrator.election import LeaderElection
from rallypoint.etcd.errors import AllocationError, NotLeader, RallypointError, StoreError
from rallypoint.orchestrator.job_recovery import RecoveryRecord, RecoverySettings
from rallypoint.orchestrator.job_workers import JobWorkers, WorkerCallFailed
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.logs import get_logger
from rallypoint.orchestrator.placement import SlicePlace, instances_per_step, load_requests
from rallypoint.etcd.store import Delete, Put, Store
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto.digest import flat_state_digest
from rallypoint.recovery.remap import Fail, Remap, RemapPolicy, Wait, plan_remap
from rallypoint.recovery.replay import Graph

LOSS_GRACE_S = 0.2  # after one loss, how long to gather others that happened with it
ETCD_OUTAGE_S = 600.0  # how long the job waits for etcd (its quorum) before it fails
ETCD_CHECK_S = 1.0  # how often registrations are checked (a hung worker's stream stays open)
MAX_RECOVERY_ATTEMPTS = 10
JOBSPEC_FILE = "jobspec.pb"
LATEST_FILE = "LATEST"

T = TypeVar("T")


class JobState(enum.Enum):
    PLACING = "placing"
    LOADING = "loading"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


class JobFailed(RallypointError):
    """The job cannot go on; the message is the reason recorded and reported."""


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


class JobExecutor:
    """Runs one submitted (or resumed) job to its end; reports through ``emit``.

    Args:
        spec: the job, as the client submitted it (or as saved, to resume).
        store, keys: the coordination store and the cluster's key schema.
        election: the leader's election (its term fences every write).
        emit: receives each :class:`pb.JobEvent`.
        checkpoint_root: where runs keep checkpoints when the spec names no directory
            ("": the job runs without checkpoints; recovery then replays from step 0).
        resume: start every slice from the newest consistent cut of the job's last run.
    """

    def __init__(self, spec: pb.JobSpec, *, store: Store, keys: Keys, election: LeaderElection,
                 emit: Callable[[pb.JobEvent], None], clock: Clock = SYSTEM_CLOCK, checkpoint_root: str = "",
                 resume: bool = False) -> None:
        self.spec = spec
        self.store, self.keys, self.election, self.emit, self.clock = store, keys, election, emit, clock
        self.resume = resume
        self.state = JobState.PLACING
        self.placement: dict[str, SlicePlace] = {}
        self.term = election.term or 0
        root = spec.checkpoint_dir or checkpoint_root
        self.checkpoint_root = Path(root).absolute() if root else None
        self.run_dir: Path | None = None
        self.workers = JobWorkers(spec.job)
        self.graph = Graph.from_spec(spec)
        self.settings: RecoverySettings | None = None
        self.start = 0  # the step the current runtimes started from (resume)
        self.completed = 0  # steps 0 .. completed-1 are done everywhere
        self.granted = 0
        self.cut = 0  # newest consistent cut the workers were told of
        self._commits: dict[str, int] = {}
        self._ckpt_slices = sorted({s.slice for s in spec.states})
        self._done: dict[tuple[str, int], set[int]] = defaultdict(set)
        self._step_count: Counter[int] = Counter()
        self._metrics: dict[int, list[tuple[str, int, float]]] = defaultdict(list)
        self._ungranted: set[str] = set()
        self._last_heard: dict[str, float] = {}
        self.failures: list[dict[str, Any]] = []
        self.recoveries: list[RecoveryRecord] = []
        self.replayed: Counter[str] = Counter()
        self.redone_s = 0.0
        self.corrupt: list[dict[str, Any]] = []  # checkpoints that did not restore (their commits dropped)
        self.compute_s: Counter[str] = Counter()  # per node, device-seconds of first runs
        self.log_peak = {"memory_bytes": 0, "spilled_bytes": 0}
        self._mb = {n.name: (spec.microbatches if n.per_microbatch else 1) for n in spec.nodes}
        self.log = get_logger("rallypoint.executor", cluster=keys.cluster, job=spec.job, term=self.term)

    # -- state ----------------------------------------------------------------------

    def _set_state(self, new: JobState, **fields: Any) -> None:
        old, self.state = self.state, new
        self.log.info("job.state", previous=old.value, state=new.value, **fields)
        self._record(**fields)

    def _record(self, **fields: Any) -> None:
        record = {
            "job": self.spec.job, "state": self.state.value, "steps": self.spec.steps, "step_done": self.completed,
            "term": self.term, "run_dir": str(self.run_dir or ""), "cut": self.cut,
            "policy": self.settings.policy if self.settings else "",
            "placement": {s: {"worker": p.worker, "devices": list(p.devices)} for s, p in self.placement.items()},
            "failures": self.failures, "recoveries": [r.to_json() for r in self.recoveries],
            "replayed_instances": dict(self.replayed), "at": time.time(), **fields,
        }
        self.election.fenced_txn([], [Put(self.keys.job(self.spec.job), json.dumps(record))])

    def _record_quietly(self) -> None:
        """Record progress, unless etcd is away (the next record catches up)."""
        try:
            self._record()
        except (StoreError, NotLeader) as exc:
            self.log.warning("job.record_failed", error=str(exc))

    def _event(self, event: str, step: int = 0, **detail: Any) -> None:
        self.emit(pb.JobEvent(job=self.spec.job, event=event, step=step, detail=json.dumps(detail)))

    # -- start ------------------------------------------------------------------------

    def _prepare(self) -> None:
        try:
            self.settings = RecoverySettings.from_spec(self.spec)
        except ValueError as exc:
            raise JobFailed(str(exc)) from None
        if self.resume:
            self._take_over()
            return
        # A new run: commits of an earlier run of this job name no longer count.
        self.election.fenced_txn([], [Delete(self.keys.checkpoints(self.spec.job), prefix=True)])
        if self.checkpoint_root is not None:
            self.run_dir = run_dir(self.checkpoint_root, self.spec.job, create=True)
            (self.run_dir / JOBSPEC_FILE).write_bytes(self.spec.SerializeToString())

    def _take_over(self) -> None:
        """Resume after a lost leader: what its executor left (device leases, loaded runtimes) goes first."""
        DeviceLeases(self.store, self.keys, fenced_txn=self.election.fenced_txn, term=self.term).release(self.spec.job)
        snap = read_cluster(self.store, self.keys)
        for w, ws in snap.workers.items():
            self.workers.unload_stale(w, ws.info.address, pb.Identity(cluster=self.keys.cluster, worker_id=w,
                                                                      incarnation=ws.info.incarnation, term=self.term))

    def _place(self) -> None:
        leases = DeviceLeases(self.store, self.keys, fenced_txn=self.election.fenced_txn, term=self.term)
        for s in self.spec.slices:
            p = leases.allocate(self.spec.job, s.slice, self._devices(s.slice))
            self.placement[s.slice] = SlicePlace(p.worker, "", p.incarnation, p.devices)
        snap = read_cluster(self.store, self.keys)
        for name, p in self.placement.items():
            w = snap.workers.get(p.worker)
            if w is None or w.info.incarnation != p.incarnation:
                raise JobFailed(f"worker {p.worker} holding slice {name!r} was lost while the job was being placed")
            self.placement[name] = SlicePlace(p.worker, w.info.address, p.incarnation, p.devices, w.info.data_address)
        self._event("job.placed", **{s: {"worker": p.worker, "incarnation": p.incarnation, "devices": list(p.devices)}
                                     for s, p in self.placement.items()})

    def _devices(self, slice_name: str) -> int:
        s = next(s for s in self.spec.slices if s.slice == slice_name)
        return int(np.prod(s.mesh_shape)) if len(s.mesh_shape) else 1

    def requests(self, workers: set[str] | None, start: int, commits: Mapping[str, list[CheckpointCommit]]) -> dict[str, pb.LoadJobRequest]:
        """Load requests (of ``workers``, or all) that start from the cut at ``start`` with the given commits."""
        assert self.settings is not None
        reqs = load_requests(self.spec, self.placement, cluster=self.keys.cluster, term=self.term)
        for w, req in reqs.items():
            req.checkpoint_every = self.settings.checkpoint_every
            req.checkpoint_dir = str(self.run_dir or "")
            req.keep_checkpoints = self.settings.keep_checkpoints
            req.log_limit_bytes = self.settings.log_limit_bytes
            req.start_step = start
            for sa in req.slices:
                for c in commits.get(sa.slice, ()):
                    ref = pb.CheckpointRef(slice=c.slice_name, step=c.step, path=c.path, checksum=c.checksum)
                    if c.step == start:
                        req.restore.append(ref)
                    elif c.step > start:
                        req.committed.append(ref)
        return {w: r for w, r in reqs.items() if workers is None or w in workers}

    def load(self, workers: set[str] | None, start: int, commits: Mapping[str, list[CheckpointCommit]], *,
             start_override: int | None = None) -> dict[str, WorkerCallFailed]:
        reqs = self.requests(workers, start, commits)
        if start_override is not None:  # only the chaos suite's deliberately broken recovery
            for req in reqs.values():
                req.start_step = start_override
        addresses = {p.worker: p.address for p in self.placement.values()}
        now = self.clock.monotonic()
        for w in reqs:
            self._last_heard[w] = now
        return self.workers.load(reqs, addresses)

    def commits(self) -> dict[str, list[CheckpointCommit]]:
        """The commits of this run: etcd's, or (etcd lost them: a new cluster) the copies beside the checkpoints."""
        commits = read_commits(self.store, self.keys, self.spec.job)
        if not commits and self.resume and self.run_dir is not None:
            commits = read_commit_records(self.run_dir)
        return commits

    def cut_step(self, commits: Mapping[str, list[CheckpointCommit]], before: int | None) -> int:
        """The newest step every slice with states committed (below ``before``); 0: the inits."""
        if not self._ckpt_slices:
            return 0
        return consistent_cut(commits, self._ckpt_slices, before=before) or 0

    def _load_all_from_cut(self) -> None:
        """Resume: every slice from the newest consistent cut that restores."""
        assert self.checkpoint_root is not None
        self.run_dir = run_dir(self.checkpoint_root, self.spec.job, create=False)
        commits, before = self.commits(), None
        while True:
            c = self.cut_step(commits, before)
            failed = self.load(None, c, commits)
            if not failed:
                break
            for w in self.workers.workers:
                self.workers.unload(w)
                self.workers.drop(w)
            corrupt = [f for f in failed.values() if f.code == grpc.StatusCode.DATA_LOSS]
            if not corrupt or c == 0:
                raise JobFailed("; ".join(str(f) for f in failed.values()))
            self.log.warning("resume.corrupt_checkpoint", step=c, error=str(corrupt[0]))
            from rallypoint.orchestrator.recovery_controller import RecoveryController

            RecoveryController(self)._drop_commit(str(corrupt[0]))
            before = c
        self.start = self.completed = self.cut = c
        self._event("job.resumed", step=c, checkpoint_step=c)

    # -- running ------------------------------------------------------------------------

    def _grant(self, workers: list[str] | None = None) -> None:
        """Grant every worker (or ``workers``) the current window and cut.

        Asynchronous: failures come back as ``grant_failed`` events (``_grant_failed``).
        """
        self.workers.grant(self.granted, self.cut, workers)

    def _grant_failed(self, worker: str, failure: WorkerCallFailed) -> None:
        """A refused worker is granted again later (``_ungranted``); one that refuses
        connections is lost; one that does not answer in time (hung, partitioned) is
        lost once its etcd registration is gone, which the periodic check sees."""
        if failure.code == grpc.StatusCode.UNAVAILABLE:
            self._recover({worker: str(failure)})
            return
        self._ungranted.add(worker)
        self.log.info("job.grant_refused", worker=worker, code=failure.code.name)

    def _hold_term(self) -> None:
        """Return while this executor's term holds; wait out an etcd outage; fail if the term is gone.

        A leader whose lease deadline passed (etcd unreachable, or its quorum lost) is
        not deposed yet: if etcd answers before the lease expires, the coordinator takes
        the same term again and the job goes on where it was.
        """
        try:
            self.election.check()
            return
        except NotLeader as exc:
            reason = exc.reason
        self.log.warning("job.paused", reason=reason)
        deadline = self.clock.monotonic() + ETCD_OUTAGE_S
        while self.clock.monotonic() < deadline:
            keeper = self.election.keeper
            if self.election.term not in (None, self.term) or keeper is None or keeper.fence.dead:
                raise JobFailed(f"the coordinator lost its leadership (term {self.term}): {reason}; "
                                f"resume the job with `rallypoint resume {self.spec.job}`")
            if self.election.term == self.term and self.election.is_leader:
                self.log.info("job.unpaused", paused_for=reason)
                self._grant()
                return
            self.clock.sleep(0.25)
        raise JobFailed(f"etcd stayed unreachable for {ETCD_OUTAGE_S:.0f}s ({reason}); resume the job with "
                        f"`rallypoint resume {self.spec.job}` once it is back")

    def _run_steps(self) -> None:
        steps, window = self.spec.steps, max(1, self.spec.window)
        self.granted = min(self.completed + window, steps)
        self._grant()
        checked = self.clock.monotonic()
        while self.completed < steps:
            self._hold_term()
            if self.clock.monotonic() - checked >= ETCD_CHECK_S:
                checked = self.clock.monotonic()
                lost = self._lost_in_etcd()
                if lost:
                    self._recover(lost)
                elif self._ungranted:
                    retry, self._ungranted = sorted(self._ungranted & set(self.workers.workers)), set()
                    self._grant(retry)
            try:
                kind, (worker, gen, item) = self.workers.events.get(timeout=0.25)
            except queue.Empty:
                continue
            if not self.workers.current(worker, gen):
                continue  # a runtime given up on
            if kind == "grant_failed":
                self._grant_failed(worker, item)
                continue
            self._last_heard[worker] = self.clock.monotonic()
            if kind == "ended":
                self._recover({worker: f"event stream ended: {item}"})
                continue
            if item.checkpoint_slice:
                self._on_commit(item.checkpoint_slice, int(item.checkpoint_step))
                continue
            if item.error:
                where = f"node {item.node!r} failed at step {item.step}" if item.node else "the job failed"
                raise JobFailed(f"{where} on worker {worker}: {item.error}")
            self.log_peak["memory_bytes"] = max(self.log_peak["memory_bytes"], int(item.log_bytes))
            self.log_peak["spilled_bytes"] = max(self.log_peak["spilled_bytes"], int(item.log_spilled_bytes))
            self._count(worker, gen, item)
            self._advance()

    def _count(self, worker: str, gen: int, item: pb.InstanceDone) -> None:
        step, node = int(item.step), item.node
        for r in self.recoveries:
            r.observe(worker, gen, node, step, r.checkpoint_step)
        if step < self.completed or item.microbatch in self._done[(node, step)]:
            self.replayed[node] += 1
            self.redone_s += item.compute_s
            return
        self._done[(node, step)].add(item.microbatch)
        self._step_count[step] += 1
        self.compute_s[node] += item.compute_s
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
            for n in self.spec.nodes:
                self._done.pop((n.name, s), None)
            del self._step_count[s]
            self.completed += 1
            if self.completed % 10 == 0:
                self._record_quietly()
        self._track_catch_up()
        if self.completed + window > self.granted and self.granted < steps:
            self.granted = min(self.completed + window, steps)
            self._grant()

    def until_etcd(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while etcd is unreachable (up to ``ETCD_OUTAGE_S``) and the term holds."""
        deadline = self.clock.monotonic() + ETCD_OUTAGE_S
        while True:
            try:
                return fn()
            except StoreError as exc:
                if self.clock.monotonic() > deadline:
                    raise JobFailed(f"{what}: etcd stayed unreachable for {ETCD_OUTAGE_S:.0f}s ({exc})") from None
                self.log.warning("job.waiting_for_etcd", what=what, error=str(exc))
                self.clock.sleep(0.5)
                self._hold_term()

    def _on_commit(self, slice_name: str, step: int) -> None:
        self._commits[slice_name] = max(step, self._commits.get(slice_name, 0))
        cut = min((self._commits.get(s, 0) for s in self._ckpt_slices), default=0)
        if cut > self.cut:
            self.cut = cut
            self.log.info("job.cut", step=cut)
            self._grant()

    def done_through(self, node: str) -> int:
        """Every instance of ``node`` at steps below this has been reported done."""
        n = self.graph.node(node)
        s = self.completed
        while s < self.spec.steps:
            if s % n.every == 0 and len(self._done.get((node, s), ())) < self._mb[node]:
                return s
            s += 1
        return self.spec.steps

    def _lost_in_etcd(self) -> dict[str, str]:
        """Workers of the job whose registration (that incarnation) is gone from etcd."""
        lost = {}
        for w in self.workers.workers:
            try:
                kv = self.store.get(self.keys.worker(w))
            except StoreError:
                return {}  # etcd is away: nobody is declared lost because of that
            if kv is None or kv.create_revision != self.workers.identity[w].incarnation:
                lost[w] = "its etcd registration is gone (lease expired or fenced)"
        return lost

    def _track_catch_up(self) -> None:
        for r in self.recoveries:
            if "replay" in r.marks and not r.done and all(self.done_through(n) >= s for n, s in r.frontier.items()):
                r.mark("catch_up")
                self.log.info("recovery.caught_up", recovery=r.number, phases=r.phases())
                self._record_quietly()

    # -- recovery ---------------------------------------------------------------------------

    def _recover(self, lost: dict[str, str]) -> None:
        from rallypoint.orchestrator.recovery_controller import RecoveryController

        RecoveryController(self).recover(lost)

    # -- the whole run ----------------------------------------------------------------------

    def run(self) -> JobState:
        """Run the job to its end. Never raises: a failure is a ``job.failed`` event and state.

        The terminal event goes out last, after the devices are released and the final
        state is recorded in etcd, so a client that sees it sees a settled cluster.
        """
        t0 = self.clock.monotonic()
        terminal: pb.JobEvent
        try:
            self._set_state(JobState.PLACING)
            self._prepare()
            self._place()
            self._set_state(JobState.LOADING)
            if self.resume:
                self._load_all_from_cut()
            else:
                failed = self.load(None, 0, {})
                if failed:
                    raise JobFailed(f"worker {next(iter(failed))} could not load the job: {next(iter(failed.values()))}")
            self._set_state(JobState.RUNNING)
            self._run_steps()
            self._set_state(JobState.FINISHING)
            try:
                states = self.workers.fetch()
            except WorkerCallFailed as exc:
                raise JobFailed(f"could not fetch the final state: {exc}") from None
            for r in self.recoveries:
                for p in ("replay", "catch_up"):
                    if p not in r.marks:
                        r.mark(p)  # the job ended first
            wall = self.clock.monotonic() - t0
            trees = {s.name: s.treedef for s in self.spec.states}
            detail = {"wall_s": round(wall, 3), "state_digest": flat_state_digest(states, trees),
                      "start_step": self.start, **self.summary()}
            terminal = pb.JobEvent(job=self.spec.job, event="job.finished", step=self.spec.steps, states=states,
                                   detail=json.dumps(detail))
            final, reason = JobState.SUCCEEDED, ""
        except (RallypointError, grpc.RpcError) as exc:
            reason = str(exc) if isinstance(exc, RallypointError) else f"{exc.code().name} {exc.details()}"
            self.log.error("job.failed", reason=reason)
            terminal = pb.JobEvent(job=self.spec.job, event="job.failed",
                                   detail=json.dumps({"reason": reason, **self.summary()}))
            final = JobState.FAILED
        self._cleanup()
        try:
            self._set_state(final, **({"reason": reason} if reason else {}))
        except (StoreError, NotLeader) as exc:
            self.log.warning("job.record_failed", error=str(exc))
        self.emit(terminal)
        return final

    def summary(self) -> dict[str, Any]:
        """Failures, recoveries and replay counts, as ``job.finished`` reports them."""
        return {"failures": self.failures, "recoveries": [r.to_json() for r in self.recoveries],
                "replayed_instances": dict(sorted(self.replayed.items())), "redone_s": round(self.redone_s, 4),
                "compute_s": {n: round(v, 4) for n, v in sorted(self.compute_s.items())},
                "corrupt_checkpoints": self.corrupt,
                "output_log_peak": self.log_peak}

    def _cleanup(self) -> None:
        self.workers.close()
        try:
            DeviceLeases(self.store, self.keys, fenced_txn=self.election.fenced_txn, term=self.term).release(self.spec.job)
        except (StoreError, AllocationError, NotLeader) as exc:
            self.log.warning("job.release_failed", error=str(exc))

    # used by the recovery controller
    def fence(self, worker: str, incarnation: int) -> None:
        fence_worker(self.store, self.keys, self.election.fenced_txn, worker, incarnation)

    def remap(self, need: Mapping[str, int], exclude: frozenset[str], record: RecoveryRecord) -> dict[str, SlicePlace]:
        """Lease spare devices for each lost slice per the job's policy (waits, or fails the job)."""
        assert self.settings is not None
        policy = RemapPolicy(on_no_spare=self.settings.on_no_spare, wait_timeout_s=self.settings.wait_timeout_s)
        leases = DeviceLeases(self.store, self.keys, fenced_txn=self.election.fenced_txn, term=self.term)
        placed: dict[str, SlicePlace] = {}
        t0, told = self.clock.monotonic(), False
        while True:
            self.election.check()
            todo = {s: n for s, n in need.items() if s not in placed}
            if not todo:
                return placed
            snap = read_cluster(self.store, self.keys)
            decision = plan_remap(snap, todo, policy, exclude=exclude, waited_s=self.clock.monotonic() - t0)
            if isinstance(decision, Remap):
                for a in decision.assignments:
                    p = leases.lease(self.spec.job, a.slice, a.worker, a.devices)
                    if p is not None:
                        info = snap.workers[a.worker].info
                        placed[a.slice] = SlicePlace(a.worker, info.address, p.incarnation, p.devices, info.data_address)
                continue
            if isinstance(decision, Wait):
                if not told:
                    told = True
                    self.log.warning("recovery.waiting", missing=dict(decision.missing), timeout_s=decision.timeout_s)
                    self._event("job.waiting", recovery=record.number, missing=dict(decision.missing),
                                timeout_s=decision.timeout_s,
                                reason=f"no spare for {sorted(decision.missing)}: waiting up to {decision.timeout_s:g}s "
                                       "for a worker with room to join")
                self.clock.sleep(0.25)
                continue
            if isinstance(decision, Fail):
                raise JobFailed(decision.reason)
            raise JobFailed(f"remap decided {type(decision).__name__}, which this executor does not carry out")

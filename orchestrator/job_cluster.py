"""A job's hold on the cluster: its placement, device leases, runtimes, commits, all under one term.

:class:`JobCluster` is what the executor (``executor.py``) stands on and what a
recovery (``recovery_machine.py``) acts through: it implements
:class:`~rallypoint.orchestrator.recovery_machine.RecoveryPort`. Every etcd write goes
through the executor's :class:`~rallypoint.orchestrator.election.TermWriter`, so only
the term that started the job writes for it; every etcd call rides out outages
(:meth:`JobCluster.until_etcd`, tenacity on the injected clock).
"""

from __future__ import annotations

import abc
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rallypoint.basics.clock import Clock
from rallypoint.etcd.cluster_view import ClusterSnapshot, read_cluster
from rallypoint.etcd.commits import CheckpointCommit, commit_record_path, consistent_cut, read_commit_records, \
    read_commits
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.basics.retry import retrying
from rallypoint.etcd.store import Delete, Put, Store
from rallypoint.basics.tls import tls_of
from rallypoint.orchestrator.devices import DeviceLeases, fence_worker
from rallypoint.orchestrator.election import LeaderElection, TermWriter
from rallypoint.orchestrator.failures import WorkerCallFailed
from rallypoint.orchestrator.job_recovery import RecoveryRecord, RecoverySettings
from rallypoint.orchestrator.job_state import JobFailed, JobState
from rallypoint.orchestrator.job_workers import JobWorkers
from rallypoint.orchestrator.placement import SlicePlace, device_counts, load_requests
from rallypoint.orchestrator.recovery_machine import Commits, RecoveryPort
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.remap import Assignment, Fail, Remap, RemapPolicy, Shrink, Wait, plan_remap
from rallypoint.recovery.replicas import plan_replicas, replica_sources
from rallypoint.recovery.replay import Graph, ReplayPlan

ETCD_OUTAGE_S = 600.0  # how long the job waits for etcd (its quorum) before it fails
REMAP_POLL_S = 0.25

T = TypeVar("T")


class JobCluster(RecoveryPort):
    """The cluster side of one job (see the module doc); the executor adds the lifecycle."""

    def __init__(self, spec: pb.JobSpec, *, store: Store, keys: Keys, election: LeaderElection, clock: Clock,
                 emit: Callable[[pb.JobEvent], None], log: Any) -> None:
        self.spec, self.store, self.keys, self.election, self.clock, self.emit = spec, store, keys, election, clock, emit
        self.log = log
        self.term = election.term or 0
        self.writer = TermWriter(election, self.term)  # this job writes under the term that started it, or not at all
        self.state = JobState.PLACING
        self.placement: dict[str, SlicePlace] = {}
        self.workers = JobWorkers(spec.job, tls_of(store))  # the coordinator's identity, as its store has it
        self.graph = Graph.from_spec(spec)
        self.settings: RecoverySettings | None = None
        self.run_dir: Path | None = None
        self.resume = False
        self.completed = 0  # steps 0 .. completed-1 are done everywhere
        self.granted = 0
        self.cut = 0  # newest consistent cut the workers were told of
        self.failures: list[dict[str, Any]] = []
        self.recoveries: list[RecoveryRecord] = []
        self.replayed: Counter[str] = Counter()
        self.corrupt: list[dict[str, Any]] = []  # checkpoints that did not restore (their commits dropped)
        self.device_counts = device_counts(spec)  # slice -> the device counts its programs were exported for
        self.resharded: list[dict[str, Any]] = []  # each change of a slice's device count (shrink, grow)
        self._done: dict[tuple[str, int], set[int]] = defaultdict(set)
        self._last_heard: dict[str, float] = {}
        self._ckpt_slices = sorted({s.slice for s in spec.states})
        self._mb = {n.name: (spec.microbatches if n.per_microbatch else 1) for n in spec.nodes}
        self.holders: dict[str, pb.ReplicaPeer] = {}  # slice -> where its commits are copied now (in-memory tier)
        self.restore_tiers: dict[str, str] = {}  # slice -> "memory" | "disk": what the last load restored from
        self.program_sources: dict[str, str] = {}  # node -> "warm" | "cold": what the last load found compiled

    # -- etcd ----------------------------------------------------------------------------

    @abc.abstractmethod
    def hold_term(self) -> None:
        """Return while this job's term holds (waiting out an etcd outage); raise
        :class:`~rallypoint.orchestrator.job_state.HandedOff` once it is over."""

    def until_etcd(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while etcd is unreachable (up to ``ETCD_OUTAGE_S``) and the term holds."""
        try:
            return retrying(clock=self.clock, what=what, log=self.log, retry_on=StoreError, stop_after_s=ETCD_OUTAGE_S,
                            initial_s=0.25, max_s=1.0, before_sleep=lambda _s: self.hold_term())(fn)
        except StoreError as exc:
            raise JobFailed(f"{what}: etcd stayed unreachable for {ETCD_OUTAGE_S:.0f}s ({exc})") from None

    def record(self, **fields: Any) -> None:
        """The job record in etcd (what a new leader adopts from), a fenced write of this term."""
        record = {
            "job": self.spec.job, "state": self.state.value, "steps": self.spec.steps, "step_done": self.completed,
            "term": self.term, "run_dir": str(self.run_dir or ""), "cut": self.cut,
            "policy": self.settings.policy if self.settings else "", "priority": self.spec.priority,
            "placement": {s: {"worker": p.worker, "devices": list(p.devices)} for s, p in self.placement.items()},
            "failures": self.failures, "recoveries": [r.to_json() for r in self.recoveries],
            "replayed_instances": dict(self.replayed), "resharded": self.resharded, "at": time.time(), **fields,
        }
        self.writer.txn([], [Put(self.keys.job(self.spec.job), json.dumps(record))])

    def event(self, event: str, step: int = 0, **detail: Any) -> None:
        self.emit(pb.JobEvent(job=self.spec.job, event=event, step=step, detail=json.dumps(detail)))

    def leases(self) -> DeviceLeases:
        return DeviceLeases(self.store, self.keys, fenced_txn=self.writer.txn, term=self.term)

    # -- loading ---------------------------------------------------------------------------

    def devices_of(self, slice_name: str) -> int:
        s = next(s for s in self.spec.slices if s.slice == slice_name)
        return int(np.prod(s.mesh_shape)) if len(s.mesh_shape) else 1

    def requests(self, workers: set[str] | None, start: int, commits: Commits) -> dict[str, pb.LoadJobRequest]:
        """Load requests (of ``workers``, or all) that start from the cut at ``start`` with the given commits."""
        assert self.settings is not None
        reqs = load_requests(self.spec, self.placement, cluster=self.keys.cluster, term=self.term)
        targets, sources = self.replica_plan(start > 0)
        for w, req in reqs.items():
            req.replica_targets.extend(targets[sa.slice] for sa in req.slices if sa.slice in targets)
            req.replica_sources.extend(p for sa in req.slices for p in sources.get(sa.slice, ()))
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

    def load(self, workers: set[str] | None, start: int, commits: Commits, *,
             start_override: int | None = None) -> dict[str, WorkerCallFailed]:
        reqs = self.requests(workers, start, commits)
        if start_override is not None:  # only a deliberately broken recovery (ExecutorHooks.skip_replay)
            for req in reqs.values():
                req.start_step = start_override
        addresses = {p.worker: p.address for p in self.placement.values()}
        now = self.clock.monotonic()
        for w in reqs:
            self._last_heard[w] = now
        failed = self.workers.load(reqs, addresses)
        self.restore_tiers = dict(self.workers.restore_tiers)
        self.program_sources = dict(self.workers.program_sources)
        for w, req in reqs.items():
            if w not in failed:
                self.holders.update({t.slice: t for t in req.replica_targets})
        return failed

    def replica_plan(self, restoring: bool) -> tuple[dict[str, pb.ReplicaPeer], dict[str, list[pb.ReplicaPeer]]]:
        """The in-memory checkpoint tier (``recovery.replicas``): where each slice's commits are
        copied, and (``restoring``) where copies of the commits it restores may be: the holder
        in force when they were made, then the new one, if registered. etcd is read only when
        needed (a one-worker job's spares, a restore's live holders); unreachable: no copies."""
        peers = {p.worker: pb.ReplicaPeer(worker_id=p.worker, address=p.address, incarnation=p.incarnation)
                 for p in self.placement.values()}
        snap = None
        if restoring or len(peers) == 1:
            try:
                snap = read_cluster(self.store, self.keys)
            except StoreError as exc:
                self.log.warning("replicas.unplanned", error=str(exc))
        spares = snap.spares if snap is not None else []
        if snap is not None:
            for w in spares:
                info = snap.workers[w].info
                peers[w] = pb.ReplicaPeer(worker_id=w, address=info.address, incarnation=info.incarnation)
        plan = plan_replicas({s: p.worker for s, p in self.placement.items()}, spares)
        targets = {s: pb.ReplicaPeer(slice=s, worker_id=h, address=peers[h].address, incarnation=peers[h].incarnation)
                   for s, h in plan.items()}
        if not restoring or snap is None:
            return targets, {}
        known = {(p.slice, p.worker_id): p for p in [*self.holders.values(), *targets.values()]}
        alive = {w for (_, w), p in known.items() if w in snap.workers and snap.workers[w].info.incarnation == p.incarnation}
        chosen = replica_sources({s: p.worker_id for s, p in self.holders.items()}, plan, list(self.placement), alive)
        return targets, {s: [known[(s, w)] for w in ws] for s, ws in chosen.items()}

    def loaded_workers(self) -> list[str]:
        return self.workers.workers

    def forget(self, worker: str) -> None:
        self.workers.drop(worker)

    def reset_all(self) -> None:
        self.log_floor = {}  # every runtime restarts from the cut
        for w in self.workers.workers:
            self.workers.unload(w)
            self.workers.drop(w)

    def rewire(self, worker: str, plan: ReplayPlan, cut: int, commits: Commits) -> None:
        reqs = self.requests(None, cut, commits)
        req = reqs.get(worker, pb.LoadJobRequest())
        r = self.workers.rewire(worker, req.routes, plan.nodes, cut, self.granted, req.replica_targets)
        self.holders.update({t.slice: t for t in req.replica_targets})
        self.log.info("recovery.rewired", worker=worker, resent=r.resent, log_from=r.log_from)

    # -- commits ------------------------------------------------------------------------------

    def commits(self) -> dict[str, list[CheckpointCommit]]:
        """The commits of this run: etcd's, or (etcd lost them: a new cluster) the copies beside the checkpoints."""
        def read() -> dict[str, list[CheckpointCommit]]:
            commits = read_commits(self.store, self.keys, self.spec.job)
            if not commits and self.resume and self.run_dir is not None:
                commits = read_commit_records(self.run_dir)
            return commits
        return self.until_etcd("reading checkpoint commits", read)

    def cut_step(self, commits: Commits, before: int | None) -> int:
        if not self._ckpt_slices:
            return 0
        return consistent_cut(commits, self._ckpt_slices, before=before) or 0

    def drop_commit(self, slice_name: str, step: int, error: str) -> None:
        self.until_etcd("dropping a corrupt commit", lambda: self.writer.txn(
            [], [Delete(self.keys.checkpoint(self.spec.job, slice_name, step))], []))
        if self.run_dir is not None:
            commit_record_path(self.run_dir, slice_name, step).unlink(missing_ok=True)
        self.corrupt.append({"slice": slice_name, "step": step, "error": error})
        self.log.warning("checkpoint.decommitted", slice=slice_name, step=step)

    # -- progress ------------------------------------------------------------------------------

    def done_through(self, node: str) -> int:
        """Every instance of ``node`` at steps below this has been reported done."""
        n = self.graph.node(node)
        s = self.completed
        while s < self.spec.steps:
            if s % n.every == 0 and len(self._done.get((node, s), ())) < self._mb[node]:
                return s
            s += 1
        return self.spec.steps

    # -- losses -----------------------------------------------------------------------------------

    def fence(self, worker: str, incarnation: int) -> None:
        self.until_etcd(f"fencing worker {worker}",
                        lambda: fence_worker(self.store, self.keys, self.writer.txn, worker, incarnation))

    def record_failure(self, worker: str, incarnation: int, slices: list[str], reason: str) -> None:
        if not any(f["worker"] == worker and f["incarnation"] == incarnation for f in self.failures):
            self.failures.append({"worker": worker, "incarnation": incarnation, "slices": slices, "at": time.time(),
                                  "step": self.completed, "reason": reason})

    def registered(self, worker: str) -> bool:
        incarnations = {p.incarnation for p in self.placement.values() if p.worker == worker}
        kv = self.until_etcd(f"reading worker {worker}", lambda: self.store.get(self.keys.worker(worker)))
        return kv is not None and kv.create_revision in incarnations

    def lost_in_etcd(self) -> dict[str, str]:
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

    def lease_assignment(self, snap: ClusterSnapshot, a: Assignment, leases: DeviceLeases,
                         placed: dict[str, SlicePlace]) -> bool:
        """Lease the devices the remap policy chose for one slice into ``placed``; False: another holder won them."""
        p = self.until_etcd("leasing spare devices", lambda: leases.lease(self.spec.job, a.slice, a.worker, a.devices))
        if p is None:
            return False
        info = snap.workers[a.worker].info
        placed[a.slice] = SlicePlace(a.worker, info.address, p.incarnation, p.devices, info.data_address)
        return True

    def release_on(self, worker: str, slices: Iterable[str], what: str) -> None:
        """Release the devices the job's ``slices`` hold on ``worker`` (etcd outages ridden out)."""
        leases = self.leases()
        for s in slices:
            self.until_etcd(what, lambda s=s: leases.release(self.spec.job, s, worker=worker))

    def remap(self, need: Mapping[str, int], exclude: frozenset[str], record: RecoveryRecord) -> dict[str, SlicePlace]:
        """Lease spare devices for each lost slice per the job's policy (waits, or fails the job)."""
        assert self.settings is not None
        policy = RemapPolicy(on_no_spare=self.settings.on_no_spare, wait_timeout_s=self.settings.wait_timeout_s)
        leases = self.leases()
        placed: dict[str, SlicePlace] = {}
        t0, told, waited_from = self.clock.monotonic(), False, 0.0
        while True:
            self.hold_term()
            todo = {s: n for s, n in need.items() if s not in placed}
            if not todo:
                if told:  # the seconds this remap waited for a spare (the goodput bucket waiting_for_spares)
                    record.spare_wait_s += self.clock.monotonic() - waited_from
                return placed
            snap = self.until_etcd("reading the cluster", lambda: read_cluster(self.store, self.keys))
            decision = plan_remap(snap, todo, policy, exclude=exclude, waited_s=self.clock.monotonic() - t0,
                                  allowed=self.device_counts)
            if isinstance(decision, Remap | Shrink):
                for a in decision.assignments:
                    if self.lease_assignment(snap, a, leases, placed) and a.shrunk:
                        self.resharded.append({"slice": a.slice, "from": a.needed, "to": len(a.devices),
                                               "why": f"recovery {record.number}: no spare with {a.needed} "
                                                      "devices (on_no_spare='shrink')", "at": time.time()})
                        self.log.warning("recovery.shrunk", slice=a.slice, devices=len(a.devices), had=a.needed)
                continue
            if isinstance(decision, Wait):
                if not told:
                    told, waited_from = True, self.clock.monotonic()
                    self.log.warning("recovery.waiting", missing=dict(decision.missing), timeout_s=decision.timeout_s)
                    self.event("job.waiting", recovery=record.number, missing=dict(decision.missing),
                               timeout_s=decision.timeout_s,
                               reason=f"no spare for {sorted(decision.missing)}: waiting up to {decision.timeout_s:g}s "
                                      "for a worker with room to join")
                self.clock.sleep(REMAP_POLL_S)
                continue
            if isinstance(decision, Fail):
                raise JobFailed(decision.reason)
            raise JobFailed(f"remap decided {type(decision).__name__}, which this executor does not carry out")

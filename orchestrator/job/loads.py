"""Loading a job's runtimes onto its workers, and rewiring the survivors after a move.

:class:`JobLoads` builds each worker's ``LoadJobRequest`` from the placement (programs,
routes, the cut to start from with its commits, checkpoint settings, where the in-memory
checkpoint tier copies each slice's commits) and sends it through
:class:`~rallypoint.orchestrator.job.workers.JobWorkers`. It owns what the loads tell:
``holders`` (slice -> the peer its commits are copied to now), ``restore_tiers`` (slice ->
``"memory"`` or ``"disk"``, what the last load restored from), ``program_sources``
(node -> ``"warm"`` or ``"cold"``) and ``last_heard`` (worker -> when it was last loaded or
heard from: a recovery's detection time starts there).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.basics.errors import StoreError
from rallypoint.etcd.cluster_view import ClusterSnapshot, read_cluster
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.recovery import JobSettings
from rallypoint.orchestrator.job.term import Commits, JobTerm
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.recovery.load_plan import SlicePlace, load_requests
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replicas import part_name, plan_replicas, replica_sources, with_parts
from rallypoint.recovery.skips import Skips

FLUSH_S = 30.0  # how long a worker being unloaded gets to deliver the pushes it had sent


class JobLoads:
    """Loads and rewires of one job's runtimes (see the module doc)."""

    def __init__(self, spec: pb.JobSpec, workers: JobWorkers, term: JobTerm, placement: Mapping[str, SlicePlace], *,
                 clock: Clock, log: Any, settings: JobSettings | None = None) -> None:
        self.spec, self.workers, self.term, self.placement, self.clock, self.log = \
            spec, workers, term, placement, clock, log
        self.settings = settings  # None: the spec's are not valid (the job fails before it loads)
        self.run_dir: Path | None = None  # where the run keeps its checkpoints (:meth:`open_run`)
        self.holders: dict[str, pb.ReplicaPeer] = {}
        self.owners: dict[str, pb.ReplicaPeer] = {}  # a multi-host slice's part -> the worker of its member then
        self.restore_tiers: dict[str, str] = {}
        self.program_sources: dict[str, str] = {}
        self.last_heard: dict[str, float] = {}
        self.skips = Skips()  # the stream positions the run skips: the job's rollbacks (job/rollback.py) set it

    def open_run(self, run_dir: Path | None) -> None:
        """The run's directory, once the executor has made or found it: the loads' checkpoint directory."""
        self.run_dir = run_dir

    @property
    def loaded(self) -> list[str]:
        """The workers whose runtimes the job uses now."""
        return self.workers.workers

    def heard(self, worker: str) -> None:
        self.last_heard[worker] = self.clock.monotonic()

    def requests(self, workers: set[str] | None, start: int, commits: Commits) -> dict[str, pb.LoadJobRequest]:
        """Load requests (of ``workers``, or all) that start from the cut at ``start`` with the given commits."""
        assert self.settings is not None
        reqs = load_requests(self.spec, self.placement, cluster=self.term.keys.cluster, term=self.term.term)
        targets, sources = self.replica_plan(start > 0)
        for req in reqs.values():
            names = [n for sa in req.slices
                     for n in [sa.slice, *(part_name(sa.slice, j) for j in range(len(sa.members)))]]
            req.replica_targets.extend(targets[n] for n in names if n in targets)
            req.replica_sources.extend(p for n in names for p in sources.get(n, ()))
            req.checkpoint_every = self.settings.checkpoint_every
            req.checkpoint_dir = str(self.run_dir or "")
            req.keep_checkpoints = self.settings.keep_checkpoints
            req.log_limit_bytes = self.settings.log_limit_bytes
            req.start_step = start
            req.code_sha256 = self.spec.code.sha256  # host sources: <checkpoint_dir>/code/<sha256>.zip
            self.skips.to_proto(req.skips)
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
        """Load ``workers`` (None: every worker of the placement) from the cut at ``start``; the failures by worker."""
        reqs = self.requests(workers, start, commits)
        if start_override is not None:  # only a deliberately broken recovery (ExecutorHooks.skip_replay)
            for req in reqs.values():
                req.start_step = start_override
        addresses = {p.worker: p.address for p in self.placement.values()}
        for w in reqs:
            self.heard(w)
        failed = self.workers.load(reqs, addresses)
        self.restore_tiers = dict(self.workers.restore_tiers)
        self.program_sources = dict(self.workers.program_sources)
        for w, req in reqs.items():
            if w not in failed:
                self.holders.update({t.slice: t for t in req.replica_targets})
                self.owners.update({part_name(sa.slice, j): pb.ReplicaPeer(
                    slice=part_name(sa.slice, j), worker_id=m.worker_id, address=m.address, incarnation=m.incarnation)
                    for sa in req.slices for j, m in enumerate(sa.members)})
        return failed

    def replica_plan(self, restoring: bool) -> tuple[dict[str, pb.ReplicaPeer], dict[str, list[pb.ReplicaPeer]]]:
        """The in-memory checkpoint tier (``recovery.replicas``): where each slice's commits are
        copied, and (``restoring``) where copies of the commits it restores may be: the holder
        in force when they were made, then the new one, if registered. etcd is read only when
        needed (a one-worker job's spares, a restore's live holders); unreachable: no copies."""
        peers = {p.worker: pb.ReplicaPeer(worker_id=p.worker, address=p.address, incarnation=p.incarnation)
                 for q in self.placement.values() for p in (q, *q.members)}
        snap = None
        if restoring or len(peers) == 1:
            try:
                snap = read_cluster(self.term.store, self.term.keys)
            except StoreError as exc:
                self.log.warning("replicas.unplanned", error=str(exc))
        spares = snap.spares if snap is not None else []
        if snap is not None:
            for w in spares:
                info = snap.workers[w].info
                peers[w] = pb.ReplicaPeer(worker_id=w, address=info.address, incarnation=info.incarnation)
        where = with_parts({s: p.worker for s, p in self.placement.items()},
                           {s: [m.worker for m in p.members] for s, p in self.placement.items() if p.members})
        plan = plan_replicas(where, spares)
        targets = {s: pb.ReplicaPeer(slice=s, worker_id=h, address=peers[h].address, incarnation=peers[h].incarnation)
                   for s, h in plan.items()}
        if not restoring or snap is None:
            return targets, {}
        known = {(p.slice, p.worker_id): p for p in [*self.holders.values(), *targets.values(), *self.owners.values()]}
        alive = {w for (_, w), p in known.items() if w in snap.workers and snap.workers[w].info.incarnation == p.incarnation}
        chosen = replica_sources({s: p.worker_id for s, p in self.holders.items()}, plan, list(where), alive)
        for part, owner in self.owners.items():  # a part's member's worker keeps a copy too (workers/gang/replicas.py)
            if part in where and owner.worker_id in alive and owner.worker_id not in chosen.get(part, []):
                chosen.setdefault(part, []).append(owner.worker_id)
        return targets, {s: [known[(s, w)] for w in ws] for s, ws in chosen.items()}

    def rewire(self, worker: str, nodes: list[str], cut: int, until: int, commits: Commits) -> pb.RewireResponse:
        """Point a survivor's routes at the new places; it resends its logged outputs of ``nodes`` from ``cut``.

        Raises :class:`WorkerCallFailed`."""
        answers, failed = self.rewire_all([worker], nodes, cut, {worker: until}, commits)
        if failed:
            raise failed[worker]
        return answers[worker]

    def rewire_all(self, workers: list[str], nodes: list[str], cut: int, until: Mapping[str, int],
                   commits: Commits) -> tuple[dict[str, pb.RewireResponse], dict[str, WorkerCallFailed]]:
        """:meth:`rewire` every survivor in ``workers`` at once (``until``: each one's grant); answers and failures."""
        reqs = self.requests(None, cut, commits)
        rewires = {w: self.workers.rewire_request(w, reqs.get(w, pb.LoadJobRequest()).routes, nodes, cut, until[w],
                                                  reqs.get(w, pb.LoadJobRequest()).replica_targets)
                   for w in workers}
        answers, failed = self.workers.rewire_all(rewires)
        for w in answers:
            self.holders.update({t.slice: t for t in rewires[w].replica_targets})
        return answers, failed

    def forget(self, worker: str) -> None:
        """Stop using the worker's runtime (its events are ignored from now on)."""
        self.workers.drop(worker)

    def unload(self, worker: str) -> None:
        """Unload the worker after its pushes on their way arrived, and forget it."""
        self.workers.unload(worker, flush_s=FLUSH_S)
        self.forget(worker)

    def unload_everywhere(self, snap: ClusterSnapshot, only: set[str] | None = None) -> None:
        """Resume or adopt: unload the job from every registered worker (a lost leader's runtimes), or from those
        of ``only``; best effort."""
        for w, ws in snap.workers.items():
            if only is not None and w not in only:
                continue
            self.workers.unload_stale(w, ws.info.address, pb.Identity(cluster=self.term.keys.cluster, worker_id=w,
                                                                      incarnation=ws.info.incarnation,
                                                                      term=self.term.term))

    def reset_all(self) -> None:
        """Unload and forget every runtime (restart-all reloads them all)."""
        for w in self.workers.workers:
            self.workers.unload(w)
            self.workers.drop(w)

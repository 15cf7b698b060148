"""The ports a job's recoveries and its straggler watch act through, over the job's collaborators.

:class:`JobRecoveryPort` is the :class:`~rallypoint.orchestrator.job.recovery_machine.RecoveryPort`
of a job: it carries each of the recovery machine's requests to the
collaborator that owns the fact: the placement (remap, the new places), the loads
(loads, rewires, unloads), the term (commits read, fencing, registrations). It moves
neither the cut nor the commits nor the log floor: a commit that does not restore is handed to
the executor's :class:`~rallypoint.orchestrator.job.cut.JobCut` (the one place commits are
dropped), so is a restart of every runtime (no output log starts past the cut), and on a restore the
executor asks :meth:`JobRecoveryPort.restore_point` for the cut the job restored from
(lower than before when a recovery fell back past a commit that did not restore) and
sets it. It owns only what recoveries find: ``failures`` (each lost worker incarnation)
and ``corrupt`` (each checkpoint that did not restore). The machine never sees the
executor; the executor hears of a restore through ``on_restored``.

:class:`JobStragglerPort` is the :class:`~rallypoint.orchestrator.job.stragglers.StragglerPort`
of a job: it reads the progress and the placement, cordons through the term and starts
drains through the job's drains.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from rallypoint.basics.errors import NotLeader, StoreError
from rallypoint.etcd.cluster_view import ClusterSnapshot, read_cluster
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.etcd.drains import DrainRequest
from rallypoint.etcd.records import Fields, skip_bad
from rallypoint.etcd.store import Delete, KeyValue, Put
from rallypoint.orchestrator.job.cut import JobCut
from rallypoint.orchestrator.job.drain import DrainRecord
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.drains import JobDrains
from rallypoint.orchestrator.job.loads import JobLoads
from rallypoint.orchestrator.job.placement import JobPlacement
from rallypoint.orchestrator.job.progress import JobProgress
from rallypoint.orchestrator.job.term import Commits, JobTerm
from rallypoint.recovery.load_plan import SlicePlace
from rallypoint.orchestrator.job.recovery_machine import Recovery, RecoveryPort, classify_setback
from rallypoint.orchestrator.job.stragglers import CORDON_BY
from rallypoint.recovery.decide import Budget, Fail, FallBack, Refence, Retry, Verdict, decide
from rallypoint.recovery.remap import NoRoom
from rallypoint.recovery.replay import Graph, ReplayPlan
from rallypoint.recovery.slices import stateful_slices
from rallypoint.recovery.stragglers import Probation


class JobRecoveryPort(RecoveryPort):
    """A job's :class:`RecoveryPort` (see the module doc)."""

    def __init__(self, graph: Graph, *, term: JobTerm, placement: JobPlacement, loads: JobLoads,
                 progress: JobProgress, on_restored: Callable[[Recovery], None], job_cut: JobCut) -> None:
        self.graph, self.term, self.places, self.loads, self.progress = graph, term, placement, loads, progress
        self.on_restored, self.job_cut = on_restored, job_cut
        self.failures: list[dict[str, Any]] = []
        self.corrupt: list[dict[str, Any]] = []  # checkpoints that did not restore (their commits dropped)

    # -- read-only views -------------------------------------------------------------------

    @property
    def placement(self) -> Mapping[str, SlicePlace]:  # type: ignore[override]
        return self.places.slices

    @property
    def cut(self) -> int:  # type: ignore[override]
        return self.progress.cut

    @property
    def log_floor(self) -> Mapping[str, int]:  # type: ignore[override]
        return self.progress.log_floor

    @property
    def restore_tiers(self) -> Mapping[str, str]:  # type: ignore[override]
        return self.loads.restore_tiers

    @property
    def program_sources(self) -> Mapping[str, str]:  # type: ignore[override]
        return self.loads.program_sources

    @property
    def generations(self) -> Mapping[str, int]:  # type: ignore[override]
        return MappingProxyType(self.loads.workers.generation)

    def loaded_workers(self) -> list[str]:
        return self.loads.loaded

    def done_through(self, node: str) -> int:
        return self.progress.done_through(node)

    def devices_of(self, slice_name: str) -> int:
        return self.places.devices_of(slice_name)

    # -- etcd ----------------------------------------------------------------------------------

    def fence(self, worker: str, incarnation: int) -> None:
        self.term.fence(worker, incarnation)

    def registered(self, worker: str) -> bool:
        return self.term.registered(worker, self.places.incarnations(worker))

    def commits(self) -> dict[str, list[CheckpointCommit]]:
        return self.term.commits()

    def cut_step(self, commits: Commits, before: int | None) -> int:
        # Nor past a step a slice without states has not reached: it restores nothing and starts from the cut.
        reached = self.progress.stateless_through + 1
        return self.term.cut_of(commits, stateful_slices(self.progress.spec),
                                reached if before is None else min(before, reached))

    def drop_commit(self, slice_name: str, step: int, error: str) -> None:
        self.job_cut.drop_commit(slice_name, step)  # the executor's mover drops it, in etcd and in the progress
        self.corrupt.append({"slice": slice_name, "step": step, "error": error})

    def record_failure(self, worker: str, incarnation: int, slices: list[str], reason: str) -> None:
        if not any(f["worker"] == worker and f["incarnation"] == incarnation for f in self.failures):
            self.failures.append({"worker": worker, "incarnation": incarnation, "slices": slices,
                                  "at": self.term.clock.wall(),
                                  "step": self.progress.completed, "reason": reason})

    # -- placement and runtimes ------------------------------------------------------------------

    def remap(self, need: Mapping[str, int], exclude: frozenset[str], recovery: int, *,
              lost: Mapping[str, int] = MappingProxyType({})) -> tuple[dict[str, SlicePlace], float] | NoRoom:
        return self.places.remap(need, exclude, recovery, lost=lost)

    def place(self, places: Mapping[str, SlicePlace]) -> None:
        self.places.apply(places)

    def unload(self, worker: str) -> bool:
        if worker not in self.loads.loaded:  # never loaded (its gang lost a member while the job was placed)
            if not self.registered(worker):
                return False
        elif not self.loads.workers.unload(worker):
            return False
        self.places.release_on(worker, self.places.on(worker), f"releasing the job's devices on worker {worker}")
        return True

    def forget(self, worker: str) -> None:
        self.loads.forget(worker)

    def load(self, workers: set[str] | None, start: int, commits: Commits, *,
             start_override: int | None = None) -> dict[str, WorkerCallFailed]:
        return self.loads.load(workers, start, commits, start_override=start_override)

    def rewire(self, worker: str, plan: ReplayPlan, cut: int, commits: Commits) -> None:
        r = self.loads.rewire(worker, sorted(plan.nodes), cut, self.progress.granted, commits)
        self.loads.log.info("recovery.rewired", worker=worker, resent=r.resent, log_from=r.log_from)

    def rewire_all(self, workers: list[str], plan: ReplayPlan, cut: int, commits: Commits) -> dict[str, WorkerCallFailed]:
        """Every survivor at once, each with a deadline that follows from the bytes it may resend."""
        answers, failed = self.loads.rewire_all(workers, sorted(plan.nodes), cut,
                                                {w: self.progress.granted for w in workers}, commits)
        for w, r in answers.items():
            self.loads.log.info("recovery.rewired", worker=w, resent=r.resent, log_from=r.log_from)
        return failed

    def reset_all(self) -> None:
        self.job_cut.reset_logs()  # every runtime restarts from the cut: the executor's mover lowers the log floor
        self.loads.reset_all()

    def load_newest_cut(self, budget: Budget, workers: set[str] | None = None
                        ) -> tuple[int, dict[str, list[int]], dict[str, WorkerCallFailed]] | Fail:
        """Resume or adopt: load every slice (of ``workers``, default all: not those lost while the job was
        placed) from the newest consistent cut that restores, falling back past one that does not (its commit
        dropped) within ``budget``. Returns the cut, the commits that count (slice -> steps) and the workers that
        failed to load for another reason (a recovery moves the lost ones); or, when no cut restores,
        :class:`Fail` (the executor fails the job)."""
        commits, before, corrupt_count = self.term.commits(), None, 0
        while True:
            c = self.cut_step(commits, before)
            failed = self._reload_refused(self.loads.load(workers, c, commits), c, commits, budget)
            if not any(f.verdict is Verdict.CORRUPT for f in failed.values()):
                return c, {s: [x.step for x in cs if before is None or x.step < before]
                           for s, cs in commits.items()}, failed
            self.reset_all()
            setback = classify_setback(failed, c, {})
            corrupt_count += 1
            decision = decide(setback, corrupt_count, budget)
            if not isinstance(decision, FallBack):
                return Fail("; ".join(str(f) for f in failed.values()))
            self.loads.log.warning("resume.corrupt_checkpoint", step=c, error=setback.detail)
            if decision.drop is not None:
                self.drop_commit(*decision.drop, setback.detail)
            commits, before = self.term.commits(), c

    def _reload_refused(self, failed: dict[str, WorkerCallFailed], cut: int, commits: Commits,
                        budget: Budget) -> dict[str, WorkerCallFailed]:
        """Resume or adopt: a live worker that refused the load (the lost leader's load of the job was still on its
        way there when the stale runtimes were unloaded, so the job is loaded there under the old term) is unloaded
        again and asked again after a pause, within the budget of refusals; what still fails is returned."""
        count = 0
        while True:
            refused = {w: f for w, f in failed.items() if f.verdict is Verdict.REFUSED and self.registered(w)}
            if not refused:
                return failed
            count += 1
            decision = decide(classify_setback(refused, cut, {w: True for w in refused}), count, budget)
            if not isinstance(decision, Retry):
                return failed
            self.loads.log.warning("resume.load_refused", workers=sorted(refused), attempt=count,
                                   reason=decision.reason)
            self.loads.clock.sleep(decision.after_s)
            self.loads.unload_everywhere(read_cluster(self.term.store, self.term.keys), only=set(refused))
            failed = {w: f for w, f in failed.items() if w not in refused} | self.loads.load(set(refused), cut, commits)

    def lost_at_load(self, budget: Budget, failed: Mapping[str, WorkerCallFailed], cut: int) -> dict[str, str] | Fail:
        """The workers lost while the job was loading (a recovery moves them); any other failure: :class:`Fail`,
        which the executor carries out (the job fails)."""
        if not failed:
            return {}
        setback = classify_setback(failed, cut, {w: self.registered(w) for w in failed})
        decision = decide(setback, 1, budget)
        if isinstance(decision, Refence):
            self.loads.log.warning("job.lost_while_loading", workers=sorted(decision.lost), reason=decision.reason)
            return dict(decision.lost)
        if setback.verdict is Verdict.PROGRAM and isinstance(decision, Fail):
            return decision
        w, f = next(iter(failed.items()))
        return Fail(f"worker {w} could not load the job: {f}")

    def restored(self, recovery: Recovery) -> None:
        """The lost slices run again: the executor takes the job back to RUNNING (and sets the cut,
        :meth:`restore_point`)."""
        self.on_restored(recovery)

    def restore_point(self, recovery: Recovery) -> tuple[int, dict[str, list[int]]]:
        """The cut ``recovery`` restored from, which becomes the job's (lower than before when it fell back past a
        commit that did not restore), and the commits that still count (slice -> steps: etcd's, less any at or
        past the cut that did not restore). Moves nothing: the executor sets the cut."""
        cut, bad = recovery.record.checkpoint_step, recovery.data.bad_cut
        return cut, {s: [c.step for c in cs if bad is None or c.step < bad] for s, cs in self.term.commits().items()}


class JobStragglerPort:
    """A job's :class:`~rallypoint.orchestrator.job.stragglers.StragglerPort` (see the module doc).

    ``busy``: why the job is not running undisturbed now (the executor's view of its state,
    recoveries, drains and warm spares).
    """

    def __init__(self, job: str, *, term: JobTerm, placement: JobPlacement, loads: JobLoads, progress: JobProgress,
                 drains: JobDrains, busy: Callable[[], str], event: Callable[..., None]) -> None:
        self.job, self.term, self.places, self.loads, self.progress, self.drains = \
            job, term, placement, loads, progress, drains
        self.busy, self.event = busy, event

    def placement(self) -> Mapping[str, SlicePlace]:
        return self.places.slices

    def loaded_workers(self) -> list[str]:
        return self.loads.loaded

    def cluster(self) -> ClusterSnapshot | None:
        try:
            return read_cluster(self.term.store, self.term.keys)
        except StoreError:
            return None

    def cordon(self, worker: str, slice_name: str, probation: Probation) -> str:
        now = self.term.clock.wall()
        why: dict[str, object] = {"by": CORDON_BY, "job": self.job, "slice": slice_name, "at": now}
        try:
            lease = 0
            if probation.lapse_s is None:
                why["kept_out"] = probation.reason
            else:  # the cordon lapses with its lease: etcd puts the worker back, whoever leads by then
                grant = self.term.store.grant_lease(max(1, math.ceil(probation.lapse_s)))
                lease, why["lapses_at"] = grant.id, now + grant.ttl_s
            self.term.txn([Put(self.term.keys.cordon(worker), json.dumps(why), lease=lease)])
        except (StoreError, NotLeader) as exc:
            return str(exc)
        return ""

    def straggler_moves(self, worker: str) -> list[float]:
        try:
            kv = self.term.store.get(self.term.keys.straggler_moves(worker))
        except StoreError:
            return []  # etcd away: judged as a first move (probation), the safer way to err for capacity
        return skip_bad(lambda: _moves(kv)) or [] if kv is not None else []

    def note_moves(self, worker: str, moves: tuple[float, ...]) -> None:
        self.term.write_quietly("straggler.moves_unrecorded",
                                [Put(self.term.keys.straggler_moves(worker), json.dumps({"moves": list(moves)}))])

    def uncordon(self, worker: str) -> None:
        self.term.write_quietly("straggler.uncordon_failed", [Delete(self.term.keys.cordon(worker))])

    def drain(self, worker: str) -> DrainRecord:
        return self.drains.start(DrainRequest(worker, "straggler", "executor", self.term.clock.wall(), 0.0)).record


def _moves(kv: KeyValue) -> list[float]:
    """The wall times of a worker's straggler moves (``straggler-moves/<worker>``). Raises BadRecord."""
    f = Fields.of(kv, "straggler_moves")
    moves = f.items("moves")
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in moves):
        raise f.bad("moves", "holds a value that is not a number")
    return [float(t) for t in moves]

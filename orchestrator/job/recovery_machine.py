"""One recovery of one job, as an explicit state machine.

A recovery starts when the executor notices lost workers and ends when every lost
slice runs again and every node is back where it was::

    FENCING -> PLANNING -> REMAPPING -> RESTORING -> REPLAYING -> CATCHING_UP -> DONE
       ^                                   |
       |____ lost again (Refence) _________|      any state -> FAILED (with the reason)
                  PLANNING <- fall back past a corrupt cut, escalate to restart-all, retry

Each state is a frozen dataclass holding its data (:class:`Fencing` holds the workers
to fence, :class:`Restoring` the cut, commits, plan and the workers to load, ...);
:meth:`Recovery.step` runs the current one and moves to the next through
:meth:`Recovery._set`, which refuses any transition not in :data:`TRANSITIONS`.

* **FENCING**: revoke each lost worker's lease (its registration and device leases go
  in one etcd operation: a partitioned worker can then do no harm); record the failure.
* **PLANNING**: read the commits, take the newest consistent cut ``c`` (below one that
  did not restore), and plan (:func:`rallypoint.recovery.decide.plan_recovery`).
* **REMAPPING**: lease spare devices for the unplaced slices (the job's ``on_no_spare``).
* **RESTORING**: load the moved slices from ``c`` and rewire the survivors (partial),
  or reload every slice from ``c`` (restart-all). A setback here goes to
  :func:`rallypoint.recovery.decide.decide`, whose decision picks the next state.
* **REPLAYING** / **CATCHING_UP**: the executor runs again; it reports instances
  (:meth:`Recovery.observe`) and progress (:meth:`Recovery.progressed`).

What the machine needs of the job is :class:`RecoveryPort`, which
:class:`~rallypoint.orchestrator.job.ports.JobRecoveryPort` implements and tests
fake (``tests/orchestrator/test_recovery_machine.py``).
"""

from __future__ import annotations

import abc
import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.orchestrator.job.recovery import RecoveryRecord
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.recovery.load_plan import SlicePlace
from rallypoint.recovery.decide import (Budget, Escalate, Fail, FallBack, Refence, Retry, Setback, Verdict, decide,
                                        plan_recovery)
from rallypoint.recovery.remap import NoRoom
from rallypoint.recovery.replay import Graph, ReplayPlan

Commits = Mapping[str, list[CheckpointCommit]]


class RecoveryPhase(enum.Enum):
    FENCING = "fencing"
    PLANNING = "planning"
    REMAPPING = "remapping"
    RESTORING = "restoring"
    REPLAYING = "replaying"
    CATCHING_UP = "catching_up"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (RecoveryPhase.DONE, RecoveryPhase.FAILED)


P = RecoveryPhase
TRANSITIONS: dict[RecoveryPhase, frozenset[RecoveryPhase]] = {
    P.FENCING: frozenset({P.PLANNING, P.FAILED}),
    P.PLANNING: frozenset({P.REMAPPING, P.FAILED}),
    P.REMAPPING: frozenset({P.RESTORING, P.FENCING, P.FAILED}),
    P.RESTORING: frozenset({P.REPLAYING, P.FENCING, P.PLANNING, P.FAILED}),
    P.REPLAYING: frozenset({P.CATCHING_UP, P.DONE}),
    P.CATCHING_UP: frozenset({P.DONE}),
    P.DONE: frozenset(),
    P.FAILED: frozenset(),
}
"""Every allowed transition. REPLAYING -> DONE: a newer loss or the job's end supersedes it."""

MARKS = {P.FENCING: "fencing", P.REMAPPING: "remap", P.RESTORING: "restore", P.REPLAYING: "replay",
         P.CATCHING_UP: "catch_up"}
"""The recovery record's phase (``job_recovery.PHASES``) that ends when a state is left."""


@dataclass(frozen=True)
class Fencing:
    lost: Mapping[str, str]  # worker -> why
    # Of those, the workers that are alive: a multi-host slice they lead lost another member. Only this job's
    # runtime on them ends (unloaded, its devices released); the worker and its other jobs go on.
    unload: frozenset[str] = frozenset()
    phase = P.FENCING


@dataclass(frozen=True)
class Planning:
    phase = P.PLANNING


@dataclass(frozen=True)
class Remapping:
    cut: int
    commits: Commits
    plan: ReplayPlan
    phase = P.REMAPPING


@dataclass(frozen=True)
class Restoring:
    cut: int
    commits: Commits
    plan: ReplayPlan
    new_workers: frozenset[str]
    phase = P.RESTORING


@dataclass(frozen=True)
class Replaying:
    phase = P.REPLAYING


@dataclass(frozen=True)
class CatchingUp:
    phase = P.CATCHING_UP


@dataclass(frozen=True)
class Done:
    reason: str
    phase = P.DONE


@dataclass(frozen=True)
class Failed:
    reason: str
    phase = P.FAILED


RecoveryState = Fencing | Planning | Remapping | Restoring | Replaying | CatchingUp | Done | Failed


class RecoveryPort(abc.ABC):
    """What a recovery needs of its job. The executor implements it; tests fake it.

    Methods that talk to etcd retry through its outages themselves (and raise
    :class:`JobFailed` when it stays away); worker calls return or raise
    :class:`WorkerCallFailed` with its verdict.
    """

    graph: Graph
    placement: Mapping[str, SlicePlace]  # read-only: the placement's owner applies what :meth:`place` is given
    cut: int  # the newest cut the workers were told of (their output logs reach back to it)
    log_floor: Mapping[str, int] = MappingProxyType({})  # node -> its log's first step, where past the cut (a drain)
    restore_tiers: Mapping[str, str] = MappingProxyType({})  # slice -> "memory" | "disk": what the last load read
    program_sources: Mapping[str, str] = MappingProxyType({})  # node -> "warm" | "cold": what the last load found
    generations: Mapping[str, int] = MappingProxyType({})  # worker -> the generation of the job's runtime there now

    @abc.abstractmethod
    def loaded_workers(self) -> list[str]:
        """The workers whose runtimes the job uses now."""

    @abc.abstractmethod
    def fence(self, worker: str, incarnation: int) -> None:
        """Revoke the worker's lease if it is still that incarnation."""

    @abc.abstractmethod
    def unload(self, worker: str) -> bool:
        """End the job's runtime on a worker that is alive and let go of the job's devices there; whether it
        answered (one that does not is fenced instead)."""

    @abc.abstractmethod
    def forget(self, worker: str) -> None:
        """Stop using the worker's runtime (its events are ignored from now on)."""

    @abc.abstractmethod
    def record_failure(self, worker: str, incarnation: int, slices: list[str], reason: str) -> None:
        """Note a lost worker in the job's failures (once per incarnation)."""

    @abc.abstractmethod
    def commits(self) -> dict[str, list[CheckpointCommit]]:
        """The job's checkpoint commits."""

    @abc.abstractmethod
    def cut_step(self, commits: Commits, before: int | None) -> int:
        """The newest consistent cut of ``commits`` below ``before``; 0: the inits."""

    @abc.abstractmethod
    def done_through(self, node: str) -> int:
        """Every instance of ``node`` below this step has been reported done."""

    @abc.abstractmethod
    def devices_of(self, slice_name: str) -> int:
        """How many devices the slice needs."""

    @abc.abstractmethod
    def remap(self, need: Mapping[str, int], exclude: frozenset[str], recovery: int, *,
              lost: Mapping[str, int] = MappingProxyType({})) -> tuple[dict[str, SlicePlace], float] | NoRoom:
        """Lease spare devices for each slice of ``need`` for recovery number ``recovery`` (waits per policy):
        the places leased and the seconds it waited for a spare, or the remap planner's ``Fail`` (no spare
        within the policy: the recovery fails). An etcd outage past its retries still raises :class:`JobFailed`.

        ``exclude``: workers not to use whatever their incarnation; ``lost``: worker -> the incarnation
        lost (that one and older are not used; a newer one, the worker registered again, is)."""

    @abc.abstractmethod
    def place(self, places: Mapping[str, SlicePlace]) -> None:
        """The slices of ``places`` run there from now on (what :meth:`remap` leased)."""

    @abc.abstractmethod
    def load(self, workers: set[str] | None, start: int, commits: Commits, *,
             start_override: int | None = None) -> dict[str, WorkerCallFailed]:
        """Load ``workers`` (None: every worker of the placement) from the cut at ``start``; the failures."""

    @abc.abstractmethod
    def rewire(self, worker: str, plan: ReplayPlan, cut: int, commits: Commits) -> None:
        """Point a survivor's routes at the new places and resend its logged outputs. Raises :class:`WorkerCallFailed`."""

    def rewire_all(self, workers: list[str], plan: ReplayPlan, cut: int, commits: Commits) -> dict[str, WorkerCallFailed]:
        """:meth:`rewire` each survivor of ``workers`` (a port may do them all at once); the failures by worker."""
        failures: dict[str, WorkerCallFailed] = {}
        for w in workers:
            try:
                self.rewire(w, plan, cut, commits)
            except WorkerCallFailed as exc:
                failures[w] = exc
        return failures

    @abc.abstractmethod
    def reset_all(self) -> None:
        """Unload and forget every runtime (restart-all reloads them all)."""

    @abc.abstractmethod
    def registered(self, worker: str) -> bool:
        """Whether the incarnation the job placed on ``worker`` is still registered."""

    @abc.abstractmethod
    def drop_commit(self, slice_name: str, step: int, error: str) -> None:
        """A checkpoint that does not restore stops counting."""

    @abc.abstractmethod
    def restored(self, recovery: Recovery) -> None:
        """The lost slices run again from ``recovery.record.checkpoint_step``, which becomes the job's cut (lower
        than before when the recovery fell back past a commit that did not restore): the job goes back to
        RUNNING (record, event, grant)."""


@dataclass
class RecoveryData:
    """What a recovery accumulates across its attempts."""

    lost_slices: set[str] = field(default_factory=set)  # every slice it moves
    unplaced: set[str] = field(default_factory=set)  # of those, the ones without devices now
    lost_workers: dict[str, str] = field(default_factory=dict)  # every worker it fenced, with why
    lost_incarnations: dict[str, int] = field(default_factory=dict)  # of those, the incarnation lost (newest)
    bad_cut: int | None = None  # restore only from cuts below this one
    policy: str = "partial"
    setbacks: Counter[Verdict] = field(default_factory=Counter)


class Recovery:
    """One recovery (see the module doc): :meth:`run_to_replay`, then :meth:`observe` and :meth:`progressed`."""

    def __init__(self, port: RecoveryPort, record: RecoveryRecord, lost: Mapping[str, str], *, policy: str,
                 budget: Budget, clock: Clock, log: Any, frontier: Mapping[str, int], microbatches: int,
                 hooks: ExecutorHooks = ExecutorHooks(), parked: Iterable[str] = (),
                 unload: Iterable[str] = ()) -> None:
        """``parked``: slices a yield had taken off every device (``drain.py``); they are placed
        and restored like the lost ones. ``unload``: workers of ``lost`` that are alive (see :class:`Fencing`)."""
        self.port, self.record, self.budget, self.clock, self.log, self.hooks = port, record, budget, clock, log, hooks
        self.microbatches = microbatches
        self.frontier = dict(frontier)  # every node -> the step it had reached when the loss was noticed
        self.data = RecoveryData(policy=policy)
        self.data.lost_slices.update(parked)
        self.data.unplaced.update(parked)
        self.state: RecoveryState = Fencing(dict(lost), frozenset(unload) & set(lost))

    @property
    def phase(self) -> RecoveryPhase:
        return self.state.phase

    # -- the transition function ---------------------------------------------------------

    def _set(self, new: RecoveryState, **fields: Any) -> None:
        old = self.state
        if new.phase not in TRANSITIONS[old.phase]:
            raise AssertionError(f"recovery {self.record.number}: no transition {old.phase.value} -> {new.phase.value}")
        if old.phase in MARKS and new.phase is not old.phase:
            self.record.mark(MARKS[old.phase], self.clock.monotonic())
        self.state = new
        self.log.info("recovery.state", recovery=self.record.number, previous=old.phase.value, state=new.phase.value,
                      **fields)

    def step(self) -> RecoveryState:
        """Run the current state once and move to the next; returns the new state."""
        s = self.state
        try:
            if isinstance(s, Fencing):
                nxt: RecoveryState = self._fence(s)
            elif isinstance(s, Planning):
                nxt = self._plan()
            elif isinstance(s, Remapping):
                nxt = self._remap(s)
            elif isinstance(s, Restoring):
                nxt = self._restore(s)
            else:
                raise AssertionError(f"recovery {self.record.number}: {s.phase.value} does not step; the executor "
                                     "reports instances and progress instead")
        except JobFailed as exc:
            nxt = Failed(str(exc))
        self._set(nxt, **({"reason": nxt.reason} if isinstance(nxt, Failed) else {}))
        if isinstance(nxt, Replaying):
            self.port.restored(self)
            self._maybe_replayed()
        return self.state

    def run_to_replay(self) -> None:
        """Step until the lost slices run again. Raises :class:`JobFailed` if the recovery fails."""
        while self.phase not in (P.REPLAYING, P.CATCHING_UP) and not self.phase.is_terminal:
            self.step()
        if isinstance(self.state, Failed):
            raise JobFailed(self.state.reason)

    # -- the states ------------------------------------------------------------------------

    def _fence(self, s: Fencing) -> RecoveryState:
        self.record.attempts += 1
        port, d = self.port, self.data
        for w, why in sorted(s.lost.items()):
            slices = sorted(n for n, p in port.placement.items() if p.worker == w)
            alive = bool(slices) and w in s.unload and port.unload(w)
            if slices:
                inc = port.placement[slices[0]].incarnation
                if not alive:  # one alive is a spare like any other from now on, for this recovery too
                    d.lost_incarnations[w] = max(inc, d.lost_incarnations.get(w, inc))
                    port.fence(w, inc)
                self.record.lost.setdefault(w, slices)
                port.record_failure(w, inc, slices, why)
                d.lost_slices.update(slices)
                d.unplaced.update(slices)
            if not alive:
                d.lost_workers.setdefault(w, why)
            port.forget(w)
        return Planning()

    def _plan(self) -> RecoveryState:
        port, d = self.port, self.data
        commits = port.commits()
        c = port.cut_step(commits, d.bad_cut)
        done_through = {n.name: max(port.done_through(n.name), c) for n in port.graph.nodes}
        plan, escalated = plan_recovery(port.graph, policy=d.policy, lost_slices=d.lost_slices, cut=c,
                                        done_through=done_through,
                                        logged_from={n: max(min(port.cut, t), port.log_floor.get(n, 0))
                                                     for n, t in done_through.items()})
        if escalated:
            self.record.escalated = escalated
            self.log.warning("recovery.escalated", recovery=self.record.number, reason=escalated)
        return Remapping(c, commits, plan)

    def _remap(self, s: Remapping) -> RecoveryState:
        port, d = self.port, self.data
        need = {sl: port.devices_of(sl) for sl in sorted(d.unplaced)}
        # A lost worker is excluded by the incarnation lost: the same worker registered again (restarted, or back
        # from a partition) is a spare like any other, for this recovery too. One lost without a slice of the job
        # (its incarnation unknown here) is excluded whatever its incarnation.
        unknown = set(d.lost_workers) - set(d.lost_incarnations)
        exclude = frozenset(set(port.loaded_workers()) | unknown)
        remapped = port.remap(need, exclude, self.record.number, lost=dict(d.lost_incarnations)) if need else ({}, 0.0)
        if isinstance(remapped, NoRoom):
            return Failed(remapped.reason)
        placed, waited_s = remapped
        self.record.spare_wait_s += waited_s  # the goodput bucket waiting_for_spares
        port.place(placed)
        d.unplaced -= set(placed)
        self.record.moved.update({sl: p.worker for sl, p in placed.items()})
        new_workers = frozenset({port.placement[sl].worker for sl in d.lost_slices} - set(port.loaded_workers()))
        return Restoring(s.cut, s.commits, s.plan, new_workers)

    def _restore(self, s: Restoring) -> RecoveryState:
        port = self.port
        failures: dict[str, WorkerCallFailed] = {}
        if s.plan.policy == "partial":
            skip = None
            if self.hooks.skip_replay:  # a deliberately broken recovery (tests prove the invariants catch it)
                skip = min((r.to_step for r in s.plan.nodes.values() if r.slice in s.plan.lost_slices), default=s.cut)
                self.log.warning("recovery.replay_skipped", restored=s.cut, starts_at=skip)
            failures = port.load(set(s.new_workers), s.cut, s.commits, start_override=skip)
            if not failures:
                survivors = [w for w in port.loaded_workers() if w not in s.new_workers]
                failures = port.rewire_all(survivors, s.plan, s.cut, s.commits)
        else:
            port.reset_all()
            failures = port.load(None, s.cut, s.commits)
        if not failures:
            self._restored(s)
            return Replaying()
        return self._setback(failures, s.cut)

    def _setback(self, failures: Mapping[str, WorkerCallFailed], cut: int) -> RecoveryState:
        setback = classify_setback(failures, cut, {w: self.port.registered(w) for w in failures})
        self.data.setbacks[setback.verdict] += 1
        count = self.data.setbacks[setback.verdict]
        decision = decide(setback, count, self.budget)
        self.log.warning("recovery.setback", recovery=self.record.number, source=setback.verdict.value, count=count,
                         limit=self.budget.limit(setback.verdict), decision=type(decision).__name__,
                         reason=getattr(decision, "reason", ""), workers=sorted(setback.workers))
        if isinstance(decision, Refence):
            return Fencing(dict(decision.lost))
        if isinstance(decision, FallBack):
            if decision.drop is not None:
                self.port.drop_commit(*decision.drop, setback.detail)
            self.data.bad_cut, self.data.policy = decision.before, "restart-all"
            self.record.escalated = decision.reason
            return Planning()
        if isinstance(decision, Escalate):
            self.data.policy = "restart-all"
            self.record.escalated = decision.reason
            return Planning()
        if isinstance(decision, Retry):
            self.clock.sleep(decision.after_s)
            return Planning()
        assert isinstance(decision, Fail)
        return Failed(decision.reason)

    def _restored(self, s: Restoring) -> None:
        rec, plan = self.record, s.plan
        rec.policy, rec.checkpoint_step = plan.policy, s.cut
        rec.restore_tiers = dict(sorted(self.port.restore_tiers.items()))
        sources = self.port.program_sources
        rec.warm = {sl: all(sources.get(n.name) == "warm" for n in self.port.graph.nodes if n.slice == sl)
                    for sl in sorted(rec.moved)}
        rec.replay_nodes = sorted(plan.nodes)
        rec.planned_instances = {n: k for n, k in plan.instances(self.microbatches).items() if k}
        rec.targets = {n: r.to_step for n, r in plan.nodes.items()}
        rec.expected.update(rec.planned_instances)
        rec.frontier = self.frontier
        rec.generations = dict(self.port.generations)  # the runtimes that replay (their instances count)

    # -- while the job runs again ------------------------------------------------------------

    def observe(self, worker: str, generation: int, node: str, step: int) -> None:
        """An instance done by ``worker``'s runtime of ``generation``."""
        if self.phase is not P.REPLAYING:
            return
        self.record.observe(worker, generation, node, step)
        self._maybe_replayed()

    def _maybe_replayed(self) -> None:
        if self.phase is P.REPLAYING and self.record.replayed:
            self._set(CatchingUp())

    def progressed(self) -> None:
        """The job moved: done once every node is back where it was when the loss was noticed."""
        if self.phase is P.CATCHING_UP and all(self.port.done_through(n) >= s for n, s in self.frontier.items()):
            self._set(Done("caught up"))
            self.log.info("recovery.caught_up", recovery=self.record.number, phases=self.record.phases())

    def supersede(self, reason: str) -> None:
        """A newer loss, or the job's end, ends this recovery's measured phases here."""
        if self.phase in (P.REPLAYING, P.CATCHING_UP):
            self._set(Done(reason), reason=reason)
            for p in ("replay", "catch_up"):
                if p not in self.record.marks:
                    self.record.mark(p, self.clock.monotonic())


def classify_setback(failures: Mapping[str, WorkerCallFailed], cut: int, registered: Mapping[str, bool]) -> Setback:
    """The one setback an attempt's worker failures amount to (the gravest kind wins).

    Order: the job's own program failed (nothing else matters), a corrupt checkpoint (the cut
    must move), lost workers, suspect workers, a short output log, an invalid request,
    refusals, cancellations (never a suspicion).
    """
    by: dict[Verdict, dict[str, WorkerCallFailed]] = {}
    for w, f in failures.items():
        by.setdefault(f.verdict, {})[w] = f
    order = [Verdict.PROGRAM, Verdict.CORRUPT, Verdict.LOST, Verdict.SUSPECT, Verdict.LOG_SHORT, Verdict.INVALID,
             Verdict.REFUSED, Verdict.CANCELLED]
    for verdict in order:
        if verdict in by:
            fs = by[verdict]
            corrupt = next((f.corrupt for f in fs.values() if f.corrupt is not None), None)
            return Setback(verdict, workers={w: str(f) for w, f in fs.items()},
                           registered={w: registered.get(w, True) for w in fs}, cut=cut,
                           corrupt=(corrupt.slice_name, corrupt.step) if corrupt else None,
                           detail="; ".join(str(f) for f in fs.values()))
    raise ValueError("classify_setback needs at least one failure")

"""A job's losses and stalls: workers lost (to the leader's checks, their streams, a fence, a drain, the
end) are gathered and recovered; a stall (no progress for the stall timeout) is judged, reported and
recovered or fails the job.

:class:`JobLosses` is the executor's collaborator for these: it opens a recovery in
:class:`~rallypoint.orchestrator.job.recoveries.JobRecoveries` and runs it (docs/recovery.md); the job's
state moves only through the executor's ``set_state`` (RECOVERING here, RUNNING again when the
recovery's port says the lost slices run again).
"""

from __future__ import annotations

from collections.abc import Callable

from rallypoint.basics.clock import Clock
from rallypoint.orchestrator.job.drains import JobDrains
from rallypoint.orchestrator.job.loads import JobLoads
from rallypoint.orchestrator.job.placement import JobPlacement
from rallypoint.orchestrator.job.progress import JobProgress
from rallypoint.orchestrator.job.recoveries import JobRecoveries
from rallypoint.orchestrator.job.recovery import JobSettings
from rallypoint.orchestrator.job.state import JobFailed, JobState
from rallypoint.orchestrator.job.watchdog import ProgressWatchdog
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.decide import Budget, Fail, Refence
from rallypoint.recovery.replay import Graph
from rallypoint.recovery.stalls import laggards, lagging_nodes


class JobLosses:
    """Recoveries of lost workers and the judgement of stalls, for one job (see the module doc).

    Args:
        spec, graph: the job and its graph.
        workers, loads, progress, placement, drains, recovery: the collaborators a loss goes through.
        budget: setbacks each recovery absorbs, by source (a stall's limit is reported with it).
        loss_grace_s: after one loss, how long to gather others that happened with it.
        settings: the job's recovery settings (None: the spec's are not valid; the job fails before it runs).
        clock: the injected clock.
        set_state: the executor's one way to move the job's state.
        event: sends a job event.
    """

    def __init__(self, spec: pb.JobSpec, graph: Graph, *, workers: JobWorkers, loads: JobLoads,
                 progress: JobProgress, placement: JobPlacement, drains: JobDrains, recovery: JobRecoveries,
                 budget: Budget, loss_grace_s: float, settings: JobSettings | None, clock: Clock,
                 set_state: Callable[..., None], event: Callable[..., None]) -> None:
        self.spec, self.graph, self.workers, self.loads, self.progress = spec, graph, workers, loads, progress
        self.places, self.drains, self.recovery, self.budget = placement, drains, recovery, budget
        self.loss_grace_s, self.settings, self.clock = loss_grace_s, settings, clock
        self._set_state, self._event = set_state, event

    def recover(self, lost: dict[str, str], *, unload: frozenset[str] = frozenset()) -> None:
        """Recover ``lost`` until the lost slices run again; ``unload``: those alive (only the job's runtime ends)."""
        assert self.settings is not None
        now = self.clock.monotonic()
        self.workers.gather_ended(lost, self.loss_grace_s)
        heard = self.loads.last_heard
        rec = self.recovery.open(lost, detection_s=max(now - heard.get(w, now) for w in lost),
                                 preempted=self.drains.preempted(lost))
        parked = self.drains.abort(f"recovery {rec.number} started")
        frontier = {n.name: self.progress.done_through(n.name) for n in self.graph.nodes}
        self._set_state(JobState.RECOVERING, recovery=rec.number, lost=sorted(lost))
        self._event("job.recovering", step=self.progress.completed, recovery=rec.number, lost=lost)
        self.recovery.run(rec, lost, policy=self.settings.policy, frontier=frontier, parked=parked, unload=unload)

    def stalled(self, quiet: float, watchdog: ProgressWatchdog) -> None:
        """No progress for the stall timeout: report it, and recover the workers the job waits on.

        Raises:
            JobFailed: the stall budget is spent.
        """
        blamed = laggards([(n.name, n.slice) for n in self.graph.nodes], self.progress.done_through,
                          {s: p.worker for s, p in self.places.slices.items()}, self.spec.steps)
        reason, decision = self.recovery.stalled(quiet, watchdog, blamed, self.progress.completed)
        self._event("job.stalled", step=self.progress.completed, reason=reason, workers=sorted(blamed),
                    stalls=watchdog.stalls, limit=self.budget.stall)
        if isinstance(decision, Refence):
            self.recover({w: f"stalled: {why}" for w, why in decision.lost.items()})
        elif isinstance(decision, Fail):
            raise JobFailed(decision.reason)

    def compiling(self, watchdog: ProgressWatchdog) -> bool:
        """Whether a node the job waits on has not yet run on its runtime: it compiles (watchdog.py)."""
        worker_of = {s: p.worker for s, p in self.places.slices.items()}
        lag = lagging_nodes([(n.name, n.slice) for n in self.graph.nodes], self.progress.done_through, self.spec.steps)
        runtime = {n: (w, self.workers.generation[w]) for n, sl in lag
                   if (w := worker_of.get(sl, "")) in self.workers.generation}
        return watchdog.compiling(runtime, runtime.get)

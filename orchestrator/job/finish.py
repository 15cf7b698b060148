"""The job's end: its final cut, then every worker's final state, or the workers lost while it was fetched.

Every step done, :class:`JobEnd` first waits for the **final cut**: every slice with states
commits its state at ``steps`` like any checkpoint (``workers/runtime/checkpoints.py`` saves
there whatever ``checkpoint_every`` is), so a detached run's last steps are kept and
``rallypoint export`` reads the final state from the run directory. The executor's loop runs
meanwhile: a worker lost before its final save commits is recovered as ever, and a save that
failed (a full disk) is tried again by its worker until it counts.

:func:`fetch_final` is :meth:`JobEnd.fetch`'s fetch:
fetch from every worker at once, and say which workers are lost if any did not answer. It
decides, the executor acts: a worker lost meanwhile is recovered like any other (its slices
replay to the end on a spare) and the executor asks again.

A multi-host slice's final state is gathered by its lead from the members' shards, so a member
lost meanwhile fails the lead's fetch: the lead answers so, naming the member's worker
(``member_lost``, :mod:`rallypoint.proto.errors`), and :func:`final_losses` counts it as that
member's loss, the lead's with it (alive: the recovery unloads the job there), exactly as a member
lost while the slice runs (``JobPlacement.group_lost``; docs/multihost.md). A member whose
registration is gone counts so too (``JobPlacement.as_lead_losses``), whatever the lead answered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.placement import JobPlacement
from rallypoint.orchestrator.job.state import JobFailed, JobState
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.basics.clock import Clock
from rallypoint.recovery.decide import Verdict
from rallypoint.recovery.slices import stateful_slices

GroupLoss = Callable[[str, str, str], tuple[dict[str, str], frozenset[str]]]
"""``JobPlacement.group_lost``: (lead, the lost member's worker, why) -> the losses, and those of them alive."""


class FinalLosses(NamedTuple):
    """The workers lost while the final state was fetched, each with why; and those of them alive (leads whose
    multi-host slice lost a member: the recovery unloads the job there rather than fencing them)."""

    lost: dict[str, str]
    alive: frozenset[str]


def fetch_final(workers: JobWorkers, term: JobTerm, places: JobPlacement) -> list[pb.StateValue] | FinalLosses:
    """Every worker's final states, or (some did not answer) the workers lost, each with why.

    Raises:
        JobFailed: a worker refused the fetch without being lost.
    """
    states, failed = workers.fetch_all()
    if not failed:
        return states
    watched = {w: workers.identity[w].incarnation for w in failed if w in workers.identity} | places.gang_members()
    return final_losses(failed, places.as_lead_losses(term.gone(watched)), places.group_lost)


def final_losses(failed: Mapping[str, WorkerCallFailed], gone: tuple[Mapping[str, str], frozenset[str]],
                 group_lost: GroupLoss) -> FinalLosses:
    """The losses that the fetch's failures by worker (``failed``) amount to, with ``gone``: the workers whose
    registration is gone, each with why, and the leads of the gangs they were members of (alive), as
    ``JobPlacement.as_lead_losses`` gives them. A lead that answered that a member of its slice was lost
    (``member_lost``) loses its slice as ``group_lost`` says; a worker whose process is gone (``LOST``) is lost.

    Raises:
        JobFailed: some fetch failed and no worker is lost (a refusal, not a loss).
    """
    lost: dict[str, str] = {}
    alive: set[str] = set()
    dead: set[str] = set()
    for w, exc in failed.items():
        if exc.member_lost is not None:
            more, up = group_lost(w, exc.member_lost.worker,
                                  f"lost a member while its final state was fetched: {exc.member_lost.error}")
            lost.update(more)
            alive |= up
        elif exc.verdict is Verdict.LOST:
            lost[w] = f"lost while its final state was fetched: {exc}"
            dead.add(w)
    gone_lost, gone_alive = gone
    lost.update(gone_lost)
    dead |= set(gone_lost) - gone_alive
    if not lost:
        raise JobFailed(f"could not fetch the final state: {next(iter(failed.values()))}")
    return FinalLosses(lost, frozenset((alive | gone_alive) - dead))


class JobEnd:
    """The end of one job's run: the final cut, then the final state (see the module doc). The executor's loop."""

    def __init__(self, spec: pb.JobSpec, *, workers: JobWorkers, term: JobTerm, places: JobPlacement, losses: Any,
                 recovery: Any, drains: Any, progress: Any, clock: Clock, log: Any, hooks: Any,
                 step: Callable[[], None], set_state: Callable[[JobState], None],
                 settled: Callable[[], bool] = lambda: True) -> None:
        self.spec, self.workers, self.term, self.places, self.settled = spec, workers, term, places, settled
        self.losses, self.recovery, self.drains, self.progress = losses, recovery, drains, progress
        self.clock, self.log, self.hooks, self.step, self.set_state = clock, log, hooks, step, set_state
        self.final_cut_s: float | None = None  # every step done -> the final cut committed (None: no final cut)

    def final_cut(self, checkpoints: bool) -> None:
        """Wait until the cut reaches ``steps``: every slice's final state committed (``checkpoints`` False, or no
        slice holds states: the job has no checkpoints, so none), and ``settled`` (the verifications of the end,
        job/verify.py). The loop runs meanwhile."""
        if not checkpoints or not stateful_slices(self.spec):
            return
        t0 = self.clock.monotonic()
        while self.progress.cut < self.spec.steps or not self.settled():  # a verification may roll it back
            self.step()
        self.final_cut_s = round(self.clock.monotonic() - t0, 4)
        self.log.info("job.final_cut", step=self.spec.steps, wait_s=self.final_cut_s)

    def fetch(self) -> list[pb.StateValue]:
        """FINISHING: every worker's final state; a worker lost meanwhile is recovered (its slices replay to the end)
        and every worker asked again."""
        self.set_state(JobState.FINISHING)
        self.hooks.at_finish(self.spec.job)  # tests only: the finish gate (hooks.py)
        while not isinstance(states := fetch_final(self.workers, self.term, self.places), list):
            self.log.warning("job.lost_while_finishing", lost=states.lost)  # recovered, then all asked again
            self.losses.recover(states.lost, unload=states.alive)  # a gang's lead that lost a member: unloaded
            self.recovery.progressed()  # restored from the final cut: nothing to replay, caught up at once
            while self.recovery.active is not None:  # the lost slices replay to the end
                self.step()
                self.recovery.progressed()
            self.set_state(JobState.FINISHING)
        self.recovery.supersede("the job ended")
        self.drains.abort("the job ended")
        return states

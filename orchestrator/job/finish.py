"""The job's end: every worker's final state, fetched through the losses that come meanwhile.

:func:`final_states` is :meth:`~rallypoint.orchestrator.job.executor.JobExecutor.finish`'s fetch,
apart because it is a loop of its own: fetch from every worker at once; a worker lost
meanwhile is recovered like any other (its slices replay to the end on a spare, the
executor's :meth:`~rallypoint.orchestrator.job.executor.JobExecutor.step` seeing to losses and
stalls), and all are asked again.
"""

from __future__ import annotations

from typing import Any

from rallypoint.orchestrator.job.failures import Verdict
from rallypoint.orchestrator.job.state import JobFailed, JobState
from rallypoint.proto import rallypoint_pb2 as pb


def final_states(x: Any) -> list[pb.StateValue]:
    """Every worker's final states for executor ``x`` (in FINISHING; FINISHING again after a recovery).

    Raises:
        JobFailed: a worker refused the fetch without being lost.
    """
    while True:
        states, failed = x.workers.fetch_all()
        if not failed:
            return states
        lost = {w: f"lost while its final state was fetched: {exc}" for w, exc in failed.items()
                if exc.verdict is Verdict.LOST}
        lost.update(x.term.gone({w: x.workers.identity[w].incarnation for w in failed if w in x.workers.identity}))
        if not lost:
            raise JobFailed(f"could not fetch the final state: {next(iter(failed.values()))}")
        x.log.warning("job.lost_while_finishing", lost=sorted(lost))
        x._recover(lost)
        while x.recovery.active is not None:  # the lost slices replay to the end
            x.step()
        x._set_state(JobState.FINISHING)

"""The job's end: every worker's final state, or the workers lost while it was fetched.

:func:`fetch_final` is :meth:`~rallypoint.orchestrator.job.executor.JobExecutor.finish`'s fetch:
fetch from every worker at once, and say which workers are lost if any did not answer. It
decides, the executor acts: a worker lost meanwhile is recovered like any other (its slices
replay to the end on a spare) and the executor asks again.
"""

from __future__ import annotations

from rallypoint.recovery.decide import Verdict
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.orchestrator.job.term import JobTerm
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.proto import rallypoint_pb2 as pb


def fetch_final(workers: JobWorkers, term: JobTerm) -> list[pb.StateValue] | dict[str, str]:
    """Every worker's final states, or (some did not answer) the workers lost, each with why.

    Raises:
        JobFailed: a worker refused the fetch without being lost.
    """
    states, failed = workers.fetch_all()
    if not failed:
        return states
    lost = {w: f"lost while its final state was fetched: {exc}" for w, exc in failed.items()
            if exc.verdict is Verdict.LOST}
    lost.update(term.gone({w: workers.identity[w].incarnation for w in failed if w in workers.identity}))
    if not lost:
        raise JobFailed(f"could not fetch the final state: {next(iter(failed.values()))}")
    return lost

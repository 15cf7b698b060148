"""The executor's mover of a job's cut, its commits and its output-log floor: :class:`JobCut`.

:class:`~rallypoint.orchestrator.job.progress.JobProgress` stores these facts and does no
I/O; the executor moves them, on its loop (``progress.begin`` when the runtimes start,
``progress.commit`` as commits are heard) and through the one :class:`JobCut` it owns for
whatever another part decided. :class:`JobCut` is also the one place a commit is dropped
(in etcd through the term, and in the progress). What it is handed:

* the cut a recovery restored from (:meth:`JobRecoveryPort.restore_point
  <rallypoint.orchestrator.job.ports.JobRecoveryPort.restore_point>`), which the executor
  passes to :meth:`JobCut.restored`;
* a commit that did not restore (the recovery machine's ``FallBack``, through the port):
  :meth:`JobCut.drop_commit`;
* a restart of every runtime (the port's ``reset_all``): :meth:`JobCut.reset_logs`;
* the :class:`~rallypoint.orchestrator.job.progress.LogFloor` of a drain's move (in
  :class:`~rallypoint.orchestrator.job.drains.DrainsStep`): :meth:`JobCut.floors`;
* a non-finite stop (:meth:`JobMetrics.stop <rallypoint.orchestrator.job.metrics.JobMetrics.stop>`'s
  :class:`~rallypoint.orchestrator.job.metrics.NonFiniteStop`): :meth:`JobCut.stop`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rallypoint.basics.errors import RallypointError
from rallypoint.orchestrator.job.metrics import JobMetrics, NonFinite
from rallypoint.orchestrator.job.progress import JobProgress, LogFloor
from rallypoint.orchestrator.job.term import JobTerm


class JobCut:
    """Moves the cut, the commits and the log floor of one job (see the module doc). Single-threaded."""

    def __init__(self, term: JobTerm, progress: JobProgress) -> None:
        self.term, self.progress = term, progress

    def drop_commit(self, slice_name: str, step: int) -> None:
        """A commit stops counting: in etcd and in the progress."""
        self.term.drop_commit(slice_name, step)
        self.progress.drop_commit(slice_name, step)

    def restored(self, cut: int, commits: Mapping[str, Iterable[int]]) -> None:
        """Runtimes restored from ``cut`` with ``commits`` counting: the cut becomes it (the floor falls with it)."""
        self.progress.restored(cut, commits)

    def floors(self, floors: Iterable[LogFloor]) -> None:
        """Drains moved slices: their nodes' output logs start at the drain step."""
        for f in floors:
            self.progress.floor(f.nodes, f.step)

    def reset_logs(self) -> None:
        """Every runtime restarts from the cut: no output log starts past it."""
        self.progress.reset_floor()

    def stop(self, bad: NonFinite, metrics: JobMetrics) -> str:
        """A non-finite stop, once the grants halted at ``bad.step`` and every worker unloaded (a save in flight has
        committed): drop the commits past the step, keep the newest cut at or before it. Returns the job's failure
        (which says so when etcd was away or the term over and the commits could not be dropped)."""
        try:
            stop = metrics.stop(bad, self.progress.cut, self.term.commits)
            for slice_name, step in stop.drop:
                self.drop_commit(slice_name, step)
        except (RallypointError, OSError) as exc:
            return metrics.not_dropped(bad, exc)
        if stop.cut is not None:
            self.progress.restored(stop.cut, stop.commits)
        return stop.reason

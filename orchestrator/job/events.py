"""What a job hears from its workers, and what each event moves.

The executor's loop takes one event at a time from :attr:`JobWorkers.events
<rallypoint.orchestrator.job.workers.JobWorkers.events>` and hands it to :meth:`JobEvents.handle`:

* ``warmed``: a round of spare warming answered (job/warm.py): reported;
* ``grant_failed``: a worker whose process is gone is lost; any other refusal is noted on the
  grants (``Grants.refused``) and granted again at the next periodic check;
* ``fenced``, ``ended``: the worker is lost;
* ``batch``: the ``InstanceDone``s of one message of a worker's stream, each as below, in order, and
  the completed steps advanced once for them all (one pass, however many arrived together);
* an instance done (``InstanceDone``): a checkpoint commit moves the cut; a multi-host slice's
  lost member (``group_lost``) loses its group; an error fails the job; a non-finite metric under
  ``on_nonfinite = "stop"`` halts the grants, unloads the workers and fails the job with what the
  executor's ``JobCut`` dropped and kept; otherwise the instance is counted
  (recoveries, the watchdog, drains, stragglers, step times) and the completed steps advance
  (``step.done``, a record every ``RECORD_EVERY`` steps, the window widened and granted). Each
  completed step is judged for a loss spike, and a non-finite metric under ``on_nonfinite =
  "rollback"`` is one: under a rollback policy :class:`~rallypoint.orchestrator.job.rollback.RollBack`
  is raised, which the executor's loop carries out (job/rollback.py). Its output
  log's bytes may narrow an automatic window (job/window.py: a ``job.window`` event).

Events of a runtime the job gave up on (an older generation) are dropped, but ``warmed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rallypoint.orchestrator.job.cut import JobCut
from rallypoint.orchestrator.job.drains import JobDrains
from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.recovery.decide import Verdict
from rallypoint.orchestrator.job.goodput import StepTimes
from rallypoint.orchestrator.job.loads import JobLoads
from rallypoint.orchestrator.job.metrics import JobMetrics
from rallypoint.orchestrator.job.placement import JobPlacement
from rallypoint.orchestrator.job.progress import JobProgress
from rallypoint.orchestrator.job.recoveries import JobRecoveries
from rallypoint.orchestrator.job.rollback import JobRollbacks
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.orchestrator.job.stragglers import StragglerWatch
from rallypoint.orchestrator.job.watchdog import ProgressWatchdog
from rallypoint.orchestrator.job.window import StepWindow
from rallypoint.orchestrator.job.workers import JobWorkers
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replay import Graph

RECORD_EVERY = 10  # steps between job records while the job runs


class JobEvents:
    """One job's handling of its workers' events (see the module doc).

    Args:
        spec, graph: the job and its graph.
        workers, loads, progress, placement, drains, recovery, stragglers, step_times, metrics: the
            collaborators an event moves.
        job_cut: the executor's mover of the cut and the commits (a non-finite stop).
        adopted: the job was adopted (its earlier term's open recoveries end at its first step done).
        log: the executor's bound logger.
        event: sends a job event; ``emit``: sends a :class:`pb.JobEvent` (``step.done``).
        grant: grants the window and cut (to every worker, or the ones given).
        recover: recovers lost workers (``recover(lost, unload=alive)``: :meth:`JobLosses.recover`).
        record: writes the job record, unless etcd is away.
    """

    def __init__(self, spec: pb.JobSpec, graph: Graph, *, workers: JobWorkers, loads: JobLoads,
                 progress: JobProgress, placement: JobPlacement, drains: JobDrains, recovery: JobRecoveries,
                 stragglers: StragglerWatch, step_times: StepTimes, metrics: JobMetrics, job_cut: JobCut,
                 rollbacks: JobRollbacks, adopted: bool, log: Any,
                 event: Callable[..., None], emit: Callable[[pb.JobEvent], None],
                 grant: Callable[..., None], recover: Callable[..., None], record: Callable[[], None]) -> None:
        self.spec, self.graph, self.workers, self.loads, self.progress = spec, graph, workers, loads, progress
        self.places, self.drains, self.recovery, self.stragglers = placement, drains, recovery, stragglers
        self.step_times, self.metrics, self.adopted, self.log = step_times, metrics, adopted, log
        self.job_cut, self.rollbacks = job_cut, rollbacks
        self._event, self._emit, self._grant, self._recover, self._record = event, emit, grant, recover, record
        self.log_peak = {"memory_bytes": 0, "spilled_bytes": 0}  # the workers' output logs, the most any held
        self.window = StepWindow(spec.window)  # the steps in flight (job/window.py): decided when the run begins

    def fenced(self, worker: str, incarnation: int, reason: str) -> None:
        """The leader fenced ``worker`` (any thread): an event of its runtime, if the job runs on that incarnation."""
        to, gen = self.workers.identity.get(worker), self.workers.generation.get(worker)
        if to is not None and gen is not None and to.incarnation == incarnation:
            self.workers.events.put(("fenced", (worker, gen, reason)))

    def handle(self, kind: str, worker: str, gen: int, item: Any, watchdog: ProgressWatchdog) -> None:
        """One event of ``worker``'s runtime ``gen``.

        Raises:
            JobFailed: an instance failed (not a lost member of a multi-host slice), or a metric is not finite
                and the job stops at such values (``on_nonfinite`` stop).
        """
        if kind == "warmed":  # a round of WarmJob requests answered (job/warm.py)
            self.log.info("job.warmed", **item)
            self._event("job.warmed", step=self.progress.completed, **item)
            return
        if not self.workers.current(worker, gen):
            return  # a runtime given up on
        if kind == "grant_failed":
            self._grant_failed(worker, item)
            return
        if kind == "fenced":
            self._recover({worker: f"fenced by the leader ({item})"})
            return
        self.loads.heard(worker)
        if kind == "ended":
            self._recover({worker: f"event stream ended: {item}"})
            return
        if kind == "batch":  # a stream's InstanceDones, in order (InstanceDoneBatch): one pass, one advance
            counted = False
            for done in item:
                if not self.workers.current(worker, gen):
                    break  # one of them lost the runtime (a multi-host slice's member)
                if counted and _disrupts(done):  # what came before it advances first, as one at a time
                    self._advance()
                    counted = False
                counted = self._instance(worker, gen, done, watchdog) or counted
            if counted:
                self._advance()
            return
        if self._instance(worker, gen, item, watchdog):
            self._advance()

    def _instance(self, worker: str, gen: int, item: pb.InstanceDone, watchdog: ProgressWatchdog) -> bool:
        """One ``InstanceDone`` (see the module doc). True: an instance was counted (the steps may advance)."""
        watchdog.progressed()
        if item.checkpoint_slice:
            keep = self.places.settings.keep_checkpoints if self.places.settings is not None else 0
            if not self.places.term.promote(worker, item.checkpoint_slice, int(item.checkpoint_step), keep=keep,
                                            cut=self.progress.cut):
                return False  # refused (logged): it never counts
            if self.progress.commit(item.checkpoint_slice, int(item.checkpoint_step)) is not None:
                self.log.info("job.cut", step=self.progress.cut)
                self._grant()
                self.rollbacks.cut_moved(self.progress.cut)  # a verification of the steps up to it, maybe
            return False
        if item.HasField("group_lost"):  # a multi-host slice lost a member (wherever its lead noticed; docs/multihost.md)
            lost, alive = self.places.group_lost(worker, item.group_lost.member_worker,
                                                 f"node {item.node!r} at step {item.step}: {item.error}")
            self._recover(lost, unload=alive)
            return False
        if item.error:
            where = f"node {item.node!r} failed at step {item.step}" if item.node else "the job failed"
            raise JobFailed(f"{where} on worker {worker}: {item.error}")
        self.log_peak["memory_bytes"] = max(self.log_peak["memory_bytes"], int(item.log_bytes))
        self.log_peak["spilled_bytes"] = max(self.log_peak["spilled_bytes"], int(item.log_spilled_bytes))
        logged = int(item.log_bytes) + int(item.log_spilled_bytes)  # since the cut, wherever it is now
        if (narrowed := self.window.heard(logged, int(item.step), self.progress.cut)) is not None:
            self.log.info("job.window", **narrowed.to_json())
            self._event("job.window", step=self.progress.completed, **narrowed.to_json())
        bad = self.metrics.check(item)  # a metric not finite: a warning, or (on_nonfinite stop) where to stop
        if bad is not None and self.metrics.mode == "rollback":
            self.rollbacks.nonfinite(bad)  # raises RollBack: the executor's loop rolls the job back
        if bad is not None:
            self.progress.grants.halt(bad.step)
            for w in list(self.workers.workers):  # a save in flight finishes (and commits) before UnloadJob returns
                self.workers.unload(w)
            raise JobFailed(self.job_cut.stop(bad, self.metrics))  # the commits past it go, the cut before stays
        self._count(worker, gen, item, watchdog)
        return True

    def _grant_failed(self, worker: str, failure: WorkerCallFailed) -> None:
        """A worker whose process is gone is lost; any other refusal is granted again later
        (the grants' ``refused``): one that does not answer (hung, partitioned) is lost once its etcd
        registration is gone, which the periodic check sees."""
        if failure.verdict is Verdict.LOST:
            self._recover({worker: str(failure)})
            return
        self.progress.grants.refused(worker)
        self.log.info("job.grant_refused", worker=worker, code=failure.code.name, verdict=failure.verdict.value)

    def _count(self, worker: str, gen: int, item: pb.InstanceDone, watchdog: ProgressWatchdog) -> None:
        step, node = int(item.step), item.node
        self.recovery.observe(worker, gen, node, step)
        watchdog.ran(node, (worker, gen))
        self.drains.observe(worker, node, step)
        if item.program_source:  # a node's first call on this runtime: where its executable came from
            self.recovery.first_call(worker, gen, self.graph.node(node).slice, item.program_source, item.compile_s)
        if self.progress.instance(item):
            self.stragglers.instance(item)
            self.step_times.instance(node, step, item.compute_s)

    def _advance(self) -> None:
        for done in self.progress.complete():
            self._emit(pb.JobEvent(job=self.spec.job, event="step.done", step=done.step, metrics=done.metrics))
            self.step_times.step_done(done.step)
            self.rollbacks.observe(done)  # a loss spike (job/rollback.py): a job.spike event, or RollBack raised
            if self.adopted:
                self.recovery.adopted_running(done.step)
            if self.progress.completed % RECORD_EVERY == 0:
                self._record()
        if self.progress.recut() is not None:  # a commit that waited for the slices without states
            self.log.info("job.cut", step=self.progress.cut)
            self._grant()
            self.rollbacks.cut_moved(self.progress.cut)
        self.recovery.progressed()
        if self.progress.widen(self.window.steps):
            self._grant()
        self.stragglers.advanced()


def _disrupts(item: pb.InstanceDone) -> bool:
    """Whether ``item`` may fail the job or lose its runtime (an error, a lost member, a metric not finite)."""
    return bool(item.error) or item.HasField("group_lost") or not all(map(math.isfinite, item.metrics.values()))

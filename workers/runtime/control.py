"""How one loaded job stands on this worker: the lock, the grant, stop and failure, the events.

Every piece of :class:`rallypoint.workers.runtime.runtime.JobRuntime` (the scheduler, the
inputs, the router, the outbox, the checkpoint hand-off) is given the job's one
:class:`JobControl` and works under its lock. The control owns what they all read:

* ``cv``: the job's lock, a condition the device threads wait on for inputs, grants
  and the end; every field below and every piece's bookkeeping is read and written
  under it (the outbox's push threads read ``stopped`` without it, as a hint);
* who the job runs as (``cluster``, ``worker_id``, ``incarnation``) and the daemon's
  gate (:meth:`admit`), checked before each instance and each push attempt;
* ``until``: instances of steps below it may run (raised by ``RunSteps`` and ``Rewire``);
* ``stopped`` (the job was unloaded) and ``error`` (the first failure; the job runs no
  more instances after it);
* the ``InstanceDone`` feed the ``JobEvents`` streams read (:meth:`publish`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rallypoint.basics.logs import get_logger
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.gang.group import GroupLost
from rallypoint.workers.runtime.events import EventFeed
from rallypoint.workers.runtime.outlog import OutputLog

Admit = Callable[[pb.Identity], object]
"""The daemon's gate: raises (a :class:`~rallypoint.basics.errors.RallypointError`) when a request may not act."""


class JobControl:
    """The shared standing of one job on this worker (see the module doc for who reads what).

    Args:
        job: the job.
        cluster: the cluster the job runs in (``LoadJobRequest.to.cluster``).
        worker_id: this worker.
        admit: the daemon's gate.
        incarnation: this worker's current incarnation; read once here (the job's
            incarnation) and again to tell a fence from an ended incarnation.
        outlog: the job's output log; each event carries its byte counters.
    """

    def __init__(self, job: str, *, cluster: str, worker_id: str, admit: Admit, incarnation: Callable[[], int],
                 outlog: OutputLog) -> None:
        self.job = job
        self.cluster = cluster
        self.worker_id = worker_id
        self._admit = admit
        self._current_incarnation = incarnation
        self.incarnation = incarnation()
        self.log = get_logger("rallypoint.runtime", job=job, worker=worker_id, incarnation=self.incarnation)
        self._outlog = outlog
        self.cv = threading.Condition()
        self.until = 0
        self.stopped = False
        self.error = ""
        self.events = EventFeed()

    # -- the gate ---------------------------------------------------------------------------

    def admit(self) -> None:
        """Raise (a ``RallypointError``) when this incarnation may not act now: fenced, or ended."""
        self._admit(pb.Identity(cluster=self.cluster, worker_id=self.worker_id, incarnation=self.incarnation))

    def incarnation_ended(self) -> bool:
        """Whether the worker has moved on to another incarnation (this job's can never act again)."""
        return self._current_incarnation() != self.incarnation

    # -- events and failures (under ``cv``) ------------------------------------------------

    def publish(self, ev: pb.InstanceDone) -> None:
        """Hand ``ev`` to the job's event streams, with the output log's bytes now."""
        ev.log_bytes, ev.log_spilled_bytes = self._outlog.memory_bytes, self._outlog.spilled_bytes
        self.events.publish(ev)

    def fail_job(self, error: str) -> None:
        """The job failed for a reason of no single instance (the first failure counts)."""
        if not self.error:
            self.error = error
            self.log.error("job.failed", error=error)
            self.publish(pb.InstanceDone(error=error))
            self.cv.notify_all()

    def fail_instance(self, node: str, step: int, mb: int, compute_s: float, error: str,
                      cause: BaseException | None = None) -> None:
        """Instance ``(node, step, mb)`` failed, and the job with it (the first failure counts). A ``cause``
        that is a :class:`GroupLost` (its multi-host slice lost a member) is told to the leader as such."""
        if self.error:
            return
        self.error = f"{node} step {step} microbatch {mb}: {error}"
        self.log.error("instance.failed", node=node, step=step, microbatch=mb, error=error)
        ev = pb.InstanceDone(node=node, step=step, microbatch=mb, compute_s=compute_s, error=error)
        if isinstance(cause, GroupLost):
            ev.group_lost.member_worker = cause.worker
        self.publish(ev)
        self.cv.notify_all()

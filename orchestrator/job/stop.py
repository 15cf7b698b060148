"""A job stopped on request, suspended or cancelled at a step boundary: the executor's side.

The service (:mod:`~rallypoint.orchestrator.service.verbs`) takes the request, keeps it in
etcd (``control/<job>``: a new leader that adopts the job carries it out too) and hands it
to the executor (:meth:`JobStop.request`, from any thread). The executor's loop calls
:meth:`JobStop.check` on every iteration:

* A **cancel without a final checkpoint** ends the job at once, whatever it was doing
  (placing, loading, recovering): the term's next ``hold`` raises :class:`JobStopped`.
* Otherwise, once the job runs undisturbed (no recovery, no drain moving a slice), every
  worker is held at the step boundary ``s``, the grant now (no instance of ``s`` or later
  has started anywhere), and every slice saves there, as a drain does: STOPPING. When
  every instance below ``s`` is done and every slice with states committed ``s``, the
  job ends SUSPENDED or CANCELLED (:class:`JobStopped`) with its cut at ``s``. A resume
  restores that cut: nothing is replayed.
* A worker lost while the job stops is recovered like any other (STOPPING -> RECOVERING);
  the stop starts again at the next boundary once the job runs.
* When every step is granted already the job is about to end: it finishes instead (the
  request is answered by the job's end, ``job.finished``).

The executor's ``finally`` then releases every device lease and unloads every runtime,
and the final record (SUSPENDED or CANCELLED, with the request) replaces the request in etcd.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rallypoint.etcd.records import Fields
from rallypoint.orchestrator.job.grants import Hold
from rallypoint.orchestrator.job.state import JobState, JobStopped

ACTIONS = ("suspend", "cancel")


@dataclass(frozen=True)
class StopRequest:
    """A suspend or cancel asked of a job (``control/<job>`` in etcd, and the record's ``stop``).

    Attributes:
        action: ``"suspend"`` or ``"cancel"``.
        checkpoint: commit a final consistent cut before the job ends (a suspend always does).
        by: who asked: ``operator NAME``, or ``job NAME (priority P)`` for a higher-priority job.
        reason: why, in words.
        auto_resume: the leader resumes the job by itself once room returns (a priority suspend).
        at: when it was asked (seconds since the epoch, from the asker's clock).
    """

    action: str
    checkpoint: bool = False
    by: str = ""
    reason: str = ""
    auto_resume: bool = False
    at: float = 0.0  # its asker stamps it from the injected clock (0: not stamped)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"a stop's action must be one of {list(ACTIONS)}, got {self.action!r}")

    @property
    def saves(self) -> bool:
        """Whether the job commits a cut at its last boundary before it ends."""
        return self.action == "suspend" or self.checkpoint

    @property
    def ends_in(self) -> JobState:
        return JobState.SUSPENDED if self.action == "suspend" else JobState.CANCELLED

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StopRequest:
        """Raises ValueError for a request that is not one (a damaged key)."""
        return cls(action=str(d.get("action", "")), checkpoint=bool(d.get("checkpoint", False)),
                   by=str(d.get("by", "")), reason=str(d.get("reason", "")),
                   auto_resume=bool(d.get("auto_resume", False)), at=float(d.get("at", 0.0)))

    @classmethod
    def from_text(cls, text: str) -> StopRequest:
        return cls.from_json(json.loads(text))


def stop_request(text: str, log: Any) -> StopRequest | None:
    """The request kept in ``control/<job>``; None (logged) when the key holds none (a damaged key)."""
    try:
        return StopRequest.from_json(Fields("control/", text, "control").raw)
    except (ValueError, TypeError) as exc:  # BadRecord among them
        log.error("job.control_unreadable", error=str(exc), value=text[:200])
        return None


class JobStop:
    """The stop asked of one job, carried out from the executor's loop (see the module doc).

    Args:
        job: the job's name.
        placed: the slices placed now on a loaded runtime -> their lead worker (a parked slice is on none).
        progress: the job's progress (granted, completed).
        drains: the job's drains: ``reached(slices, step)``, the drains in flight. The hold at the boundary
            (grant nothing at or past it, save there) is returned by :meth:`JobStop.check`; the executor
            carries it out.
        recovery: the job's recoveries (``active``).
        interrupt: ends the job at its term's next hold with the exception given (a cancel at once).
        set_state, event, log: the executor's.
    """

    def __init__(self, job: str, *, placed: Callable[[], Mapping[str, str]], progress: Any, drains: Any,
                 recovery: Any, interrupt: Callable[[BaseException], None], set_state: Callable[..., None],
                 event: Callable[..., None], log: Any) -> None:
        self.job, self._placed, self.progress, self.drains, self.recovery = job, placed, progress, drains, recovery
        self._interrupt, self._set_state, self._event, self.log = interrupt, set_state, event, log
        self._lock = threading.Lock()
        self.pending: StopRequest | None = None
        self.boundary: int | None = None  # the step every slice saves at (STOPPING)
        self._moot = False

    def request(self, req: StopRequest | None) -> bool:
        """Take ``req`` (any thread). False: a stop is asked already (the first one stands), or none is given."""
        with self._lock:
            if req is None or self.pending is not None:
                return False
            self.pending = req
        self.log.warning("job.stop_requested", **req.to_json())
        if not req.saves:
            self._interrupt(JobStopped(JobState.CANCELLED, self._ended(req, None)))
        return True

    def _ended(self, req: StopRequest, step: int | None) -> str:
        what = "cancelled" if req.action == "cancel" else "suspended"
        where = f"at step {step} (every slice saved there)" if step is not None else "at once, without a final checkpoint"
        return f"job {self.job!r} {what} {where} by {req.by or 'an operator'}" + (f": {req.reason}" if req.reason else "")

    def check(self, state: JobState) -> Hold | None:
        """One look from the executor's loop: begin the stop (returns the hold of every placed worker at the
        boundary, for the executor to carry out), or end the job once it is saved (raises :class:`JobStopped`)."""
        req = self.pending
        if req is None or not req.saves:
            # A cancel without a final checkpoint is the interrupt's alone (request() sends it right after taking
            # the request): it never waits for a boundary, even when this look comes between the two.
            return None
        if state is JobState.STOPPING:
            assert self.boundary is not None
            if self.drains.reached(sorted(self._placed()), self.boundary):
                raise JobStopped(req.ends_in, self._ended(req, self.boundary))
            return None
        if state is not JobState.RUNNING or self.busy():
            return None  # a recovery or a drain first; the stop begins once the job runs undisturbed
        if self.progress.all_granted:
            if not self._moot:
                self._moot = True
                self.log.info("job.stop_moot", reason="every step is granted: the job finishes instead")
            return None
        return self._begin(req)

    def busy(self) -> str:
        """Why the stop cannot take its step boundary now ("" when it can)."""
        if self.recovery.active is not None:
            return f"recovery {self.recovery.active.record.number} runs"
        if any(not d.parked for d in self.drains.drains.values()):
            return self.drains.busy()
        return ""

    def _begin(self, req: StopRequest) -> Hold:
        # A drain parked for a higher-priority job ends: its slices saved already and are off every device.
        self.drains.abort(f"job {self.job!r} stops ({req.action})")
        s = self.progress.granted
        self.boundary = s
        self._set_state(JobState.STOPPING, action=req.action, boundary=s, by=req.by)
        self._event("job.stopping", step=self.progress.completed, action=req.action, boundary=s, by=req.by,
                    reason=req.reason, checkpoint=req.saves)
        return Hold(tuple(sorted(set(self._placed().values()))), s)

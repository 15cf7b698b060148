"""A drain: one job's slices on one worker move to spare devices on purpose, losing no work.

An operator (``rallypoint drain WORKER``) or a preempted worker (SIGTERM) asks for it
in etcd (:mod:`rallypoint.etcd.drains`); the executor of every job with a slice there
runs one :class:`Drain`, stepped from its loop (:meth:`Drain.step`)::

    LEASING -> SAVING --------> MOVING -> RESUMING -> DONE
       |          |  `-> PARKED -^     (a yield: the devices go first, room is found later)
       |          +----------+-------> ABORTED (a loss, or the job's end, came first)
       +--> CANCELLED (no spare, no checkpoints: nothing was changed)

* **LEASING**: lease spare devices for every slice of the job on the worker (the
  remap policy with ``on_no_spare='fail'``: a drain never waits). None: CANCELLED with
  the reason, nothing changed. Else the worker is held at the drain step ``s``: its
  grant stays at ``s`` (the executor's grant now, so no instance of ``s`` or later
  has started there) and every slice of it saves at ``s``, a checkpoint outside the
  every-K schedule, committed like any other.
* **SAVING**: until every instance of the worker's nodes below ``s`` is reported done
  and each of its slices with states committed ``s``. The slices are paused from then.
* **PARKED** (a yield to a higher-priority job, ``park=True``): no spare is leased
  first; once saved, the worker is unloaded and the slices' devices released for the
  job that asked. The slices wait, the rest of the job runs as far as its inputs
  allow, until that job has placed itself and room appears again (the same count,
  or fewer when the job shrinks), which the drain leases.
* **MOVING**: the spares load the slices from the checkpoint at ``s``, survivors are
  rewired and send their logged outputs of steps ``>= s``; the drained worker is
  unloaded (after its pushes arrived) and its device leases are released. Nothing
  replays: no instance at ``s`` or later had run on the drained worker.
* **RESUMING**: until a spare reports its first instance of a moved slice. The
  slices' pause (``paused_s``) runs from their last instance below ``s`` (or the
  hold, if they were already waiting there) to that first instance.

A drain is not a recovery: nothing is lost, so nothing is fenced and no cut moves. If
the drained worker is lost before MOVING ends, the recovery takes over (ABORTED), and
the request, still in etcd, is taken up again afterwards.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.etcd.drains import DrainRequest
from rallypoint.recovery.load_plan import SlicePlace


class DrainPhase(enum.Enum):
    LEASING = "leasing"
    SAVING = "saving"
    PARKED = "parked"
    MOVING = "moving"
    RESUMING = "resuming"
    DONE = "done"
    CANCELLED = "cancelled"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in (DrainPhase.DONE, DrainPhase.CANCELLED, DrainPhase.ABORTED)


D = DrainPhase
TRANSITIONS: dict[DrainPhase, frozenset[DrainPhase]] = {
    D.LEASING: frozenset({D.SAVING, D.CANCELLED, D.ABORTED}),
    D.SAVING: frozenset({D.MOVING, D.PARKED, D.ABORTED}),
    D.PARKED: frozenset({D.MOVING, D.ABORTED}),
    D.MOVING: frozenset({D.RESUMING, D.ABORTED}),
    D.RESUMING: frozenset({D.DONE}),
    D.DONE: frozenset(),
    D.CANCELLED: frozenset(),
    D.ABORTED: frozenset(),
}


class DrainPort(abc.ABC):
    """What a drain needs of its job; the executor implements it, tests fake it."""

    placement: Mapping[str, SlicePlace]  # read-only: the placement's owner applies a move

    @abc.abstractmethod
    def drain_step(self) -> int:
        """The step a drained worker stops at: the grant now (no instance of it or later has started)."""

    @abc.abstractmethod
    def why_not_drainable(self, slices: list[str]) -> str:
        """Why these slices cannot be drained ("" when they can): e.g. the job keeps no checkpoints."""

    @abc.abstractmethod
    def lease_spares(self, need: Mapping[str, int], exclude: frozenset[str]) -> dict[str, SlicePlace] | str:
        """Lease devices for each slice of ``need`` now (no waiting), or say why there are none."""

    @abc.abstractmethod
    def release_spares(self, places: Mapping[str, SlicePlace]) -> None:
        """Give back spare devices a drain leased and did not use."""

    @abc.abstractmethod
    def hold(self, worker: str, step: int | None) -> None:
        """Grant ``worker`` no step at or past ``step`` and have it save there (None: lift the hold)."""

    @abc.abstractmethod
    def reached(self, slices: list[str], step: int) -> bool:
        """Every instance of the slices' nodes below ``step`` is done and each slice with states committed ``step``."""

    @abc.abstractmethod
    def move(self, worker: str, places: Mapping[str, SlicePlace], step: int) -> None:
        """Load ``places`` from the checkpoint at ``step``, rewire, unload ``worker`` and release its leases.

        Raises :class:`~rallypoint.orchestrator.job.failures.WorkerCallFailed` (the executor turns it into a loss).
        """

    @abc.abstractmethod
    def park(self, worker: str, slices: list[str], step: int) -> None:
        """Unload ``worker`` (after its pushes arrived) and release the slices' devices; they wait to be placed."""

    @abc.abstractmethod
    def room_for(self, need: Mapping[str, int], slices: list[str]) -> dict[str, SlicePlace] | None:
        """Lease room for parked slices once the job they yielded to no longer waits (None: not yet)."""

    @abc.abstractmethod
    def loaded_workers(self) -> list[str]:
        """The workers whose runtimes the job uses now."""


@dataclass
class DrainRecord:
    """One drain, measured (monotonic marks; see the module doc for ``paused_s``)."""

    number: int
    worker: str
    reason: str
    request_revision: int
    started_mono: float
    slices: list[str] = field(default_factory=list)
    step: int = 0
    moved: dict[str, str] = field(default_factory=dict)  # slice -> new worker
    state: str = D.LEASING.value
    detail: str = ""
    marks: dict[str, float] = field(default_factory=dict)
    # started, held (the hold sent), last_done (a moved slice's last instance below the step),
    # saved (all done and committed), moved (the spares loaded), first_run (a spare's first instance)

    def to_json(self) -> dict[str, Any]:
        m = self.marks

        def span(a: str, b: str) -> float | None:
            return round(m[b] - m[a], 4) if a in m and b in m else None

        halted = "last_done" if "last_done" in m else "held"
        return {"drain": self.number, "worker": self.worker, "reason": self.reason, "slices": self.slices,
                "step": self.step, "moved": self.moved, "state": self.state, "detail": self.detail,
                "save_s": span(halted, "saved"), "move_s": span("saved", "moved"),
                "paused_s": span(halted, "first_run"), "total_s": span("started", "first_run"),
                "replayed_instances": 0 if self.state == "done" else None}


class Drain:
    """One drain of one job's slices on one worker (see the module doc)."""

    def __init__(self, port: DrainPort, number: int, request: DrainRequest, *, clock: Clock, log: Any,
                 only: list[str] | None = None, target: Mapping[str, int] | None = None, park: bool = False) -> None:
        """``only``: move just these slices of the worker (default: all of the job's there);
        ``target``: their device counts on the spares (default: the counts they have; a
        grow asks for more); ``park``: give the devices up first, find room later (a yield)."""
        self.port, self.clock, self.log = port, clock, log
        self.only, self.target, self.park = only, dict(target or {}), park
        self.need: dict[str, int] = {}
        self.request = request
        self.phase = D.LEASING
        self.spares: dict[str, SlicePlace] = {}
        # The worker whose runtime drives the slices: the drained one, or, when that is a member of multi-host
        # slices another worker leads, their lead (held, saved and unloaded in its place; docs/multihost.md).
        self.lead = request.worker
        now = clock.monotonic()
        self.record = DrainRecord(number, request.worker, request.reason, request.revision, now,
                                  marks={"started": now})

    @property
    def worker(self) -> str:
        return self.request.worker

    def _set(self, new: DrainPhase, detail: str = "") -> None:
        if new not in TRANSITIONS[self.phase]:
            raise AssertionError(f"drain {self.record.number}: no transition {self.phase.value} -> {new.value}")
        old, self.phase = self.phase, new
        self.record.state = new.value
        if detail:
            self.record.detail = detail
        self.log.info("drain.state", drain=self.record.number, worker=self.worker, previous=old.value,
                      state=new.value, **({"detail": detail} if detail else {}))

    def step(self) -> DrainPhase:
        """Advance as far as the job allows now; returns the phase."""
        if self.phase is D.LEASING:
            self._lease()
        if self.phase is D.SAVING and self.port.reached(self.record.slices, self.record.step):
            self.record.marks["saved"] = self.clock.monotonic()
            if self.park:
                self.port.park(self.lead, self.record.slices, self.record.step)
                self._set(D.PARKED)
            else:
                self._set(D.MOVING)
        if self.phase is D.PARKED:
            got = self.port.room_for(self.need, self.record.slices)
            if got is None:
                return self.phase
            self.spares = got
            self.record.marks["room"] = self.clock.monotonic()
            self._set(D.MOVING)
        if self.phase is D.MOVING:
            self.port.move(self.lead, self.spares, self.record.step)
            self.record.moved = {s: p.worker for s, p in self.spares.items()}
            self.record.marks["moved"] = self.clock.monotonic()
            self._set(D.RESUMING)
        if self.phase is D.RESUMING and "first_run" in self.record.marks:
            self._set(D.DONE)
        return self.phase

    def observe(self, worker: str, slice_name: str, step: int) -> None:
        """An instance of ``slice_name`` at ``step`` done on ``worker``: the pause's two ends."""
        rec = self.record
        if slice_name not in rec.slices:
            return
        if self.phase is D.SAVING and worker == self.lead and step < rec.step:
            rec.marks["last_done"] = max(self.clock.monotonic(), rec.marks.get("held", 0.0))
        elif self.phase is D.RESUMING and worker == rec.moved.get(slice_name):
            rec.marks.setdefault("first_run", self.clock.monotonic())

    def _lease(self) -> None:
        port, rec = self.port, self.record
        placed = port.placement
        led = [s for s, p in placed.items() if p.worker == self.worker]
        if not led:  # a member of multi-host slices: their gangs move whole, driven by their lead
            led = [s for s, p in placed.items() if any(m.worker == self.worker for m in p.members)]
            led = [s for s in led if placed[s].worker == placed[led[0]].worker]  # one lead's (a next drain: others)
        rec.slices = sorted(s for s in led if self.only is None or s in self.only)
        self.lead = placed[rec.slices[0]].worker if rec.slices else self.worker
        why = port.why_not_drainable(rec.slices) if rec.slices else f"the job holds no slice on worker {self.worker}"
        if why:
            self._set(D.CANCELLED, why)
            return
        need = self.need = {s: self.target.get(s, port.placement[s].count) for s in rec.slices}
        if self.park:  # room is found after the devices went to the job that asked for them
            rec.step = port.drain_step()
            port.hold(self.lead, rec.step)
            rec.marks["held"] = self.clock.monotonic()
            self._set(D.SAVING)
            return
        # A new gang shares no worker with the old one: the old one's leases there go whole when the drain moves it.
        members = {m.worker for s in rec.slices for m in placed[s].members}
        got = port.lease_spares(need, frozenset(port.loaded_workers()) | {self.worker} | members)
        if isinstance(got, str):
            self._set(D.CANCELLED, f"cannot drain worker {self.worker}: {got}")
            return
        self.spares = got
        rec.step = port.drain_step()
        port.hold(self.lead, rec.step)
        rec.marks["held"] = self.clock.monotonic()
        self._set(D.SAVING)

    @property
    def parked(self) -> list[str]:
        """The slices this drain holds off every device right now (a recovery must place them)."""
        return list(self.record.slices) if self.phase is D.PARKED else []

    def abort(self, reason: str) -> None:
        """A loss or the job's end came first: give back what the drain took; the request stays in etcd."""
        if self.phase.is_terminal:
            return
        if self.phase is D.RESUMING:  # the slices had moved: the drain is done, only its measure is cut short
            self._set(D.DONE, f"done; the pause was not measured to its end: {reason}")
            return
        if self.spares and self.phase is not D.MOVING:
            self.port.release_spares(self.spares)
        if self.phase is D.SAVING:
            self.port.hold(self.lead, None)
        self._set(D.ABORTED, reason)

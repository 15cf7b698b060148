"""A job's recoveries: one :class:`~rallypoint.orchestrator.job.recovery_machine.Recovery` per loss, and their records.

:class:`JobRecoveries` owns the machines of every recovery the job has run and their
records (``records``, what ``job.finished`` and the job record report). It opens a
recovery (:meth:`open`: the newest supersedes any still measuring its replay), runs it
until the lost slices run again (:meth:`run`), and passes on what the executor hears
while they replay and catch up (:meth:`observe`, :meth:`first_call`, :meth:`progressed`). A stall is judged here too
(:meth:`stalled`): a setback of its own source, decided like any other. Beside each
recovery's budget, the job's failure policy (:class:`~rallypoint.recovery.decide.FailurePolicy`)
bounds the recoveries in a sliding window, faults and preemptions apart: :meth:`open`
fails the job, listing them, on one too many.
Each machine acts on the job only through the job's
:class:`~rallypoint.orchestrator.job.recovery_machine.RecoveryPort`.

A job adopted from a lost or deposed leader carries that leader's recoveries on
(:meth:`adopt`): they stay in the records, new ones are numbered after them, and one the
old leader had not seen to its end (``mttr_s`` null: it was replaying or catching up, or
still restoring, when the term ended) is finished by the adopting leader: ``adopted_by_term``
names the term that adopted it, its phases are those the old leader saw, and its
``mttr_s`` runs from the loss (wall clock) to the first step the adopted job completes
(:meth:`adopted_running`), with ``finished_by: "adoption"``.

What the executor hears per instance touches only the recoveries it can concern: those not
yet done or failed (at most the newest, in practice), and for a first call the one recovery
that loaded that runtime (found by its worker and generation). A job's thousandth recovery
costs each instance what its first did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.orchestrator.job.hooks import ExecutorHooks
from rallypoint.orchestrator.job.recovery import RecoveryRecord
from rallypoint.orchestrator.job.state import JobFailed
from rallypoint.orchestrator.job.recovery_machine import Recovery, RecoveryPort
from rallypoint.orchestrator.job.watchdog import ProgressWatchdog
from rallypoint.recovery.decide import (Budget, Decision, Disruption, FailurePolicy, FailureWindow, Setback, Verdict,
                                        decide)


class JobRecoveries:
    """The recoveries of one job (see the module doc)."""

    def __init__(self, port: RecoveryPort, *, budget: Budget, clock: Clock, log: Any, microbatches: int,
                 hooks: ExecutorHooks = ExecutorHooks(),
                 on_replayed: Callable[[RecoveryRecord], None] = lambda _: None) -> None:
        self.port, self.budget, self.clock, self.log, self.hooks = port, budget, clock, log, hooks
        self.on_replayed = on_replayed  # a recovery's lost work is redone: its MTTR is known (the job's metrics)
        self.microbatches = microbatches
        self.machines: list[Recovery] = []
        self.records: list[RecoveryRecord] = []
        self.adopted: list[dict[str, Any]] = []  # an earlier term's recoveries, as its job record had them
        self._open_adopted: list[dict[str, Any]] = []  # of those, the ones the earlier term did not finish
        self._live: list[Recovery] = []  # the machines not yet done or failed
        self._by_runtime: dict[tuple[str, int], RecoveryRecord] = {}  # (worker, generation) -> the recovery that loaded it
        self.window = FailureWindow(FailurePolicy())

    def _prune(self) -> None:
        if any(m.phase.is_terminal for m in self._live):
            self._live = [m for m in self._live if not m.phase.is_terminal]

    def configure(self, policy: FailurePolicy) -> None:
        """The job's failure policy (from its settings)."""
        self.window = FailureWindow(policy)

    @property
    def active(self) -> Recovery | None:
        """The recovery still restoring, replaying or catching up, if any."""
        return next((m for m in self._live if not m.phase.is_terminal), None)

    def to_json(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.adopted] + [r.to_json() for r in self.records]

    def entries(self) -> list[Any]:
        """Every recovery of the job, oldest first, each with ``to_json()``: the adopted ones, then this term's."""
        return [_Adopted(r) for r in self.adopted] + list(self.records)

    def adopt(self, earlier: list[dict[str, Any]], term: int) -> None:
        """The recoveries an earlier term recorded for this job; those it did not finish, this term finishes."""
        self.adopted = [dict(r) for r in earlier if isinstance(r, dict) and "recovery" in r]
        self._open_adopted = []
        for r in self.adopted:
            if r.get("mttr_s") is None and "finished_by" not in r:
                r["adopted_by_term"] = term
                self._open_adopted.append(r)

    def adopted_running(self, step: int) -> None:
        """The adopted job completed ``step``: the recoveries the earlier term left open end now."""
        now = self.clock.wall()
        for r in self._open_adopted:
            r["mttr_s"] = round(max(0.0, now - float(r.get("detected_at", now))), 4)
            r["finished_by"], r["running_again_at_step"] = "adoption", step
            self.log.info("recovery.finished_on_adoption", recovery=r["recovery"], mttr_s=r["mttr_s"], step=step)
        self._open_adopted = []

    def open(self, lost: Mapping[str, str], detection_s: float, *, preempted: bool = False) -> RecoveryRecord:
        """A new recovery of ``lost`` (worker -> why; ``preempted``: every one of them was); any earlier one still
        measuring its replay ends there. Raises :class:`JobFailed` when the job's failure policy allows no more."""
        now = self.clock.monotonic()
        number = max([r.number for r in self.records] + [int(r["recovery"]) for r in self.adopted], default=0) + 1
        why = "; ".join(f"{w}: {r}" for w, r in sorted(lost.items()))
        fail = self.window.admit(Disruption(number, now, preempted, why))
        if fail is not None:
            self.log.error("job.failure_policy", reason=fail.reason, preempted=preempted)
            raise JobFailed(fail.reason)
        rec = RecoveryRecord(number=number, lost={}, reasons=dict(lost), detected_at=self.clock.wall(),
                             detected_mono=now, detection_s=detection_s)
        self.supersede(f"recovery {rec.number} started")
        self.records.append(rec)
        return rec

    def run(self, rec: RecoveryRecord, lost: Mapping[str, str], *, policy: str, frontier: Mapping[str, int],
            parked: Iterable[str] = (), unload: Iterable[str] = ()) -> None:
        """Run the recovery ``rec`` until the lost slices run again (raises :class:`JobFailed` if it fails);
        ``unload``: the workers of ``lost`` that are alive (``recovery_machine.Fencing``)."""
        machine = Recovery(self.port, rec, lost, policy=policy, budget=self.budget, clock=self.clock, log=self.log,
                           frontier=frontier, microbatches=self.microbatches, hooks=self.hooks, parked=parked,
                           unload=unload)
        self.machines.append(machine)
        self._live.append(machine)
        try:
            machine.run_to_replay()
        finally:
            for worker, generation in rec.generations.items():
                self._by_runtime[(worker, generation)] = rec
            self._prune()

    def stalled(self, quiet_s: float, watchdog: ProgressWatchdog, blamed: Mapping[str, str],
                completed: int) -> tuple[str, Decision]:
        """No progress for ``quiet_s``: why, naming the workers the job waits on (``blamed``), and what to do
        (:func:`~rallypoint.recovery.decide.decide` on a stall, counted by the watchdog)."""
        reason = (f"no progress for {quiet_s:.1f}s (stall timeout {watchdog.timeout_s:g}s) at step {completed}: "
                  + ("; ".join(f"{w}: {why}" for w, why in sorted(blamed.items())) or "no node is behind"))
        decision = decide(Setback(Verdict.STALL, workers=dict(blamed), detail=reason), watchdog.stalls, self.budget)
        self.log.warning("job.stalled", reason=reason, stalls=watchdog.stalls, limit=self.budget.stall,
                         decision=type(decision).__name__)
        return reason, decision

    def observe(self, worker: str, generation: int, node: str, step: int) -> None:
        for m in self._live:
            replaying = "replay" not in m.record.marks
            m.observe(worker, generation, node, step)
            if replaying and "replay" in m.record.marks:
                self.on_replayed(m.record)
        self._prune()

    def first_call(self, worker: str, generation: int, slice_name: str, source: str, compile_s: float) -> None:
        """A node's first call on a runtime: where its executable came from (warm spares)."""
        rec = self._by_runtime.get((worker, generation))
        if rec is not None:
            rec.first_call(worker, generation, slice_name, source, compile_s)
            return
        for m in self._live:  # a runtime loaded by a recovery still under way
            m.record.first_call(worker, generation, slice_name, source, compile_s)

    def progressed(self) -> None:
        for m in self._live:
            m.progressed()
        self._prune()

    def supersede(self, reason: str) -> None:
        """A newer loss, or the job's end: every recovery's measured phases end here."""
        for m in self._live:
            m.supersede(reason)
        self._prune()


class _Adopted:
    """An earlier term's recovery, as the job record has it (finished by this term when it was left open)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def to_json(self) -> dict[str, Any]:
        return dict(self.record)

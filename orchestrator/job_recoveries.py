"""A job's recoveries: one :class:`~rallypoint.orchestrator.recovery_machine.Recovery` per loss, and their records.

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
:class:`~rallypoint.orchestrator.recovery_machine.RecoveryPort`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from rallypoint.basics.clock import Clock
from rallypoint.orchestrator.hooks import ExecutorHooks
from rallypoint.orchestrator.job_recovery import RecoveryRecord
from rallypoint.orchestrator.job_state import JobFailed
from rallypoint.orchestrator.recovery_machine import Recovery, RecoveryPort
from rallypoint.orchestrator.watchdog import ProgressWatchdog
from rallypoint.recovery.decide import (Budget, Decision, Disruption, FailurePolicy, FailureWindow, Setback, Source,
                                        decide)


class JobRecoveries:
    """The recoveries of one job (see the module doc)."""

    def __init__(self, port: RecoveryPort, *, budget: Budget, clock: Clock, log: Any, microbatches: int,
                 hooks: ExecutorHooks = ExecutorHooks()) -> None:
        self.port, self.budget, self.clock, self.log, self.hooks = port, budget, clock, log, hooks
        self.microbatches = microbatches
        self.machines: list[Recovery] = []
        self.records: list[RecoveryRecord] = []
        self.window = FailureWindow(FailurePolicy())

    def configure(self, policy: FailurePolicy) -> None:
        """The job's failure policy (from its settings)."""
        self.window = FailureWindow(policy)

    @property
    def active(self) -> Recovery | None:
        """The recovery still restoring, replaying or catching up, if any."""
        return next((m for m in self.machines if not m.phase.is_terminal), None)

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records]

    def open(self, lost: Mapping[str, str], detection_s: float, *, preempted: bool = False) -> RecoveryRecord:
        """A new recovery of ``lost`` (worker -> why; ``preempted``: every one of them was); any earlier one still
        measuring its replay ends there. Raises :class:`JobFailed` when the job's failure policy allows no more."""
        now = self.clock.monotonic()
        why = "; ".join(f"{w}: {r}" for w, r in sorted(lost.items()))
        fail = self.window.admit(Disruption(len(self.records) + 1, now, preempted, why))
        if fail is not None:
            self.log.error("job.failure_policy", reason=fail.reason, preempted=preempted)
            raise JobFailed(fail.reason)
        rec = RecoveryRecord(number=len(self.records) + 1, lost={}, reasons=dict(lost), detected_at=time.time(),
                             detected_mono=now, detection_s=detection_s)
        self.supersede(f"recovery {rec.number} started")
        self.records.append(rec)
        return rec

    def run(self, rec: RecoveryRecord, lost: Mapping[str, str], *, policy: str, frontier: Mapping[str, int],
            parked: Iterable[str] = ()) -> None:
        """Run the recovery ``rec`` until the lost slices run again (raises :class:`JobFailed` if it fails)."""
        machine = Recovery(self.port, rec, lost, policy=policy, budget=self.budget, clock=self.clock, log=self.log,
                           frontier=frontier, microbatches=self.microbatches, hooks=self.hooks, parked=parked)
        self.machines.append(machine)
        machine.run_to_replay()

    def stalled(self, quiet_s: float, watchdog: ProgressWatchdog, blamed: Mapping[str, str],
                completed: int) -> tuple[str, Decision]:
        """No progress for ``quiet_s``: why, naming the workers the job waits on (``blamed``), and what to do
        (:func:`~rallypoint.recovery.decide.decide` on a stall, counted by the watchdog)."""
        reason = (f"no progress for {quiet_s:.1f}s (stall timeout {watchdog.timeout_s:g}s) at step {completed}: "
                  + ("; ".join(f"{w}: {why}" for w, why in sorted(blamed.items())) or "no node is behind"))
        decision = decide(Setback(Source.STALL, workers=dict(blamed), detail=reason), watchdog.stalls, self.budget)
        self.log.warning("job.stalled", reason=reason, stalls=watchdog.stalls, limit=self.budget.stall,
                         decision=type(decision).__name__)
        return reason, decision

    def observe(self, worker: str, generation: int, node: str, step: int) -> None:
        for m in self.machines:
            m.observe(worker, generation, node, step)

    def first_call(self, worker: str, generation: int, slice_name: str, source: str, compile_s: float) -> None:
        """A node's first call on a runtime: where its executable came from (warm spares)."""
        for m in self.machines:
            m.record.first_call(worker, generation, slice_name, source, compile_s)

    def progressed(self) -> None:
        for m in self.machines:
            m.progressed()

    def supersede(self, reason: str) -> None:
        """A newer loss, or the job's end: every recovery's measured phases end here."""
        for m in self.machines:
            m.supersede(reason)

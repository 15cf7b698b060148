"""The job record's lists, of a fixed size however long the job runs (``jobs/<job>`` in etcd), and the
run's event log beside its checkpoints (``events.jsonl``, what ``rallypoint logs`` prints).

The executor writes the job record every few steps and on every change of state
(:meth:`~rallypoint.orchestrator.job.executor.JobExecutor.record`). Its recoveries, failures and
drains grow with the job's life, so the record carries only the newest of each
(:data:`RECENT_RECOVERIES`, :data:`RECENT_FAILURES`, :data:`RECENT_DRAINS`) and a summary of
the older ones (``recoveries_earlier``, ``failures_earlier``, ``drains_earlier``). Every
recovery that leaves the newest ones is appended, once, to ``<run_dir>/recoveries.jsonl``
(:data:`HISTORY_FILE`), and when the job ends the rest follow: the full history lies beside
the checkpoints (a job without checkpoints has no run directory and keeps only the summary).

The work per record is bounded too: each recovery is summarised and written once, when it
leaves the window, never again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rallypoint.basics.clock import SYSTEM_CLOCK, Clock
from rallypoint.basics.errors import NotLeader, StoreError
from rallypoint.etcd.keys import Keys
from rallypoint.etcd.store import Delete, Put
from rallypoint.orchestrator.job.recovery import RecoveryRecord
from rallypoint.orchestrator.job.view import JobView

RECENT_RECOVERIES = 8  # recoveries the record carries in full (the newest)
RECENT_FAILURES = 16  # worker failures it carries in full
RECENT_DRAINS = 8  # drains it carries in full
HISTORY_FILE = "recoveries.jsonl"  # in the run directory: one JSON line per recovery, oldest first
EVENTS_FILE = "events.jsonl"  # in the run directory: one JSON line per job event but step.done (metrics.jsonl has those)


class RecordHistory:
    """What one executor's job record says of its past (see the module doc).

    Args:
        term: the executor's term, on each line of the history file (an adopted job's
            recoveries are numbered from 1 again under the next term).
        log: the executor's bound logger.
    """

    def __init__(self, *, term: int, log: Any) -> None:
        self.term, self.log = term, log
        self._folded = 0  # recoveries[:_folded] are summarised in `earlier`
        self._written = 0  # recoveries[:_written] are in the history file
        self._adopted_earlier = False  # `earlier` holds an adopted job's summary from the term before
        self.earlier: dict[str, Any] = {"count": 0, "first": None, "last": None, "workers_lost": 0,
                                        "policies": {}, "escalated": 0, "mttr_s_max": None, "mttr_s_sum": 0.0,
                                        "with_mttr": 0}

    def adopt(self, earlier: dict[str, Any] | None) -> None:
        """An adopted job: the earlier term's summary of its older recoveries (already in the history file)."""
        if earlier:
            self.earlier = {k: v for k, v in earlier.items() if k != "history"}
            self._adopted_earlier = True

    def fields(self, recoveries: Sequence[RecoveryRecord], failures: Sequence[dict[str, Any]],
               drains: Sequence[Any], run_dir: Path | None, *, final: bool = False) -> dict[str, Any]:
        """The record's ``recoveries``, ``failures``, ``drains`` and their summaries; with ``final``
        (the job ended), every recovery not yet in the history file is written there too."""
        while len(recoveries) - self._folded > RECENT_RECOVERIES:
            self._fold(recoveries[self._folded].to_json(), run_dir)
        if final:
            self._write(recoveries, len(recoveries), run_dir)
        out: dict[str, Any] = {
            "recoveries": [r.to_json() for r in recoveries[self._folded:]],
            "failures": [dict(f) for f in failures[-RECENT_FAILURES:]],
            "drains": [d.to_json() for d in drains[-RECENT_DRAINS:]],
        }
        if self._folded or self._adopted_earlier:
            out["recoveries_earlier"] = {**self.earlier, "history": str(run_dir / HISTORY_FILE) if run_dir else ""}
        if len(failures) > RECENT_FAILURES:
            out["failures_earlier"] = len(failures) - RECENT_FAILURES
        if len(drains) > RECENT_DRAINS:
            out["drains_earlier"] = len(drains) - RECENT_DRAINS
        return out

    def _fold(self, r: dict[str, Any], run_dir: Path | None) -> None:
        e = self.earlier
        e["count"] += 1
        e["first"] = r["recovery"] if e["first"] is None else e["first"]
        e["last"] = r["recovery"]
        e["workers_lost"] += len(r.get("lost") or r.get("reasons") or {})
        policy = r.get("policy") or "none"
        e["policies"][policy] = e["policies"].get(policy, 0) + 1
        e["escalated"] += 1 if r.get("escalated") else 0
        mttr = r.get("mttr_s")
        if mttr is not None:
            e["with_mttr"] += 1
            e["mttr_s_sum"] = round(e["mttr_s_sum"] + mttr, 4)
            e["mttr_s_max"] = mttr if e["mttr_s_max"] is None else max(e["mttr_s_max"], mttr)
        if self._written <= self._folded:
            self._append(r, run_dir)
            self._written = self._folded + 1
        self._folded += 1

    def _write(self, recoveries: Sequence[RecoveryRecord], upto: int, run_dir: Path | None) -> None:
        while self._written < upto:
            self._append(recoveries[self._written].to_json(), run_dir)
            self._written += 1

    def _append(self, r: dict[str, Any], run_dir: Path | None) -> None:
        if run_dir is None:
            return
        try:
            with open(run_dir / HISTORY_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps({"term": self.term, **r}) + "\n")
        except OSError as exc:  # the history is a record of the past; the job goes on without it
            self.log.warning("job.history_write_failed", path=str(run_dir / HISTORY_FILE), error=str(exc))


class EventLog:
    """``<run dir>/events.jsonl``: every event of the run but ``step.done``, one JSON object a line
    (``{"t", "event", "step", "term", **detail}``), appended by each executor of the run (a resume, a
    new leader). Writing never fails the job: a refused line is logged once and the next is tried."""

    def __init__(self, *, term: int, log: Any, clock: Clock = SYSTEM_CLOCK) -> None:
        self.term, self.log, self.clock = term, log, clock
        self.path: Path | None = None
        self._failed = False

    def open(self, run_dir: Path | None) -> None:
        self.path = run_dir / EVENTS_FILE if run_dir is not None else None

    def tee(self, emit: Callable[[Any], None]) -> Callable[[Any], None]:
        """``emit`` that first writes the event (a :class:`pb.JobEvent`) to the log."""
        def emit_and_log(ev: Any) -> None:
            self.observe(ev.event, int(ev.step), ev.detail)
            emit(ev)
        return emit_and_log

    def observe(self, event: str, step: int, detail: str) -> None:
        if self.path is None or event == "step.done":
            return
        try:
            fields = json.loads(detail or "{}")
        except ValueError:
            fields = {"detail": detail}
        line = {"t": round(self.clock.wall(), 3), "event": event, "step": step, "term": self.term,
                **(fields if isinstance(fields, dict) else {"detail": fields})}
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:
            if not self._failed:
                self._failed = True
                self.log.warning("job.events_write_failed", path=str(self.path), error=str(exc))


def record_of(v: JobView, history: RecordHistory, **fields: Any) -> dict[str, Any]:
    """The job record of view ``v`` (``jobs/<job>`` in etcd), assembled from the owner of each fact: what a
    new leader adopts from, and what ``rallypoint jobs`` and ``status`` show. ``history`` keeps its lists
    bounded (and, once the job ended, writes the rest of its recoveries to the run directory)."""
    return {
        "job": v.job, "state": v.state.value, "steps": v.steps, "step_done": v.completed,
        "term": v.term, "run": v.run_id, "run_dir": str(v.run_dir or ""), "cut": v.cut,
        "policy": v.policy, "priority": v.priority,
        "code_sha256": v.code_sha256,  # the code bundle every load of the run uses
        "spec_sha256": v.spec_sha256,  # its jobspec.pb: a resume or adoption checks the file against it
        "placement": {s: {"worker": q.worker, "devices": list(q.devices),
                          **({"members": [{"worker": m.worker, "devices": list(m.devices)} for m in q.members]}
                             if q.members else {})} for s, q in v.placement.items()},
        **history.fields(v.recovery_entries, v.failures, v.drain_records, v.run_dir,
                         final=v.state.is_terminal),  # bounded: the newest in full
        "replayed_instances": dict(v.replayed), "resharded": [r.to_json() for r in v.resharded],
        "submit_id": v.submit_id, "owner": v.owner, "started_at": v.started_at,  # the run's first start (a resume keeps it)
        **({"stop": v.stop.to_json()} if v.stop is not None else {}),
        **dict(v.integrity),  # the run's skipped stream positions and rollbacks (job/rollback.py)
        **({"ended_at": v.at} if v.state.is_terminal else {}), "at": v.at, **fields,
    }


class JobRecorder:
    """Writes the job record (``jobs/<job>`` in etcd): :func:`record_of` the executor's view, under its term.

    Args:
        keys: the cluster's key schema; ``txn``: the term's fenced transaction.
        view: the job now (:meth:`JobExecutor.view`); ``window``: the steps in flight now.
        history: the record's bounded lists.
    """

    def __init__(self, job: str, *, keys: Keys, txn: Callable[..., Any], view: Callable[[], JobView],
                 window: Callable[[], int], history: RecordHistory, log: Any) -> None:
        self.job, self.keys, self.txn, self.view, self.window, self.history, self.log = \
            job, keys, txn, view, window, history, log

    def record(self, **fields: Any) -> None:
        """The record, written once; the final one takes a suspend or cancel asked from etcd with it (carried out,
        or moot). Raises what the term's transaction raises (etcd away, the term over)."""
        v = self.view()
        done = [Delete(self.keys.control(self.job))] if v.state.is_terminal else []  # moot, or carried out
        self.txn([Put(self.keys.job(self.job), json.dumps(record_of(v, self.history, window=self.window(), **fields))),
                  *done])

    def quietly(self, **fields: Any) -> None:
        """The record, unless etcd is away or the term over (the next record catches up)."""
        try:
            self.record(**fields)
        except (StoreError, NotLeader) as exc:
            self.log.warning("job.record_failed", error=str(exc))

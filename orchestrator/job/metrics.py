"""A job's per-step metrics: ``metrics.jsonl`` in its run directory, and what a non-finite value does.

:class:`JobMetrics` sees every event the executor emits (:meth:`JobMetrics.tee` wraps its
``emit``) and appends to ``<run dir>/metrics.jsonl`` (``orchestrator/job/runs.py``), one JSON
object a line (docs/metrics.md, "Per-step metrics"):

* ``{"step": 12, "t": 1796354594.4, "metrics": {"loss": 0.53}}``: a completed step and its
  metrics (the mean over microbatches, as ``step.done`` carries them); a value that is not
  finite is written as the string ``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has no such numbers);
* ``{"event": "fault", "t", "step", "recovery", "workers", "cause"}``: workers lost at ``step`` (``job.recovering``);
* ``{"event": "recovery", "recovery", "t", "ended_t", "step", "from_step", "cause", "replayed"}``:
  the lost slices run again (``job.recovered``): hit at ``step``, restored from the cut at
  ``from_step``, ``replayed`` instances planned to run again, detected at ``t``, running at ``ended_t``;
* ``{"event": "replayed", "recovery", "t", "step", "from_step", "mttr_s"}``: that recovery's lost work is
  redone (its replay phase ended): ``mttr_s`` is its MTTR, the loss to the lost work redone;
* ``{"event": "drain", "drain", "t", "step", "worker", "cause", "paused_s"}``: a drain moved slices off a worker;
* ``{"event": "spike", "t", "step", "metric", "value", "baseline", "action"}``: a loss spike (job/rollback.py);
  ``{"event": "rollback", "rollback", "t", "step", "from_step", "skipped_steps"}``: the job rolled back from the
  spike at ``step`` to the cut at ``from_step``, the batches of steps ``skipped_steps[0] .. [1] - 1`` skipped;
* ``{"event": "stall", "t", "step", "cause"}``, ``{"event": "nonfinite", "t", "step", "metric",
  "value", "action"}``, and ``{"event": "resumed" | "adopted", "t", "step"}`` (a run that goes on
  from the cut at ``step``: ``rallypoint resume``, or a new leader).

The file is a log: a step replayed after a recovery or an adoption may complete again and
is written again; readers (:func:`read_metrics`) take the last value per step. A new
leader adopting the job, or a resume, appends to the same file. Writing never fails the
job: a file system that refuses a line is logged once (``job.metrics_write_failed``) and
the next lines are tried again. The same records go to the job's trackers (``JobSpec.metrics_sinks``:
TensorBoard, W&B; :mod:`rallypoint.orchestrator.job.sinks`), each step once.

A metric value of an instance that is not finite (each ``InstanceDone`` is checked as it
arrives, :meth:`JobMetrics.check`): with ``on_nonfinite = "warn"`` a ``job.nonfinite`` event,
once per metric, and the job goes on; with ``"stop"`` (the default) the job stops there.
:class:`JobMetrics` only decides; the executor carries it out: :meth:`JobMetrics.check` returns
the value that stops the job, the executor halts the grants there (no grant widens, no commit
past that step moves the cut), unloads every worker (a save in flight finishes and commits
before its UnloadJob returns), and asks :meth:`JobMetrics.stop` what is left: a
:class:`NonFiniteStop` naming the commits past that step to drop (etcd and the copies beside
the checkpoints) and the cut the job keeps. The job then fails naming the metric, the value,
the step and the cut kept. That failure blames no worker and starts no recovery.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rallypoint.etcd.commits import CheckpointCommit, consistent_cut
from rallypoint.orchestrator.job.sinks import Sinks, open_sinks
from rallypoint.orchestrator.job.state import STREAM_END_EVENTS
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.nonfinite import NonFinite, NonFiniteGuard, nonfinite_values, stopped_at
from rallypoint.recovery.slices import stateful_slices

METRICS_FILE = "metrics.jsonl"
END_EVENTS = STREAM_END_EVENTS  # the executor's last event: the file closes (a resume opens it again)


def encode_value(v: float) -> float | str:
    """A metric value as JSON can carry it: a number, or "nan" / "inf" / "-inf"."""
    return float(v) if math.isfinite(v) else repr(float(v))


def decode_value(v: Any) -> float | None:
    """A value written by :func:`encode_value` (None: not a number at all)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return None


# -- the file -----------------------------------------------------------------------------------


class MetricsLog:
    """Appends JSON lines to one file; never raises (the first failure is logged, later lines tried again)."""

    def __init__(self, path: Path | None, log: Any) -> None:
        self.path, self.log = path, log
        self._file: IO[str] | None = None
        self.failures = 0

    def write(self, record: Mapping[str, Any]) -> bool:
        if self.path is None:
            return False
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
            return True
        except (OSError, ValueError) as exc:
            self.failures += 1
            if self.failures == 1:
                self.log.warning("job.metrics_write_failed", path=str(self.path), error=str(exc),
                                 hint="the job goes on; later lines are tried again")
            self.close()
            return False

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


@dataclass
class MetricsRun:
    """What a run's ``metrics.jsonl`` holds, read back: the last value per step of each metric, and the marks."""

    values: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> step -> its last value
    times: dict[int, float] = field(default_factory=dict)  # step -> when it (last) completed
    marks: list[dict[str, Any]] = field(default_factory=list)  # faults, recoveries, stalls, ... (event lines)
    skipped: int = 0  # lines that were not a record (a line cut short by a crash)

    @property
    def names(self) -> list[str]:
        return sorted(self.values)

    @property
    def steps(self) -> list[int]:
        return sorted(self.times)

    def curve(self, metric: str) -> list[tuple[int, float]]:
        """``(step, value)`` of ``metric`` by step, the last value written for each step."""
        return sorted(self.values.get(metric, {}).items())

    def recoveries(self) -> list[dict[str, Any]]:
        """The recoveries, one per number (its ``recovery`` line, else its ``fault`` line), oldest first."""
        by_number: dict[Any, dict[str, Any]] = {}
        for m in self.marks:
            if m.get("event") == "recovery" or (m.get("event") == "fault" and m.get("recovery") not in by_number):
                by_number[m.get("recovery", len(by_number))] = m
        return list(by_number.values())

    def plot_marks(self) -> list[dict[str, Any]]:
        """What a plot marks, oldest first, each ``{kind, step, label}`` (``kind`` "recovery" also has
        ``from_step``, ``recovery`` and ``mttr_s``: the span from the cut it restored to the step it was hit at,
        replayed; its label "replayed from S, MTTR x s", the MTTR once its ``replayed`` line is there): the shape
        :func:`rallypoint.orchestrator.observe.metrics_svg.metrics_svg` draws."""
        mttr = {m.get("recovery"): m.get("mttr_s") for m in self.marks
                if m.get("event") == "replayed" and isinstance(m.get("mttr_s"), (int, float))}
        out: list[dict[str, Any]] = []
        for m in self.marks:
            kind, step = str(m.get("event", "")), m.get("step")
            if not isinstance(step, int):
                continue
            if kind == "fault":
                workers = ", ".join(map(str, m.get("workers") or []))
                out.append({"kind": "fault", "step": step, "label": f"lost {workers}".strip()})
            elif kind == "recovery":
                start, took = int(m.get("from_step") or 0), mttr.get(m.get("recovery"))
                out.append({"kind": "recovery", "step": step, "from_step": start, "recovery": m.get("recovery"),
                            "mttr_s": took, "label": f"replayed from {start}"
                            + (f", MTTR {float(took):.2f} s" if took is not None else "")})
            elif kind == "drain":
                out.append({"kind": "drain", "step": step, "label": f"drained {m.get('worker', '')}".strip()})
            elif kind == "nonfinite":
                out.append({"kind": "nonfinite", "step": step, "label": f"{m.get('metric', '')} {m.get('value', '')}"})
            elif kind == "spike":
                out.append({"kind": "spike", "step": step, "label": f"spike {m.get('metric', '')} {m.get('value', '')}"})
            elif kind == "rollback":
                first, last = (m.get("skipped_steps") or [None, None])[:2]
                out.append({"kind": "rollback", "step": step, "label": f"rolled back to {m.get('from_step')}"
                            + (f", skipped {first}..{last - 1}" if isinstance(first, int) and isinstance(last, int)
                               else "")})
            elif kind in ("stall", "resumed", "adopted"):
                out.append({"kind": kind, "step": step, "label": kind})
        return out


def parse_metrics(lines: Iterable[str]) -> MetricsRun:
    """The records of ``metrics.jsonl`` lines (see the module doc); unreadable lines are counted, not raised."""
    run = MetricsRun()
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            run.skipped += 1
            continue
        if not isinstance(rec, dict):
            run.skipped += 1
        elif "event" in rec:
            run.marks.append(rec)
        elif isinstance(rec.get("step"), int) and isinstance(rec.get("metrics"), dict):
            step = int(rec["step"])
            run.times[step] = float(rec.get("t") or 0.0)
            for name, v in rec["metrics"].items():
                value = decode_value(v)
                if value is not None:
                    run.values.setdefault(str(name), {})[step] = value
        else:
            run.skipped += 1
    return run


def read_metrics(path: Path) -> MetricsRun:
    """:func:`parse_metrics` of the file at ``path`` (OSError when it cannot be read)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_metrics(f)


# -- the executor's collaborator ----------------------------------------------------------------------


def nonfinite(item: pb.InstanceDone) -> list[NonFinite]:
    """The metric values of ``item`` that are not finite, by metric name."""
    return nonfinite_values(item.metrics, int(item.step), item.node, int(item.microbatch))


@dataclass(frozen=True)
class NonFiniteStop:
    """What stopping a job at a non-finite value leaves for the executor to carry out.

    Attributes:
        step: the step the value was at (the grants halted there).
        drop: the commits past ``step`` (slice, step), each to drop in etcd and in the progress.
        cut: the consistent cut the job's becomes (None: the cut stays where it is).
        commits: slice -> the commit steps that still count (at or before ``step``).
        reason: the job's failure (naming the metric, its value, the step and the cut kept).
    """

    step: int
    drop: tuple[tuple[str, int], ...] = ()
    cut: int | None = None
    commits: Mapping[str, list[int]] = field(default_factory=dict)
    reason: str = ""


def nonfinite_stop(bad: NonFinite, slices: list[str], cut: int,
                   commits: Mapping[str, list[CheckpointCommit]]) -> NonFiniteStop:
    """The stop at ``bad.step`` of a job whose slices with states are ``slices``, with the cut ``cut`` and its
    ``commits`` (read after every worker unloaded): every commit past the step goes, and the newest consistent
    cut left at or before it is the one kept. The job's cut becomes it: up to it when its commit landed while
    the workers unloaded, down to it when the cut had passed the step (only possible when the metric's slice
    keeps no states)."""
    head = stopped_at(bad)
    if not slices:
        return NonFiniteStop(bad.step, reason=head + "no consistent cut was committed at or before it: fix the "
                                                     "cause and run the job again (--new-run)")
    s = bad.step
    drop = tuple((slice_name, c.step) for slice_name, cs in commits.items() for c in cs if c.step > s)
    kept = {slice_name: [c for c in cs if c.step <= s] for slice_name, cs in commits.items()}
    new = consistent_cut(kept, slices)
    moved = (new if new is not None else min(cut, s)) != cut
    reason = head + ("no consistent cut was committed at or before it: fix the cause and run the job again "
                     "(--new-run)" if new is None else
                     f"the last committed cut, step {new}, is kept: fix the cause and resume from it")
    return NonFiniteStop(s, drop, (new or 0) if moved else None,
                         {sl: [c.step for c in cs] for sl, cs in kept.items()}, reason)


def nonfinite_not_dropped(bad: NonFinite, job: str, error: BaseException) -> str:
    """The failure's reason when the commits past ``bad.step`` could not be dropped (etcd away, the term over)."""
    return stopped_at(bad) + (f"the commits past it could not be dropped ({error}): before resuming, check with "
                               f"`rallypoint status {job}` that its consistent cut is not past step {bad.step}")


class JobMetrics:
    """One job's ``metrics.jsonl`` and its non-finite guard (see the module doc).

    It moves none of the job's facts: a non-finite value that stops the job is returned
    (:meth:`check`) and the executor carries the stop out (:meth:`stop` says what it drops and keeps).

    Args:
        spec: the job.
        log: the executor's logger.
        event: the executor's ``event(name, step, **detail)``.
    """

    def __init__(self, spec: pb.JobSpec, *, log: Any, event: Callable[..., None],
                 wall: Callable[[], float] = time.time) -> None:
        self.spec, self.log = spec, log
        self.event, self.wall = event, wall
        self.guard = NonFiniteGuard()
        self.file = MetricsLog(None, log)
        self.sinks = Sinks([], log)  # the job's trackers (TensorBoard, W&B), opened with the file
        self._hit: dict[int, int] = {}  # recovery -> the step it was detected at
        self._from: dict[int, int] = {}  # recovery -> the cut it restored
        self._observe_failed = False

    def open(self, run_dir: Path | None, mode: str) -> None:
        """The run's directory (None: the job keeps no files) and its ``on_nonfinite`` mode."""
        self.guard = NonFiniteGuard(mode)
        self.file = MetricsLog(run_dir / METRICS_FILE if run_dir is not None else None, self.log)
        self.sinks.close()
        self.sinks = open_sinks(self.spec, run_dir, self.log)

    def tee(self, emit: Callable[[pb.JobEvent], None]) -> Callable[[pb.JobEvent], None]:
        """``emit`` that first writes what ``metrics.jsonl`` keeps of each event."""
        def emit_and_keep(ev: pb.JobEvent) -> None:
            self.observe(ev)
            emit(ev)
        return emit_and_keep

    # -- writing -----------------------------------------------------------------------------

    def observe(self, ev: pb.JobEvent) -> None:
        """One event of the job; never raises (the file must never break the job)."""
        try:
            self._observe(ev)
        except Exception as exc:  # noqa: BLE001
            if not self._observe_failed:
                self._observe_failed = True
                self.log.warning("job.metrics_observe_failed", event_name=ev.event, error=repr(exc))

    def _observe(self, ev: pb.JobEvent) -> None:
        name, now, step = ev.event, self.wall(), int(ev.step)
        if name == "step.done":
            self.file.write({"step": step, "t": round(now, 3),
                             "metrics": {k: encode_value(v) for k, v in sorted(ev.metrics.items())}})
            self.sinks.metrics(step, dict(ev.metrics), now)
            return
        if name in END_EVENTS:
            self.file.close()
            self.sinks.close()
            return
        if name not in ("job.recovering", "job.recovered", "job.stalled", "job.nonfinite", "job.resumed",
                        "job.adopted", "job.drained", "job.spike", "job.rolled_back"):
            return
        d = json.loads(ev.detail or "{}")
        if name == "job.recovering":
            n = int(d.get("recovery", 0))
            self._hit[n] = step
            self._mark({"event": "fault", "t": round(now, 3), "step": step, "recovery": n,
                        "workers": sorted(d.get("lost") or {}), "cause": _cause(d.get("lost") or {})})
        elif name == "job.recovered":
            n = int(d.get("recovery", 0))
            self._from[n] = int(d.get("checkpoint_step", 0))
            self._mark({"event": "recovery", "recovery": n, "t": round(float(d.get("detected_at") or now), 3),
                        "ended_t": round(now, 3), "step": self._hit.get(n, step),
                        "from_step": int(d.get("checkpoint_step", 0)), "cause": _cause(d.get("reasons") or {}),
                        "replayed": int(sum((d.get("planned_instances") or {}).values())),
                        "policy": d.get("policy", "")})
        elif name == "job.drained":
            self._mark({"event": "drain", "drain": d.get("drain"), "t": round(now, 3), "step": step,
                        "worker": d.get("worker", ""), "cause": str(d.get("reason", "")),
                        "paused_s": d.get("paused_s")})
        elif name == "job.spike":
            self._mark({"event": "spike", "t": round(now, 3), "step": step, "metric": d.get("metric"),
                        "value": d.get("value"), "baseline": d.get("baseline"), "action": d.get("action")})
        elif name == "job.rolled_back":
            self._mark({"event": "rollback", "rollback": d.get("rollback"), "t": round(now, 3), "step": step,
                        "from_step": d.get("cut"), "skipped_steps": d.get("skipped_steps")})
        elif name == "job.stalled":
            self._mark({"event": "stall", "t": round(now, 3), "step": step, "cause": str(d.get("reason", ""))})
        elif name == "job.nonfinite":
            self._mark({"event": "nonfinite", "t": round(now, 3), "step": step, "metric": d.get("metric"),
                        "value": d.get("value"), "node": d.get("node"), "action": d.get("action")})
        else:
            self._mark({"event": name.removeprefix("job."), "t": round(now, 3), "step": step})

    def _mark(self, rec: dict[str, Any]) -> None:
        self.file.write(rec)
        self.sinks.event(int(rec["step"]), str(rec["event"]), rec, float(rec["t"]))

    def replayed(self, record: Any) -> None:
        """A recovery's lost work is redone (its ``RecoveryRecord`` has its replay phase): its MTTR is known.
        Never raises."""
        try:
            n = int(record.number)
            d = record.to_json()
            self._mark({"event": "replayed", "recovery": n, "t": round(self.wall(), 3),
                        "step": self._hit.get(n, 0), "from_step": self._from.get(n, int(record.checkpoint_step)),
                        "mttr_s": d.get("mttr_s")})
        except Exception as exc:  # noqa: BLE001
            self.log.warning("job.metrics_observe_failed", event_name="replayed", error=repr(exc))

    # -- non-finite values ----------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``stop`` or ``warn``."""
        return self.guard.mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self.guard.mode = mode

    def check(self, item: pb.InstanceDone) -> NonFinite | None:
        """An instance's metrics as they arrive: a value that is not finite warns once per metric
        (``warn``) or, with ``stop``, is returned: the executor stops the job there (:meth:`stop`)."""
        if not item.metrics:
            return None
        report, stop = self.guard.check(nonfinite(item))
        for bad in report:
            detail = {"metric": bad.metric, "value": repr(bad.value), "node": bad.node,
                      "microbatch": bad.microbatch, "action": self.mode}
            (self.log.error if bad is stop else self.log.warning)("job.nonfinite", step=bad.step, **detail)
            self.event("job.nonfinite", step=bad.step, **detail)
        return stop

    def stop(self, bad: NonFinite, cut: int,
             commits: Callable[[], Mapping[str, list[CheckpointCommit]]]) -> NonFiniteStop:
        """Once every worker unloaded: what stopping at ``bad.step`` drops and keeps (:func:`nonfinite_stop`;
        ``commits`` reads the job's commits, only when it has slices with states)."""
        slices = stateful_slices(self.spec)
        return nonfinite_stop(bad, slices, cut, commits() if slices else {})

    def not_dropped(self, bad: NonFinite, error: BaseException) -> str:
        """The failure's reason when the commits past the step could not be dropped (logged)."""
        self.log.warning("job.nonfinite_commits_not_dropped", step=bad.step, error=str(error))
        return nonfinite_not_dropped(bad, self.spec.job, error)


def _cause(reasons: Mapping[str, Any]) -> str:
    """``{worker: why}`` (or ``{worker: [slices]}``) as one line."""
    return "; ".join(f"{w}: {why if isinstance(why, str) else ', '.join(map(str, why))}"
                     for w, why in sorted(reasons.items()))


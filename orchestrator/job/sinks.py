"""Trackers: where a job's metrics and marks go besides ``metrics.jsonl`` (docs/metrics.md, "Trackers").

A job asks for them in its ``JobSpec.metrics_sinks`` (``rallypoint run --tensorboard DIR``,
``--wandb DIR``; ``submit(..., tensorboard=DIR, wandb=DIR)``). The leading coordinator's
:class:`~rallypoint.orchestrator.job.metrics.JobMetrics` opens them with the run's
``metrics.jsonl`` and hands each the same records: every completed step's metrics
(:meth:`MetricsSink.metrics`) and the job's marks (:meth:`MetricsSink.event`: ``fault``,
``recovery``, ``replayed``, ``drain``, ``stall``, ``nonfinite``, ``resumed``, ``adopted``, with
the detail ``metrics.jsonl`` keeps). Each sink writes under ``DIR/<job>/<run id>/``; a new
leader (or a resume) opens the same directory again and goes on there.

A sink writes each step once: a step completed again (replayed after a recovery, or
after an adoption) carries the same values (the bitwise invariant), so a step at or
below the last one written is skipped, and a sink that goes on in a directory first
reads which steps are there. A sink never fails the job: :class:`Sinks` logs a sink's
first failure and drops that sink.

Another tracker (MLflow, ...) is a class with the three methods of :class:`MetricsSink`
and a constructor ``(directory, job=, run=)``, added to :data:`KINDS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rallypoint.orchestrator.job import tfevents
from rallypoint.proto import rallypoint_pb2 as pb

MARK_PREFIX = "rallypoint/"  # the tags of the marks; a job's own metrics are the other tags
EVENTS_TAG = MARK_PREFIX + "events"  # a text summary per mark
WANDB_STEP_FILE = "rallypoint-wandb-step"  # the last step a W&B sink logged, for the next writer


class MetricsSink(Protocol):
    """A tracker of one job's run."""

    def metrics(self, step: int, values: Mapping[str, float], *, t: float | None = None) -> None:
        """Step ``step`` completed with these metric values (the same values again for a replayed step)."""

    def event(self, step: int, kind: str, detail: Mapping[str, Any], *, t: float | None = None) -> None:
        """A mark at ``step``: ``kind`` and its ``metrics.jsonl`` record."""

    def close(self) -> None:
        """The run ends here (or this coordinator stops leading it)."""


def describe(kind: str, step: int, d: Mapping[str, Any]) -> str:
    """A mark as one line of text."""
    if kind == "fault":
        return f"step {step}: lost {', '.join(map(str, d.get('workers') or [])) or 'workers'} ({d.get('cause', '')})"
    if kind == "recovery":
        return (f"step {step}: recovery {d.get('recovery', '')} restored the cut at step {d.get('from_step')} "
                f"and replays from there ({d.get('cause', '')})")
    if kind == "replayed":
        mttr = d.get("mttr_s")
        return (f"step {step}: recovery {d.get('recovery', '')} replayed from step {d.get('from_step')}"
                + (f", MTTR {float(mttr):.2f} s" if mttr is not None else ""))
    if kind == "drain":
        return f"step {step}: drained {d.get('worker', '')} ({d.get('cause', '')})"
    if kind == "nonfinite":
        return f"step {step}: {d.get('metric')} is {d.get('value')} ({d.get('action')})"
    return f"step {step}: {kind}" + (f" ({d['cause']})" if d.get("cause") else "")


def mark_scalars(kind: str, d: Mapping[str, Any]) -> dict[str, float]:
    """The scalars a mark adds at its step (TensorBoard's scalar dashboard draws them beside the loss)."""
    if kind == "fault":
        return {MARK_PREFIX + "lost_workers": float(len(d.get("workers") or []))}
    if kind == "recovery":
        return {MARK_PREFIX + "recovery_from_step": float(d.get("from_step") or 0)}
    if kind == "replayed" and d.get("mttr_s") is not None:
        return {MARK_PREFIX + "recovery_mttr_s": float(d["mttr_s"])}
    if kind == "drain":
        return {MARK_PREFIX + "drains": 1.0}
    return {}


class TensorBoardSink:
    """TensorBoard event files in ``directory`` (a new file per writer; see module doc and tfevents.py)."""

    def __init__(self, directory: Path, *, job: str = "", run: str = "",
                 wall: Callable[[], float] = time.time) -> None:
        self.directory, self.wall = directory, wall
        self.written_through = -1  # the last step whose metrics are in the directory's files
        if directory.is_dir():
            for f in sorted(directory.glob(tfevents.FILE_PREFIX + "*")):
                for ev in tfevents.read_events(f):
                    if any(not t.startswith(MARK_PREFIX) for t in ev.tags):
                        self.written_through = max(self.written_through, ev.step)
        self._writer: tfevents.EventFileWriter | None = None

    def _write(self, t: float | None, step: int, values: list[bytes]) -> None:
        if self._writer is None:
            self._writer = tfevents.EventFileWriter(self.directory, wall=self.wall())
        self._writer.write(tfevents.event(self.wall() if t is None else t, step, values))

    def metrics(self, step: int, values: Mapping[str, float], *, t: float | None = None) -> None:
        if step <= self.written_through or not values:
            return
        self._write(t, step, [tfevents.scalar_value(k, float(v)) for k, v in sorted(values.items())])
        self.written_through = step

    def event(self, step: int, kind: str, detail: Mapping[str, Any], *, t: float | None = None) -> None:
        values = [tfevents.scalar_value(k, v) for k, v in mark_scalars(kind, detail).items()]
        self._write(t, step, values + [tfevents.text_value(EVENTS_TAG, describe(kind, step, detail))])

    def close(self) -> None:
        w, self._writer = self._writer, None
        if w is not None:
            w.close()


class WandbSink:
    """A W&B run in offline mode (``mode="offline"``, as ``WANDB_MODE=offline``) under ``directory``
    (``wandb sync`` uploads it later).

    Only where ``wandb`` is importable (it is not a dependency of Rallypoint): otherwise the
    constructor raises ImportError, which :func:`open_sinks` logs. A new leader resumes the same
    run id (``resume="allow"``; ``wandb sync`` joins the offline runs of one id); the last step
    logged is kept in :data:`WANDB_STEP_FILE` beside them (an offline run cannot ask the server), and
    steps at or below it are skipped, as W&B refuses steps that go back. Several jobs of one
    coordinator each hold a run (``reinit="create_new"``, wandb >= 0.19).
    """

    def __init__(self, directory: Path, *, job: str = "", run: str = "") -> None:
        import wandb  # ImportError: the sink is not available here

        directory.mkdir(parents=True, exist_ok=True)
        self._step_file = directory / WANDB_STEP_FILE
        self.written_through = int(self._step_file.read_text()) if self._step_file.is_file() else -1
        run_id = f"{job}-{run}".strip("-") or "run"
        self._run = wandb.init(project=job or "rallypoint", name=run or job, id=run_id, dir=str(directory),
                               mode="offline", resume="allow", reinit="create_new")

    def _logged(self, step: int) -> None:
        self.written_through = step
        self._step_file.write_text(f"{step}\n")

    def metrics(self, step: int, values: Mapping[str, float], *, t: float | None = None) -> None:
        if step <= self.written_through or not values:
            return
        self._run.log(dict(values), step=step)
        self._logged(step)

    def event(self, step: int, kind: str, detail: Mapping[str, Any], *, t: float | None = None) -> None:
        # W&B steps only go forward: a mark goes to the run's summary and, as scalars, at the next step logged.
        scalars = mark_scalars(kind, detail)
        if scalars and step > self.written_through:
            self._run.log(scalars, step=step)
            self._logged(step)
        self._run.summary[f"{MARK_PREFIX}{kind}_{step}"] = describe(kind, step, detail)

    def close(self) -> None:
        self._run.finish()


KINDS: dict[str, Callable[..., MetricsSink]] = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


def sink_directory(sink: pb.MetricsSink, job: str, run: str) -> Path:
    """Where ``sink`` writes: ``DIR/<job>/<run id>``."""
    return Path(sink.dir) / job / run


class Sinks:
    """The sinks of one run; a sink that raises is logged once and dropped (the job never fails for one)."""

    def __init__(self, sinks: list[tuple[str, MetricsSink]], log: Any) -> None:
        self.sinks, self.log = sinks, log

    def _each(self, call: Callable[[MetricsSink], None]) -> None:
        for entry in list(self.sinks):
            name, sink = entry
            try:
                call(sink)
            except Exception as exc:  # noqa: BLE001 - the tracker's failure is not the job's
                self.log.warning("job.metrics_sink_failed", sink=name, error=repr(exc),
                                 hint="the job goes on without this tracker")
                self.sinks.remove(entry)
                try:
                    sink.close()
                except Exception:  # noqa: BLE001
                    pass

    def metrics(self, step: int, values: Mapping[str, float], t: float) -> None:
        self._each(lambda s: s.metrics(step, values, t=t))

    def event(self, step: int, kind: str, detail: Mapping[str, Any], t: float) -> None:
        self._each(lambda s: s.event(step, kind, detail, t=t))

    def close(self) -> None:
        self._each(lambda s: s.close())
        self.sinks = []


def open_sinks(spec: pb.JobSpec, run_dir: Path | None, log: Any) -> Sinks:
    """The sinks ``spec`` asks for, opened for the run in ``run_dir``; one that cannot open is logged and left out."""
    out: list[tuple[str, MetricsSink]] = []
    # A job that keeps no run directory (no checkpoint root) cannot be resumed or adopted past step 0: each of its
    # runs writes a directory of its own, never skipping steps an earlier run of the same name wrote.
    run = run_dir.name if run_dir is not None else f"unsaved-{int(time.time())}"
    for s in spec.metrics_sinks:
        make = KINDS.get(s.kind)
        where = sink_directory(s, spec.job, run)
        try:
            if make is None:
                raise ValueError(f"unknown metrics sink {s.kind!r}; known: {sorted(KINDS)}")
            out.append((f"{s.kind}:{where}", make(where, job=spec.job, run=run)))
        except Exception as exc:  # noqa: BLE001
            log.warning("job.metrics_sink_unavailable", sink=s.kind, dir=str(where), error=repr(exc),
                        hint="the job goes on without this tracker")
    return Sinks(out, log)

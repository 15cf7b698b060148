"""What the leader's dashboard shows of the jobs it runs: a bounded recorder fed by the executors' events.

The job service (``service/jobs.py``) passes every :class:`pb.JobEvent` an executor emits to
:meth:`TimelineRecorder.observe`, with the executor's :class:`~rallypoint.orchestrator.job.view.JobView`
of that moment, on the executor's own thread, before its clients get it.
The recorder keeps, per job: its state and progress, the steps per second, the devices it
holds, its recoveries (with phases and MTTR), drains, failures and stalls, and a timeline
in the shape of a chaos report's summary (``progress`` points per node, ``faults``,
``recoveries``) that :func:`rallypoint.orchestrator.observe.timeline_svg.timeline_svg` draws, and the
curve of each metric against the step (``step.done``'s metrics, what ``metrics.jsonl`` keeps too)
with the faults and recoveries marked at their steps, which
:func:`rallypoint.orchestrator.observe.metrics_svg.metrics_svg` draws.

Everything is bounded: at most ``max_points`` progress points per job and as many points
per metric (when full, every other point is dropped, so the whole run stays visible at a
coarser grain), the last ``MAX_MARKS`` marks, the last
``max_events`` events, and the ``keep_ended`` most recent ended jobs. Reading
(:meth:`TimelineRecorder.jobs`) takes a lock and copies; it may run on any thread.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rallypoint.basics.logs import get_logger
from rallypoint.orchestrator.job.state import STREAM_END_EVENTS
from rallypoint.orchestrator.job.view import JobView
from rallypoint.proto import rallypoint_pb2 as pb

MAX_POINTS = 600  # progress points kept per job (all nodes together)
MAX_EVENTS = 40  # recent events kept per job
MAX_MARKS = 40  # faults, stalls and non-finite values marked on the metric curves, per job
KEEP_ENDED = 8  # ended jobs kept
SAMPLE_S = 0.1  # per-node progress is sampled at most this often on step.done (always on other events)
RATE_WINDOW_S = 5.0  # steps/s is measured over the steps done in the last this many seconds
END_EVENTS = STREAM_END_EVENTS  # the executor's last event (job/state.py)


@dataclass
class JobTimeline:
    """One job as the dashboard shows it (plain data; see :meth:`to_json`)."""

    job: str
    started_at: float
    steps: int = 0
    priority: int = 0
    state: str = "placing"
    step_done: int = 0
    ended_at: float | None = None
    adopted: bool = False
    placement: dict[str, dict[str, Any]] = field(default_factory=dict)
    recoveries: dict[int, dict[str, Any]] = field(default_factory=dict)
    drains: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    stalls: int = 0
    reason: str = ""
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (time, step of each node)
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    done_times: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=512))
    sampled_at: float = float("-inf")
    curves: dict[str, list[tuple[int, float | None]]] = field(default_factory=dict)  # metric -> (step, value)
    marks: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_MARKS))

    def progress(self) -> list[dict[str, Any]]:
        """The samples as a chaos report's ``progress`` points: ``{t, node, step}``."""
        return [{"t": at, "node": n, "step": s} for at, steps in self.samples for n, s in steps.items()]

    def steps_per_s(self, now: float) -> float | None:
        """Steps done per second over the last ``RATE_WINDOW_S`` (None before two steps)."""
        recent = [(t, s) for t, s in self.done_times if t >= now - RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return None
        return round((recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]), 3)

    def to_json(self, now: float) -> dict[str, Any]:
        recoveries = [self.recoveries[n] for n in sorted(self.recoveries)]
        return {
            "job": self.job, "state": self.state, "priority": self.priority, "steps": self.steps,
            "step_done": self.step_done, "steps_per_s": self.steps_per_s(self.ended_at or now),
            "devices_held": sum(len(p.get("devices", ())) for p in self.placement.values()),
            "placement": self.placement, "adopted": self.adopted, "recoveries": recoveries,
            "drains": list(self.drains), "failures": list(self.failures), "stalls": self.stalls,
            "reason": self.reason, "started_at": self.started_at, "ended_at": self.ended_at,
            "events": list(self.events),
            # The metric curves by step (None: not finite) and what is marked on them (metrics_svg draws them).
            "metrics": {n: [[s, v] for s, v in points] for n, points in sorted(self.curves.items())},
            "marks": [*self.marks, *({"kind": "recovery", "step": r["at_step"], "from_step": r["checkpoint_step"],
                                      "label": f"recovery {r['recovery']}"} for r in recoveries
                                     if "at_step" in r and "restore" in (r.get("phases") or {}))],
            # The timeline, in the shape of a chaos report's summary (timeline_svg draws it).
            "timeline": {"started_at": self.started_at, "ended_at": self.ended_at or now,
                         "job": {"name": self.job, "steps": self.steps}, "progress": self.progress(),
                         "faults": list(self.faults), "recoveries": recoveries},
        }


class TimelineRecorder:
    """The jobs this coordinator runs or ran lately, fed by :meth:`observe` (see the module docstring)."""

    def __init__(self, *, max_points: int = MAX_POINTS, keep_ended: int = KEEP_ENDED,
                 wall: Callable[[], float] = time.time) -> None:
        self.max_points, self.keep_ended, self.wall = max_points, keep_ended, wall
        self._jobs: OrderedDict[str, JobTimeline] = OrderedDict()
        self._lock = threading.Lock()
        self.log = get_logger("rallypoint.dashboard")

    def observe(self, view: JobView | None, ev: pb.JobEvent) -> None:
        """One event of a job, with the job's ``view`` as its executor holds it then (None: the event alone);
        called on the executor's thread; never raises."""
        try:
            self._observe(view, ev)
        except Exception as exc:  # the dashboard must never break a job
            self.log.warning("dashboard.observe_failed", job=ev.job, event_name=ev.event, error=repr(exc))

    def _observe(self, x: JobView | None, ev: pb.JobEvent) -> None:
        now = self.wall()
        detail = _detail(ev)
        with self._lock:
            t = self._jobs.get(ev.job)
            if t is None or (t.ended_at is not None and ev.event not in END_EVENTS):
                t = self._jobs[ev.job] = JobTimeline(job=ev.job, started_at=now)
            self._jobs.move_to_end(ev.job)
            self._apply(t, x, ev, detail, now)
            self._trim()

    def _apply(self, t: JobTimeline, x: JobView | None, ev: pb.JobEvent, detail: dict[str, Any], now: float) -> None:
        if x is not None:
            t.steps, t.priority, t.adopted = x.steps, x.priority, x.adopted
            t.state, t.step_done = x.state.value, x.completed
        name = ev.event
        if name == "step.done":
            t.done_times.append((now, int(ev.step) + 1))
            self._curves(t, int(ev.step), ev.metrics)
        else:
            t.events.append({"t": now, "event": name, "step": int(ev.step)})
        if name == "job.recovering":
            n = int(detail.get("recovery", len(t.recoveries) + 1))
            t.recoveries[n] = {"recovery": n, "detected_at": now, "lost": detail.get("lost", {}), "mttr_s": None,
                               "phases": {}, "at_step": int(ev.step)}
            for worker, why in (detail.get("lost") or {}).items():
                t.faults.append({"kind": "lost", "target": worker, "at": now, "healed_at": None, "reason": str(why)})
            lost = ", ".join(detail.get("lost") or ())
            t.marks.append({"kind": "fault", "step": int(ev.step), "label": f"lost {lost}"})
        elif name == "job.recovered":
            n = int(detail.get("recovery", 0))
            t.recoveries[n] = {**t.recoveries.get(n, {}), **{k: v for k, v in detail.items() if k != "placement"}}
        elif name == "job.stalled":
            t.faults.append({"kind": "stall", "target": f"step {ev.step}", "at": now, "healed_at": None})
            t.marks.append({"kind": "stall", "step": int(ev.step), "label": "stall"})
        elif name == "job.nonfinite":
            t.marks.append({"kind": "nonfinite", "step": int(ev.step),
                            "label": f"{detail.get('metric', '')} {detail.get('value', '')}"})
        elif name in ("job.resumed", "job.adopted"):
            kind = name.removeprefix("job.")
            t.marks.append({"kind": kind, "step": int(ev.step), "label": kind})
        elif name in ("job.drained", "job.drain_cancelled"):
            t.drains.append(detail)
        elif name in END_EVENTS:
            t.ended_at = now
            t.state = {"job.finished": "succeeded", "job.failed": "failed", "job.suspended": "suspended",
                       "job.cancelled": "cancelled"}.get(name, "handed_off")
            t.reason = str(detail.get("reason", ""))
            if name == "job.finished":
                t.step_done = int(ev.step)
        if x is None:
            return
        self._snapshot(t, x)
        if name != "step.done" or now - t.sampled_at >= SAMPLE_S or t.step_done >= t.steps:
            self._sample(t, x, now)

    def _snapshot(self, t: JobTimeline, x: JobView) -> None:
        """What the executor held when it sent the event (its view)."""
        t.placement = {s: {"worker": p.worker, "incarnation": int(p.incarnation), "devices": list(p.devices)}
                       for s, p in x.placement.items()}
        t.failures = [dict(f) for f in x.failures]
        t.stalls = x.stalls
        for r in x.recoveries:
            rec = r.to_json()
            t.recoveries[rec["recovery"]] = {**t.recoveries.get(rec["recovery"], {}), **rec}

    def _sample(self, t: JobTimeline, x: JobView, now: float) -> None:
        """One progress point per node: the step below which every instance is done."""
        if not x.done_through:
            return
        t.sampled_at = now
        t.samples.append((now, dict(x.done_through)))
        if sum(len(steps) for _, steps in t.samples) > self.max_points:
            # every other sample, the first and the newest kept: coarser, never shorter
            t.samples = [t.samples[0], *t.samples[1:-1][1::2], t.samples[-1]]

    def _curves(self, t: JobTimeline, step: int, metrics: Any) -> None:
        """A completed step's metrics on the curves; a step completed again (a replay) replaces its value."""
        for name, v in metrics.items():
            points = t.curves.setdefault(name, [])
            while points and points[-1][0] >= step:
                points.pop()
            points.append((step, float(v) if math.isfinite(v) else None))
            if len(points) > self.max_points:  # every other point, the first and the newest kept
                t.curves[name] = [points[0], *points[1:-1][1::2], points[-1]]

    def _trim(self) -> None:
        ended = [j for j, t in self._jobs.items() if t.ended_at is not None]
        for j in ended[: max(0, len(ended) - self.keep_ended)]:
            del self._jobs[j]

    def jobs(self) -> list[dict[str, Any]]:
        """Every job recorded, running ones first, as plain JSON-able dicts (any thread)."""
        now = self.wall()
        with self._lock:
            out = [t.to_json(now) for t in self._jobs.values()]
        return sorted(out, key=lambda j: (j["ended_at"] is not None, -(j["ended_at"] or j["started_at"])))


def _detail(ev: pb.JobEvent) -> dict[str, Any]:
    if not ev.detail:
        return {}
    try:
        d = json.loads(ev.detail)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}

"""Goodput buckets and step times of one job: plain arithmetic over what the executor keeps, no I/O.

The coordinator's Prometheus collector (:mod:`rallypoint.orchestrator.observe.metrics`) renders
these; ``docs/metrics.md`` defines each bucket. In short, per job, in seconds:

* ``productive``: compute seconds of first runs of instances, summed over slices
  (``JobExecutor.compute_s``; the device-seconds the chaos report calls *useful*);
* ``replayed``: compute seconds of instances run again after a recovery
  (``JobExecutor.redone_s``);
* ``recovery``: wall seconds from a loss to its lost work redone (each recovery's
  detection, fencing, remap, restore and replay phases: its MTTR), less the time it
  waited for a spare;
* ``waiting_for_spares``: wall seconds recoveries waited for a worker with room;
* ``checkpoint_blocking``: slice-seconds the slices' device loops were held by
  checkpoint saves (until Orbax had its host copy): measured by the workers, which
  export it in the same family (``workers/metrics.py``).

:func:`goodput_ratio` is ``productive / (productive + replayed)``: the chaos report's
``goodput`` (``chaos/runner.py``: device-seconds of first runs over all), computed live
from the executor's counts instead of the workers' instance records.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rallypoint.orchestrator.job.recovery import PHASES, RecoveryRecord

BUCKETS = ("productive", "replayed", "recovery", "waiting_for_spares", "checkpoint_blocking")
COORDINATOR_BUCKETS = BUCKETS[:4]  # the last one comes from the workers
MTTR_PHASES = PHASES[:5]  # detection .. replay: the loss to the lost work redone (RecoveryRecord's mttr_s)
STEP_TIME_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASE_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    """Cumulative-bucket counts over fixed upper bounds (``+Inf`` last), as Prometheus wants them."""

    bounds: tuple[float, ...] = STEP_TIME_BOUNDS
    counts: list[int] = field(default_factory=list)  # per bound, then +Inf: not cumulative
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, count of values <= le)]`` with ``+Inf`` last (prometheus_client's HistogramMetricFamily)."""
        out, running = [], 0
        for le, c in zip([*(repr(float(b)) for b in self.bounds), "+Inf"], self.counts, strict=True):
            running += c
            out.append((le, running))
        return out


def histogram_of(values: Iterable[float], bounds: tuple[float, ...] = PHASE_BOUNDS) -> Histogram:
    h = Histogram(bounds)
    for v in values:
        h.observe(v)
    return h


class StepTimes:
    """Per slice, the compute seconds its first-run instances of each step took, summed, once the step completes.

    The executor calls :meth:`instance` for every first run it counts and :meth:`step_done`
    when a step has every instance; replays are not step times (they are ``replayed``).
    """

    def __init__(self, slice_of: Mapping[str, str]) -> None:
        self.slice_of = dict(slice_of)
        self._open: dict[int, dict[str, float]] = {}
        self.by_slice: dict[str, Histogram] = {s: Histogram() for s in sorted(set(self.slice_of.values()))}

    def instance(self, node: str, step: int, compute_s: float) -> None:
        per = self._open.setdefault(step, {})
        sl = self.slice_of.get(node, "")
        per[sl] = per.get(sl, 0.0) + float(compute_s)

    def step_done(self, step: int) -> None:
        for sl, secs in self._open.pop(step, {}).items():
            self.by_slice.setdefault(sl, Histogram()).observe(secs)


def recovery_seconds(rec: RecoveryRecord) -> float:
    """Wall seconds of the recovery's MTTR phases done so far, less its wait for spares (that is its own bucket).

    Non-decreasing as the recovery goes on (a counter may take it): the wait is taken off
    only once the remap phase that holds it has ended.
    """
    ph = rec.phases()
    secs = sum(ph.get(p, 0.0) for p in MTTR_PHASES)
    if "remap" in ph:
        secs -= min(rec.spare_wait_s, ph["remap"])
    return max(secs, 0.0)


def goodput_buckets(compute_s: Mapping[str, float], redone_s: float,
                    recoveries: Iterable[RecoveryRecord]) -> dict[str, float]:
    """The coordinator's four buckets (module doc), in seconds."""
    recs = list(recoveries)
    return {
        "productive": float(sum(compute_s.values())),
        "replayed": float(redone_s),
        "recovery": sum(recovery_seconds(r) for r in recs),
        "waiting_for_spares": sum(r.spare_wait_s for r in recs),
    }


def goodput_ratio(buckets: Mapping[str, float]) -> float | None:
    """Compute of first runs over all compute (the chaos report's goodput); None before any compute."""
    total = buckets["productive"] + buckets["replayed"]
    return buckets["productive"] / total if total > 0 else None


def phase_seconds(recoveries: Iterable[RecoveryRecord]) -> dict[str, list[float]]:
    """Every phase (:data:`PHASES`) each recovery has finished, and ``mttr`` of those past replay."""
    out: dict[str, list[float]] = {p: [] for p in (*PHASES, "mttr")}
    for r in recoveries:
        ph = r.phases()
        for p, v in ph.items():
            out[p].append(v)
        mttr = r.to_json()["mttr_s"]
        if mttr is not None:
            out["mttr"].append(mttr)
    return out


def steps_per_s(steps: int, seconds: float) -> float:
    return steps / seconds if seconds > 0 else 0.0


def summary(buckets: Mapping[str, float]) -> dict[str, Any]:
    """The buckets and ratio rounded, for a log line or a test's message."""
    ratio = goodput_ratio(buckets)
    return {**{b: round(v, 4) for b, v in buckets.items()}, "goodput": round(ratio, 4) if ratio is not None else None}

"""What a metric value that is not finite does to a job (``--on-nonfinite``). Pure.

One policy for the cluster and the reference: the coordinator's job metrics
(``orchestrator/job/metrics.py``) and the in-process reference (``client/reference.py``) both ask a
:class:`NonFiniteGuard` about each instance's metrics, so the two stop (or warn) at the same value
with the same words. With ``"warn"`` each metric is reported once and the job goes on; with
``"stop"`` (the default) the first value that is not finite stops the job there. ``"rollback"``
(docs/integrity.md): on the cluster the job rolls back past that step as from a loss spike, skipping
its batches (the job's spike settings say how far); the first such value is where it rolls back
from, as a stop's. The reference, which cannot roll back, stops there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ON_NONFINITE = ("stop", "warn", "rollback")


def nonfinite_mode(spec: Any) -> str:
    """``spec.on_nonfinite`` checked ("" or None is "stop"). Raises ValueError naming the value and the choices."""
    mode = getattr(spec, "on_nonfinite", spec) or "stop"
    if mode not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite {mode!r} is not one of {list(ON_NONFINITE)}")
    return mode


@dataclass(frozen=True)
class NonFinite:
    """A metric value of an instance that is not finite."""

    metric: str
    value: float
    step: int
    node: str
    microbatch: int


def nonfinite_values(metrics: Mapping[str, float], step: int, node: str, microbatch: int) -> list[NonFinite]:
    """The values of one instance's ``metrics`` that are not finite, by metric name."""
    return [NonFinite(name, float(v), int(step), node, int(microbatch))
            for name, v in sorted(metrics.items()) if not math.isfinite(v)]


def stopped_at(bad: NonFinite) -> str:
    """The start of a stopped job's reason (the rest says what cut is kept)."""
    return f"metric {bad.metric!r} is {bad.value!r} at step {bad.step} (--on-nonfinite stop): the job stopped there; "


@dataclass
class NonFiniteGuard:
    """The decision per instance: which values to report (``warn``: each metric once; ``stop``: the one that
    stops) and which value stops the job (None: it goes on)."""

    mode: str = "stop"
    warned: set[str] = field(default_factory=set)

    def check(self, bad: list[NonFinite]) -> tuple[list[NonFinite], NonFinite | None]:
        """``(to report, the stop)`` for an instance's non-finite values."""
        report: list[NonFinite] = []
        for b in bad:
            if self.mode == "warn":
                if b.metric not in self.warned:
                    self.warned.add(b.metric)
                    report.append(b)
                continue
            return [*report, b], b
        return report, None

"""Loss spikes: what a job calls a spike, and where a rollback goes. Pure.

A job's ``on_spike`` (docs/integrity.md) is ``"off"`` (the default), ``"warn"`` (a ``job.spike``
event, the job goes on) or ``"rollback"``. :class:`SpikeDetector` judges one metric of each
completed step (``step.done``'s mean over microbatches) against a robust baseline, the median of
the last ``window`` steps before it: a value over ``factor`` times the baseline is a spike, or,
with ``zscore`` set, a value over the baseline by more than ``zscore`` robust deviations (1.4826
times the median absolute deviation). A step is judged once ``window`` steps before it are
known; a value that is not finite is ``on_nonfinite``'s (``recovery/nonfinite.py``), not a spike.

On a spike at step ``s`` under ``rollback``, :func:`rollback_plan` says where the job goes: to the
newest consistent cut at or before ``s - rewind`` (step 0, the inits, when none is kept), with the
batches of steps ``[s - rewind, s + skip)`` skipped (:meth:`Skips.skipping
<rallypoint.recovery.skips.Skips.skipping>`). More than ``max_rollbacks`` rollbacks in a run fail
the job, naming the steps.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rallypoint.recovery.skips import Skips

ON_SPIKE = ("off", "warn", "rollback")
SPIKE_FIELDS = ("on_spike", "spike_metric", "spike_window", "spike_factor", "spike_zscore", "spike_rewind",
                "spike_skip", "max_rollbacks", "verify_every", "verify_seed", "verify_fraction")
"""The ``JobSpec`` fields of the spike policy and the verifications (submit settings: ``client/jobspec.py``'s
``RECOVERY_FIELDS``)."""
DEFAULT_METRIC = "loss"
DEFAULT_WINDOW = 20
DEFAULT_FACTOR = 3.0
DEFAULT_SKIP = 1
DEFAULT_MAX_ROLLBACKS = 3
MAD_SCALE = 1.4826  # the median absolute deviation of a normal distribution, in standard deviations
KEPT = 4096  # steps of history a detector keeps (a rollback goes back at most a few cuts)


@dataclass(frozen=True)
class SpikeSettings:
    """A job's spike policy, defaults filled in (see the module doc)."""

    mode: str = "off"
    metric: str = DEFAULT_METRIC
    window: int = DEFAULT_WINDOW
    factor: float = DEFAULT_FACTOR
    zscore: float = 0.0  # > 0: judge by robust deviations instead of the factor
    rewind: int = 0  # 0: the job's checkpoint interval
    skip: int = DEFAULT_SKIP
    max_rollbacks: int = DEFAULT_MAX_ROLLBACKS
    verify_every: int = 0  # verify one slice's steps every this many cuts (0: never; orchestrator/job/verify.py)
    verify_seed: int = 0  # which slices
    verify_fraction: float = 0.0  # > 0: at most this fraction of the job's slice-steps re-run by verifications

    @classmethod
    def from_spec(cls, spec: Any, checkpoint_every: int) -> SpikeSettings:
        """The settings a ``JobSpec`` asks for. Raises ValueError naming the field, its value and what it may be."""
        mode = spec.on_spike or "off"
        if mode not in ON_SPIKE:
            raise ValueError(f"on_spike {mode!r} is not one of {list(ON_SPIKE)}")
        for name in ("spike_window", "spike_rewind", "spike_skip", "max_rollbacks", "verify_every"):
            if getattr(spec, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the default), got {getattr(spec, name)}")
        for name in ("spike_factor", "spike_zscore"):
            v = getattr(spec, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (0: the default), got {v}")
        if not (math.isfinite(spec.verify_fraction) and 0 <= spec.verify_fraction <= 1):
            raise ValueError(f"verify_fraction is a fraction of the job's compute, 0 to 1 (0: no budget), got "
                             f"{spec.verify_fraction}")
        if 0 < spec.spike_factor <= 1:
            raise ValueError(f"spike_factor must be > 1 (a spike is a value over factor x the baseline), "
                             f"got {spec.spike_factor}")
        s = cls(mode, spec.spike_metric or DEFAULT_METRIC, int(spec.spike_window or DEFAULT_WINDOW),
                float(spec.spike_factor or DEFAULT_FACTOR), float(spec.spike_zscore),
                int(spec.spike_rewind or checkpoint_every), int(spec.spike_skip or DEFAULT_SKIP),
                int(spec.max_rollbacks or DEFAULT_MAX_ROLLBACKS), int(spec.verify_every), int(spec.verify_seed),
                float(spec.verify_fraction))
        if s.window < 2:
            raise ValueError(f"spike_window must be >= 2 steps (the baseline is their median), got {s.window}")
        return s

    def to_json(self) -> dict[str, Any]:
        return {"on_spike": self.mode, "metric": self.metric, "window": self.window, "factor": self.factor,
                "zscore": self.zscore, "rewind": self.rewind, "skip": self.skip, "max_rollbacks": self.max_rollbacks,
                "verify_every": self.verify_every, "verify_seed": self.verify_seed,
                "verify_fraction": self.verify_fraction}


@dataclass(frozen=True)
class Spike:
    """A step whose metric stood out of its baseline (``baseline`` and ``threshold`` NaN: a value not finite)."""

    step: int
    metric: str
    value: float
    baseline: float
    threshold: float

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "metric": self.metric, "value": _number(self.value),
                "baseline": _number(self.baseline), "threshold": _number(self.threshold)}

    def __str__(self) -> str:
        if not math.isfinite(self.value):
            return f"{self.metric} is {self.value!r} at step {self.step} (not finite)"
        return (f"{self.metric} {self.value:.6g} at step {self.step} is over {self.threshold:.6g} "
                f"(baseline {self.baseline:.6g}, the median of the steps before)")


def _number(v: float) -> float | str:
    """JSON has no NaN or infinity: those as text."""
    return v if math.isfinite(v) else repr(v)


@dataclass
class SpikeDetector:
    """Judges each completed step's metric (see the module doc). Fed in step order; after a rollback,
    :meth:`rewind` forgets the steps from the cut on."""

    settings: SpikeSettings
    values: dict[int, float] = field(default_factory=dict)  # step -> the metric's value, the newest KEPT steps

    def seed(self, curve: Iterable[tuple[int, float]], before: int) -> None:
        """What a run's ``metrics.jsonl`` says of the steps before ``before`` (a resumed or adopted run)."""
        for step, v in sorted(curve):
            if step < before and math.isfinite(v):
                self.values[int(step)] = float(v)
        self._trim()

    def observe(self, step: int, metrics: dict[str, float]) -> Spike | None:
        """Step ``step`` completed with ``metrics``: the spike, if it is one (None: judged normal, or not judged)."""
        v = metrics.get(self.settings.metric)
        if v is None or not math.isfinite(v):
            return None
        # The values are held in step order (fed in order; a rewind keeps a prefix): the window is their tail.
        before = list(itertools.islice(reversed(self.values.values()), self.settings.window))[::-1]
        self.values[int(step)] = float(v)
        self._trim()
        if len(before) < self.settings.window:
            return None
        base = statistics.median(before)
        if self.settings.zscore > 0:
            mad = statistics.median(abs(x - base) for x in before)
            threshold = base + self.settings.zscore * MAD_SCALE * max(mad, 1e-12 * max(abs(base), 1.0))
        else:
            threshold = base * self.settings.factor if base > 0 else base + abs(base) * (self.settings.factor - 1)
        if v <= threshold:
            return None
        del self.values[int(step)]  # a spike is not a baseline for the steps after it
        return Spike(int(step), self.settings.metric, float(v), float(base), float(threshold))

    def rewind(self, cut: int) -> None:
        """The job rolled back to ``cut``: the steps from it on run again."""
        self.values = {s: v for s, v in self.values.items() if s < cut}

    def _trim(self) -> None:
        while len(self.values) > KEPT:
            del self.values[next(iter(self.values))]  # the oldest step


@dataclass(frozen=True)
class RollbackPlan:
    """Where a rollback goes: the cut, and the skips from then on (``first .. last - 1``: the steps skipped)."""

    cut: int
    skips: Skips
    first: int
    last: int

    def to_json(self) -> dict[str, Any]:
        return {"cut": self.cut, "skipped_steps": [self.first, self.last], "skips": self.skips.to_json()}


def rollback_plan(step: int, settings: SpikeSettings, skips: Skips, cuts: Iterable[int], steps: int) -> RollbackPlan:
    """A rollback for a spike at ``step``: the newest of ``cuts`` (consistent cuts kept) at or before
    ``step - rewind`` (0 when none is), and the batches of steps ``[step - rewind, step + skip)`` skipped
    (within the job's ``steps``)."""
    first = max(step - settings.rewind, 0)
    last = min(step + settings.skip, steps)
    cut = max((c for c in cuts if c <= first), default=0)
    return RollbackPlan(cut, skips.skipping(first, max(last, first + 1)), first, max(last, first + 1))


def too_many(count: int, rollbacks: list[dict[str, Any]], spike: Spike, settings: SpikeSettings) -> str | None:
    """The job's failure when ``spike`` would be one rollback more than ``max_rollbacks`` (``count`` so far, the
    newest of them in ``rollbacks``); None: it rolls back."""
    if count < settings.max_rollbacks:
        return None
    at = ", ".join(str(r.get("spike", {}).get("step")) for r in rollbacks if isinstance(r.get("spike"), dict))
    return (f"{spike}; the job rolled back {count} times already (spikes at steps {at}), its max_rollbacks: "
            f"the spikes recur, so their cause is likely not the data (a learning rate too high, an unstable "
            f"model); look at the loss curve (`rallypoint plot`), fix it, and resume or run again")

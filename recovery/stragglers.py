"""Whether a slice of a job straggles, and whether to move it now. Pure.

The executor measures, for every slice and every completed step, the slice's **own
time** in that step: the wall time during which the slice had an instance whose
inputs had all arrived (and whose step was granted, and whose slice had saved the
checkpoint it waits behind) that it had not finished yet — the union of its instances'
``[ready, done]`` intervals. Waiting for a peer is not
own time, so a pipeline that runs at the pace of its slowest stage charges the wait
to that stage alone (a wall time per step, or the time between a slice's completions,
grows on every slice of a coupled pipeline alike).

:func:`judge` decides from the last ``window`` samples of each slice, taken together
(one stop of a slice stopped half the time falls into some steps and not others, so
single steps are bimodal; their mean is not). A slice's **slowdown** is its mean own
time over its **baseline** (the mean of its own earlier steps, so a stage that does
more work is not slower for it). A slice **straggles** when

1. its slowdown is at least ``factor``;
2. it is at least ``factor`` times the median slowdown of its peers (the other slices
   of the job: a machine busy for everyone slows nobody down relative to the rest);
3. its mean own time exceeds its baseline by at least ``min_excess_s`` a step (a
   50 µs step that took 150 µs is noise, not a straggler);
4. it persisted: at least ``persist`` of the steps were each ``factor`` times its
   baseline or more (one long hiccup does not make a straggler).

The straggler with the largest slowdown is the candidate. It is moved
(:class:`Migrate`) unless the settings only report (``mode="report"``), something is
moving already (``busy``: a drain or a recovery), or it moved less than ``cooldown``
steps ago; each of those is a :class:`Keep` naming the reason. The evidence (the
numbers the decision came from) goes with either. A job with one slice has no peers
and is never judged.

A worker a straggler move leaves is cordoned **on probation** (:func:`probation`): the
cordon lapses after ``probation_s`` and the worker returns to the pool (a host slowed for
a while by a noisy neighbour, a thermal throttle or a firmware update is not lost for good),
unless it was moved off once already within ``repeat_window_s``: a host that straggles again
stays out until an operator takes it back.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MODES = ("migrate", "report", "off")
DEFAULT_FACTOR = 2.0
DEFAULT_WINDOW = 16
DEFAULT_PERSIST = 8
DEFAULT_MIN_EXCESS_S = 0.03
DEFAULT_PROBATION_S = 600.0  # a straggler's worker is cordoned this long, then back in the pool
DEFAULT_REPEAT_WINDOW_S = 3600.0  # moved off again within this: it stays out
BASELINE_FLOOR_S = 0.001  # a baseline under a millisecond counts as one (slowdowns of a near-idle slice stay finite)


@dataclass(frozen=True, slots=True)
class StragglerSettings:
    """How stragglers are judged (see the module doc). ``cooldown`` is in steps (0: three windows)."""

    mode: str = "migrate"
    factor: float = DEFAULT_FACTOR
    window: int = DEFAULT_WINDOW
    persist: int = DEFAULT_PERSIST
    min_excess_s: float = DEFAULT_MIN_EXCESS_S
    cooldown: int = 0
    probation_s: float = DEFAULT_PROBATION_S
    repeat_window_s: float = DEFAULT_REPEAT_WINDOW_S

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"stragglers {self.mode!r} is not one of {list(MODES)}")
        if not self.factor > 1.0:
            raise ValueError(f"straggler_factor must be > 1 (a slice that many times slower straggles), "
                             f"got {self.factor}")
        if self.window < 1:
            raise ValueError(f"straggler_window must be >= 1 step, got {self.window}")
        if not 1 <= self.persist <= self.window:
            raise ValueError(f"straggler_persist must be between 1 and straggler_window ({self.window}), "
                             f"got {self.persist}")
        if self.min_excess_s < 0 or self.cooldown < 0:
            raise ValueError(f"min_excess_s and cooldown must be >= 0, got {self.min_excess_s}, {self.cooldown}")
        if not (self.probation_s > 0 and self.repeat_window_s > 0):
            raise ValueError(f"straggler_probation_s and straggler_repeat_window_s must be > 0 seconds, got "
                             f"{self.probation_s:g} and {self.repeat_window_s:g}")

    @property
    def cooldown_steps(self) -> int:
        return self.cooldown or 3 * self.window


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move ``slice`` (and the job's other slices on ``worker``) off ``worker`` to a spare, by a drain."""

    slice: str
    worker: str
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Keep:
    """Move nothing; ``reason`` says why, ``straggling`` names the slices judged straggling (if any)."""

    reason: str
    straggling: tuple[str, ...] = ()
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Probation:
    """How a worker a straggler move leaves is cordoned: ``lapse_s`` seconds (None: until an operator takes the
    cordon back), and the times of its straggler moves within the window, this one included."""

    lapse_s: float | None
    moves: tuple[float, ...]
    reason: str


def probation(earlier: Sequence[float], now: float, settings: StragglerSettings) -> Probation:
    """The cordon of a worker moved off as a straggler at ``now`` (wall clock), given the times of its earlier
    straggler moves (any job's)."""
    moves = tuple(sorted(t for t in earlier if now - settings.repeat_window_s < t <= now)) + (now,)
    if len(moves) > 1:
        return Probation(None, moves, f"moved off as a straggler {len(moves)} times within "
                         f"{settings.repeat_window_s:g} s: it stays cordoned until an operator uncordons it")
    return Probation(settings.probation_s, moves, f"on probation: back in the pool after {settings.probation_s:g} s")


def slowdowns(samples: Mapping[str, Sequence[float]], baseline: Mapping[str, float]) -> dict[str, list[float]]:
    """Each slice's own time over its baseline, step by step (the baseline at least :data:`BASELINE_FLOOR_S`)."""
    return {s: [x / max(baseline[s], BASELINE_FLOOR_S) for x in xs] for s, xs in samples.items()}


def straggling(samples: Mapping[str, Sequence[float]], baseline: Mapping[str, float],
               settings: StragglerSettings) -> dict[str, dict[str, Any]]:
    """Each slice's numbers over the samples given, and whether it straggles (rules 1-4 of the module doc)."""
    per_step = slowdowns(samples, baseline)
    mean = {s: statistics.fmean(xs) for s, xs in samples.items()}
    slow = {s: mean[s] / max(baseline[s], BASELINE_FLOOR_S) for s in samples}
    out: dict[str, dict[str, Any]] = {}
    for s in samples:
        peers = statistics.median(slow[p] for p in samples if p != s) if len(samples) > 1 else 1.0
        slow_steps = sum(r >= settings.factor for r in per_step[s])
        excess = mean[s] - baseline[s]
        out[s] = {"slowdown": slow[s], "peers_slowdown": peers, "excess_s": excess, "slow_steps": slow_steps,
                  "straggles": (slow[s] >= settings.factor and slow[s] >= settings.factor * peers
                                and excess >= settings.min_excess_s and slow_steps >= settings.persist)}
    return out


def judge(samples: Mapping[str, Sequence[float]], baseline: Mapping[str, float], workers: Mapping[str, str], *,
          settings: StragglerSettings, step: int, busy: str = "", moved_at: Mapping[str, int] | None = None
          ) -> Migrate | Keep:
    """Decide from the last steps' own times (see the module doc).

    Args:
        samples: slice -> its own time (s) in each of the last completed steps, oldest
            first, the same steps for every slice; only the last ``settings.window`` count.
        baseline: slice -> its own time (s) in an ordinary step.
        workers: slice -> the worker it runs on now.
        step: the step judged up to (for the cooldown and the evidence).
        busy: why nothing may move now ("" when something may).
        moved_at: slice -> the step a straggler migration moved it at.
    """
    if settings.mode == "off":
        return Keep("straggler mitigation is off")
    missing = sorted(set(samples) - set(baseline))
    if missing:
        raise ValueError(f"slices {missing} have samples but no baseline")
    w = settings.window
    recent = {s: list(xs[-w:]) for s, xs in samples.items()}
    if len(recent) < 2:
        return Keep("a job with one slice has no peers to compare it with")
    short = sorted(s for s, xs in recent.items() if len(xs) < w)
    if short:
        return Keep(f"fewer than {w} steps measured for slices {short}")
    judged = straggling(recent, baseline, settings)
    ratio = slowdowns(recent, baseline)
    per_slice = {s: {"worker": workers.get(s, ""), "baseline_s": round(baseline[s], 6),
                     "own_s": [round(x, 6) for x in recent[s]], "step_slowdown": [round(r, 3) for r in ratio[s]],
                     **{k: round(v, 6) if isinstance(v, float) else v for k, v in judged[s].items()}}
                 for s in sorted(recent)}
    slow = sorted((s for s in recent if judged[s]["straggles"]), key=lambda s: (-judged[s]["slowdown"], s))
    evidence: dict[str, Any] = {
        "step": step, "window": w, "persist": settings.persist, "factor": settings.factor,
        "min_excess_s": settings.min_excess_s, "slices": per_slice,
    }
    if not slow:
        return Keep("no slice straggles", evidence=evidence)
    first = slow[0]
    evidence["straggler"] = first
    evidence["slow_since_index"] = next(i for i, r in enumerate(ratio[first]) if r >= settings.factor)
    if settings.mode == "report":
        return Keep("stragglers are only reported (stragglers='report')", tuple(slow), evidence)
    if busy:
        return Keep(busy, tuple(slow), evidence)
    moved = (moved_at or {}).get(first)
    if moved is not None and step - moved < settings.cooldown_steps:
        return Keep(f"slice {first!r} was moved for straggling at step {moved}; it may move again from step "
                    f"{moved + settings.cooldown_steps} (cooldown {settings.cooldown_steps} steps)",
                    tuple(slow), evidence)
    if not workers.get(first):
        return Keep(f"slice {first!r} is on no worker now", tuple(slow), evidence)
    return Migrate(first, workers[first], evidence)

"""How many steps a job's workers may run ahead of the leader: the window, from the recovery budget.

A worker runs the instances of every step below its grant as their inputs arrive; the leader widens
the grant as steps complete (:meth:`Grants.widen <rallypoint.orchestrator.job.grants.Grants.widen>`).
The wider the window, the less a step waits for the leader, and the more a loss can cost:

* **replay**: a lost slice restarts from the job's cut and replays every instance since, which its
  consumers wait for. Since the cut, at most ``checkpoint_every`` steps complete before the next one
  moves it, and at most ``window`` more run ahead of the completed steps: a window of one checkpoint
  interval at most doubles the replay's worst case (the instances run ahead are re-run where the loss
  touched them, and only there);
* **output log**: each worker logs its outputs since the cut, for replay. It already holds up to one
  interval of them; running ahead adds at most ``window`` steps more. Once the leader has heard how many
  bytes a step logs (``InstanceDone.log_bytes`` plus ``log_spilled_bytes`` over the steps since the cut),
  the window is kept so that ``(checkpoint_every + window)`` steps fit in the log's memory limit (past it
  the log spills to disk, which replays slower but loses nothing);
* **stops and drains**: a suspend, cancel or drain is carried out at a step past the grant (a worker
  may already run up to it), so the window is also kept to a quarter of the job's steps.

A window the job asks for (``JobSpec.window`` > 0) is used as it is; 0 (the default) lets the leader
decide (:func:`decide_window`). :class:`StepWindow` keeps the decision and narrows an automatic one
when the log's bytes say so. Pure: no I/O, single-threaded (the executor's loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_WINDOW = 2  # an automatic window never goes below the window every job had before it was decided
MAX_WINDOW = 32  # nor past this: a checkpoint interval of hundreds of steps still bounds what a loss re-runs
JOB_SHARE = 4  # at most a quarter of the job's steps (a stop or drain is carried out past the grant)


@dataclass(frozen=True)
class WindowChoice:
    """The window decided: ``steps`` in flight, whether the leader chose it (``auto``) and why."""

    steps: int
    auto: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"window": self.steps, "auto": self.auto, "reason": self.reason}


def decide_window(asked: int, *, checkpoint_every: int, checkpoints: bool, steps: int, log_limit_bytes: int,
                  step_log_bytes: int = 0) -> WindowChoice:
    """The window of a job that asked for ``asked`` steps (0: decide), checkpointing every ``checkpoint_every``
    steps (``checkpoints``: it has a run directory to save in), of ``steps`` steps, whose workers' output logs
    hold ``log_limit_bytes`` in memory and log ``step_log_bytes`` a step (0: not heard yet). See the module doc.

    Raises:
        ValueError: ``asked`` is negative.
    """
    if asked < 0:
        raise ValueError(f"the job's window must be 0 (decided from its checkpoint interval) or a number of steps "
                         f">= 1, got {asked}")
    if asked > 0:
        return WindowChoice(asked, False, "asked by the job")
    interval = checkpoint_every if checkpoints and checkpoint_every > 0 else 0
    if interval:
        window, why = interval, f"one checkpoint interval ({interval} steps)"
    else:  # no cut ever moves: a loss replays from the start whatever the window; the log holds every step anyway
        window, why = MAX_WINDOW, "no checkpoints"
    if window > MAX_WINDOW:
        window, why = MAX_WINDOW, f"{why}, at most {MAX_WINDOW}"
    if step_log_bytes > 0 and interval:
        fits = log_limit_bytes // step_log_bytes - interval  # steps past the interval the log's memory still holds
        if fits < window:
            window, why = fits, (f"{why}, narrowed to what the output log holds ({log_limit_bytes} bytes, "
                                 f"{step_log_bytes} a step)")
    if steps // JOB_SHARE < window:
        window, why = steps // JOB_SHARE, f"{why}, at most a quarter of the job's {steps} steps"
    if window < MIN_WINDOW:
        window, why = MIN_WINDOW, f"{why}, at least {MIN_WINDOW}"
    return WindowChoice(window, True, why)


class StepWindow:
    """A job's window (see the module doc): :attr:`choice` now; :meth:`heard` narrows an automatic one from the
    output log's bytes, never widening it again (a window that flapped would regrant for nothing)."""

    def __init__(self, asked: int, *, checkpoint_every: int = 0, checkpoints: bool = False, steps: int = 1 << 62,
                 log_limit_bytes: int = 0) -> None:
        self._asked, self._every, self._checkpoints = asked, checkpoint_every, checkpoints
        self._steps, self._limit = steps, log_limit_bytes
        self._step_bytes = 0
        self.choice = decide_window(asked, checkpoint_every=checkpoint_every, checkpoints=checkpoints, steps=steps,
                                    log_limit_bytes=log_limit_bytes)

    @property
    def steps(self) -> int:
        return self.choice.steps

    def heard(self, log_bytes: int, step: int, cut: int) -> WindowChoice | None:
        """A worker's output log held ``log_bytes`` after its instance of ``step`` (the job's cut at ``cut``):
        the window narrowed by it (to report), or None."""
        if not self.choice.auto or log_bytes <= 0 or not self._checkpoints:
            return None
        per_step = log_bytes // max(1, step + 1 - cut)
        if per_step <= self._step_bytes:
            return None
        self._step_bytes = per_step
        choice = decide_window(self._asked, checkpoint_every=self._every, checkpoints=self._checkpoints,
                               steps=self._steps, log_limit_bytes=self._limit, step_log_bytes=per_step)
        if choice.steps >= self.choice.steps:
            return None
        self.choice = choice
        return choice

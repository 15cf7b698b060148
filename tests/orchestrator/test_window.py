"""The window of steps in flight, from the recovery budget (job/window.py); no executor."""

from __future__ import annotations

import pytest

from rallypoint.orchestrator.job.grants import Grants
from rallypoint.orchestrator.job.window import MAX_WINDOW, MIN_WINDOW, StepWindow, decide_window

MIB = 1 << 20


def test_a_window_the_job_asks_for_is_used_as_it_is() -> None:
    got = decide_window(3, checkpoint_every=50, checkpoints=True, steps=1000, log_limit_bytes=MIB)
    assert (got.steps, got.auto) == (3, False)


def test_the_automatic_window_is_one_checkpoint_interval() -> None:
    got = decide_window(0, checkpoint_every=10, checkpoints=True, steps=1000, log_limit_bytes=256 * MIB)
    assert (got.steps, got.auto) == (10, True) and "checkpoint interval" in got.reason
    assert got.to_json() == {"window": 10, "auto": True, "reason": got.reason}


@pytest.mark.parametrize(("every", "checkpoints", "steps", "want"), [
    (500, True, 100_000, MAX_WINDOW),  # a long interval: bounded
    (1, True, 1000, MIN_WINDOW),  # never below the old constant window
    (10, True, 6, MIN_WINDOW),  # a quarter of a short job's steps, at least the minimum
    (10, True, 24, 6),
    (10, False, 1000, MAX_WINDOW),  # no checkpoints: a loss replays from the start whatever the window
])
def test_the_automatic_window_is_bounded(every: int, checkpoints: bool, steps: int, want: int) -> None:
    assert decide_window(0, checkpoint_every=every, checkpoints=checkpoints, steps=steps,
                         log_limit_bytes=256 * MIB).steps == want


def test_the_output_log_narrows_the_automatic_window_to_what_its_memory_holds() -> None:
    # 1 MiB a step, 16 MiB of log: the interval (10) and 6 steps past it fit
    got = decide_window(0, checkpoint_every=10, checkpoints=True, steps=1000, log_limit_bytes=16 * MIB,
                        step_log_bytes=MIB)
    assert got.steps == 6 and "output log" in got.reason
    tight = decide_window(0, checkpoint_every=10, checkpoints=True, steps=1000, log_limit_bytes=4 * MIB,
                          step_log_bytes=MIB)
    assert tight.steps == MIN_WINDOW  # the log spills past its limit: a narrower window would only slow the job


def test_a_negative_window_is_refused_naming_what_to_give() -> None:
    with pytest.raises(ValueError, match="window must be 0 .* or a number of steps >= 1, got -1"):
        decide_window(-1, checkpoint_every=10, checkpoints=True, steps=100, log_limit_bytes=MIB)


def test_the_step_window_narrows_from_the_bytes_heard_and_never_widens_again() -> None:
    w = StepWindow(0, checkpoint_every=10, checkpoints=True, steps=1000, log_limit_bytes=16 * MIB)
    assert w.steps == 10
    assert w.heard(2 * MIB, step=9, cut=0) is None  # 0.2 MiB a step: the window fits
    narrowed = w.heard(8 * MIB, step=3, cut=0)  # 2 MiB a step: 8 steps of log, less than the interval
    assert narrowed is not None and w.steps == MIN_WINDOW == narrowed.steps
    assert w.heard(1, step=100, cut=99) is None and w.steps == MIN_WINDOW  # fewer bytes: it stays narrow
    asked = StepWindow(4, checkpoint_every=10, checkpoints=True, steps=1000, log_limit_bytes=MIB)
    assert asked.heard(100 * MIB, step=1, cut=0) is None and asked.steps == 4  # the job's own window stands


def test_a_wide_window_is_granted_once_every_half_window_and_a_slice_is_never_left_without_steps() -> None:
    g = Grants(steps=100)
    window, sent = 10, []
    for completed in range(0, 60):
        if g.widen(completed, window):
            sent.append(completed)
        assert g.granted - completed >= window // 2  # at least half the window still granted ahead
    assert sent == list(range(0, 60, 5))  # one grant every half window, not one per step


def test_a_job_that_asks_for_a_negative_window_is_refused_naming_the_field() -> None:
    from rallypoint.orchestrator.job.recovery import JobSettings
    from rallypoint.proto import rallypoint_pb2 as pb

    with pytest.raises(ValueError, match=r"window must be >= 0 \(0: the leader decides it .*\), got -3"):
        JobSettings.from_spec(pb.JobSpec(job="j", window=-3))
    JobSettings.from_spec(pb.JobSpec(job="j", window=0))  # the default: the leader's

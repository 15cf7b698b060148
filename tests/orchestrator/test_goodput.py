"""The goodput buckets, step times and histograms of orchestrator/job/goodput.py: plain arithmetic."""

from __future__ import annotations

import math

import pytest

from rallypoint.orchestrator.job.goodput import (Histogram, StepTimes, goodput_buckets, goodput_ratio, histogram_of,
                                             phase_seconds, recovery_seconds, steps_per_s)
from rallypoint.orchestrator.job.recovery import RecoveryRecord


def record(number: int = 1, *, detection: float = 0.1, marks: dict[str, float] | None = None,
           spare_wait_s: float = 0.0) -> RecoveryRecord:
    """A recovery detected at monotonic 100.0, whose phases end at ``marks`` (absolute times)."""
    r = RecoveryRecord(number=number, lost={}, reasons={}, detected_at=0.0, detected_mono=100.0,
                       detection_s=detection, spare_wait_s=spare_wait_s)
    for p, at in (marks or {}).items():
        r.mark(p, at)
    return r


DONE = {"fencing": 100.2, "remap": 101.2, "restore": 101.5, "replay": 102.0, "catch_up": 103.0}


def test_a_finished_recovery_counts_its_mttr_less_the_wait_for_a_spare() -> None:
    r = record(marks=DONE, spare_wait_s=0.75)
    mttr = r.to_json()["mttr_s"]
    assert mttr == pytest.approx(0.1 + 2.0)  # detection, then 100.0 -> 102.0 (replay done); catch-up is not in it
    assert recovery_seconds(r) == pytest.approx(mttr - 0.75)
    b = goodput_buckets({"a": 3.0, "b": 1.0}, 0.5, [r])
    assert b == pytest.approx({"productive": 4.0, "replayed": 0.5, "recovery": mttr - 0.75,
                               "waiting_for_spares": 0.75})


def test_recovery_seconds_never_decrease_as_the_phases_end() -> None:
    """A counter takes them: each phase ending adds, and the spare wait comes off only with the remap phase."""
    seen = []
    marks: dict[str, float] = {}
    r = record(marks={})
    seen.append(recovery_seconds(r))
    for p, at in DONE.items():
        if p == "remap":
            r.spare_wait_s = 0.9  # set when the remap returns, before the phase is marked
            seen.append(recovery_seconds(r))
        marks[p] = at
        r.mark(p, at)
        seen.append(recovery_seconds(r))
    assert seen == sorted(seen) and seen[0] == pytest.approx(0.1) and seen[-1] == pytest.approx(2.1 - 0.9)


def test_goodput_ratio_is_first_run_compute_over_all_compute_like_the_chaos_report() -> None:
    # chaos/runner.py: useful = first runs' compute, total = every run's compute
    first_runs, reruns = [0.5, 0.5, 1.0], [0.5]
    b = goodput_buckets({"n": sum(first_runs)}, sum(reruns), [])
    assert goodput_ratio(b) == pytest.approx(sum(first_runs) / (sum(first_runs) + sum(reruns))) == pytest.approx(0.8)
    assert goodput_ratio(goodput_buckets({}, 0.0, [])) is None
    assert goodput_ratio(goodput_buckets({"n": 2.0}, 0.0, [record(marks=DONE)])) == 1.0  # recovery time is not compute


def test_step_times_sum_each_slices_instances_of_a_step_when_it_completes() -> None:
    st = StepTimes({"fwd0": "stage0", "bwd0": "stage0", "fwd1": "stage1"})
    st.instance("fwd0", 0, 0.01)
    st.instance("bwd0", 0, 0.02)
    st.instance("fwd1", 0, 0.2)
    st.instance("fwd0", 1, 0.5)  # step 1 is not complete: not observed
    assert st.by_slice["stage0"].n == 0
    st.step_done(0)
    assert st.by_slice["stage0"].n == 1 and st.by_slice["stage0"].total == pytest.approx(0.03)
    assert st.by_slice["stage1"].total == pytest.approx(0.2)
    st.step_done(0)  # a step completes once; again is nothing
    assert st.by_slice["stage0"].n == 1
    st.step_done(1)
    assert st.by_slice["stage0"].n == 2 and st.by_slice["stage1"].n == 1


def test_histogram_buckets_are_cumulative_with_inf_last() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 5)]
    assert h.n == 5 and h.total == pytest.approx(5.65)
    assert histogram_of([]).cumulative()[-1] == ("+Inf", 0)


def test_phase_seconds_list_finished_phases_and_mttr_only_past_replay() -> None:
    done, midway = record(1, marks=DONE), record(2, marks={"fencing": 100.3})
    ph = phase_seconds([done, midway])
    assert ph["detection"] == [0.1, 0.1] and ph["fencing"] == [pytest.approx(0.2), pytest.approx(0.3)]
    assert ph["replay"] == [pytest.approx(0.5)] and ph["catch_up"] == [pytest.approx(1.0)]
    assert ph["mttr"] == [pytest.approx(2.1)]


def test_steps_per_s() -> None:
    assert steps_per_s(10, 2.0) == 5.0 and steps_per_s(10, 0.0) == 0.0 and not math.isnan(steps_per_s(0, 1.0))

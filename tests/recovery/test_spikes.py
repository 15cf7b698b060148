"""The pure parts of a rolled-back loss spike: the skipped stream positions (recovery/skips.py) and the detector,
the policy and the rollback's plan (recovery/spikes.py). On a real cluster: tests/integration/test_spikes.py."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, strategies as st

from rallypoint.orchestrator.job.recovery import JobSettings
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.skips import MAX_SKIPS, SkipRange, Skips
from rallypoint.recovery.spikes import (Spike, SpikeDetector, SpikeSettings, rollback_plan, too_many)


def test_without_skips_every_step_reads_its_own_position() -> None:
    assert [Skips().position(s) for s in range(5)] == [0, 1, 2, 3, 4]


def test_a_skip_moves_the_steps_from_its_first_past_the_positions_it_covers() -> None:
    s = Skips().skipping(5, 8)  # the steps 5, 6, 7 read positions 5..7: never again
    assert s.to_json() == [[5, 3]] and str(s) == "5:3"
    assert [s.position(t) for t in range(10)] == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]


def test_a_later_skip_counts_in_positions_so_an_earlier_skip_keeps_the_batches_it_skipped() -> None:
    s = Skips().skipping(5, 8).skipping(3, 4)  # step 3 read position 3 under the first skip
    assert s.to_json() == [[3, 1], [5, 3]]
    assert [s.position(t) for t in range(6)] == [0, 1, 2, 4, 8, 9]
    # A skip over steps that straddle an earlier one covers it: one range.
    assert Skips().skipping(5, 8).skipping(4, 6).to_json() == [[4, 5]]  # steps 4, 5 read positions 4 and 8


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=6), st.integers(0, 60))
def test_positions_rise_skip_exactly_the_skipped_and_a_new_skip_leaves_the_steps_before_it(
    skips: list[tuple[int, int]], first: int,
) -> None:
    s = Skips()
    for at, n in skips:
        s = s.skipping(at, at + n)
    got = [s.position(t) for t in range(80)]
    skipped = {p for r in s.ranges for p in range(r.start, r.end)}
    assert got == sorted(set(got)) and not skipped & set(got)
    assert set(range(got[-1] + 1)) == set(got) | {p for p in skipped if p <= got[-1]}  # nothing else is passed over
    later = s.skipping(first, first + 2)
    assert [later.position(t) for t in range(first)] == got[:first]
    assert later.position(first) > s.position(first + 1)


def test_skips_from_a_record_or_a_request_are_checked_and_bad_ones_named() -> None:
    assert Skips.from_json(None) == Skips() and Skips.from_json([[4, 2], [1, 1]]).to_json() == [[1, 1], [4, 2]]
    for bad, why in (("x", "a list"), ([[1]], "a [start, count] pair"), ([[-1, 2]], "starts at a position >= 0"),
                     ([[1, 0]], "holds >= 1 position"), ([[1, True]], "holds >= 1 position"),
                     ([[i * 2, 1] for i in range(MAX_SKIPS + 1)], f"at most {MAX_SKIPS}")):
        with pytest.raises(ValueError, match=re.escape(why)):
            Skips.from_json(bad)
    with pytest.raises(ValueError, match="not sorted and apart"):
        Skips((SkipRange(4, 2), SkipRange(1, 1)))
    assert Skips.parse(["6:5", "1:1"]).to_json() == [[1, 1], [6, 5]]
    with pytest.raises(ValueError, match="skip '6' is not START:COUNT"):
        Skips.parse(["6"])
    req = pb.LoadJobRequest()
    Skips.parse(["6:5"]).to_proto(req.skips)
    assert Skips.from_proto(req.skips).to_json() == [[6, 5]]


def settings(**kw: object) -> SpikeSettings:
    return SpikeSettings(**{"mode": "rollback", "window": 4, "factor": 3.0, "rewind": 3, "skip": 2, **kw})


def test_a_value_over_factor_times_the_median_of_the_window_before_is_a_spike_once_the_window_is_full() -> None:
    d = SpikeDetector(settings())
    assert [d.observe(s, {"loss": v}) for s, v in enumerate([10.0, 1.0, 1.0, 1.0])] == [None] * 4  # not judged yet
    assert d.observe(4, {"loss": 2.9}) is None  # median of 10, 1, 1, 1 is 1: under 3
    spike = d.observe(5, {"loss": 3.5})
    assert spike == Spike(5, "loss", 3.5, 1.0, 3.0), spike
    assert "loss 3.5 at step 5 is over 3 (baseline 1" in str(spike)
    assert d.observe(6, {"loss": 1.1}) is None  # the spike is no baseline for what follows
    assert d.observe(7, {"other": 9.0}) is None and d.observe(8, {"loss": math.nan}) is None


def test_a_zscore_judges_by_robust_deviations() -> None:
    d = SpikeDetector(settings(zscore=5.0))
    for s, v in enumerate([1.0, 1.1, 0.9, 1.0]):
        d.observe(s, {"loss": v})
    assert d.observe(4, {"loss": 1.3}) is None  # the MAD is 0.05: 5 x 1.4826 x 0.05 = 0.37 over the median, 1.37
    spike = d.observe(5, {"loss": 2.5})  # the window is 1.1, 0.9, 1.0, 1.3 now: median 1.05, MAD 0.1
    assert spike is not None and spike.threshold == pytest.approx(1.05 + 5 * 1.4826 * 0.1)


def test_a_rollback_forgets_the_steps_from_the_cut_and_a_resume_seeds_the_baseline() -> None:
    d = SpikeDetector(settings())
    for s in range(8):
        d.observe(s, {"loss": 1.0})
    d.rewind(5)
    assert sorted(d.values) == [0, 1, 2, 3, 4]
    fresh = SpikeDetector(settings())
    fresh.seed([(0, 1.0), (1, 1.0), (2, math.inf), (3, 1.0), (4, 1.0), (9, 50.0)], before=5)
    assert sorted(fresh.values) == [0, 1, 3, 4] and fresh.observe(5, {"loss": 4.0}) is not None


def test_the_rollback_goes_to_the_newest_cut_at_or_before_the_rewind_and_skips_to_past_the_spike() -> None:
    plan = rollback_plan(9, settings(), Skips(), [2, 6], steps=16)
    assert (plan.cut, plan.first, plan.last, plan.skips.to_json()) == (6, 6, 11, [[6, 5]])
    assert rollback_plan(9, settings(), Skips(), [], steps=16).cut == 0  # none kept: the inits
    assert rollback_plan(1, settings(), Skips(), [0], steps=16).first == 0
    assert rollback_plan(15, settings(), Skips(), [12], steps=16).last == 16  # not past the job's end


def test_one_rollback_more_than_max_rollbacks_is_the_jobs_failure_naming_the_spikes() -> None:
    spike = Spike(4, "loss", 99.0, 3.0, 9.0)
    assert too_many(1, [{"spike": {"step": 4}}], spike, settings(max_rollbacks=2)) is None
    why = too_many(2, [{"spike": {"step": 4}}, {"spike": {"step": 5}}], spike, settings(max_rollbacks=2))
    assert why is not None and "rolled back 2 times already (spikes at steps 4, 5)" in why and "max_rollbacks" in why


def test_the_spike_settings_are_checked_naming_the_field() -> None:
    got = JobSettings.from_spec(pb.JobSpec(job="j", on_spike="rollback", spike_window=5, checkpoint_every=4,
                                           keep_checkpoints=4)).spikes
    assert (got.mode, got.window, got.rewind, got.skip, got.max_rollbacks, got.metric) == ("rollback", 5, 4, 1, 3, "loss")
    for spec, why in ((pb.JobSpec(on_spike="maybe"), "on_spike 'maybe' is not one of"),
                      (pb.JobSpec(spike_window=-1), "spike_window must be >= 0"),
                      (pb.JobSpec(spike_window=1), "spike_window must be >= 2"),
                      (pb.JobSpec(spike_factor=0.5), "spike_factor must be > 1"),
                      (pb.JobSpec(spike_zscore=math.nan), "spike_zscore must be a finite number"),
                      (pb.JobSpec(on_spike="rollback", spike_rewind=40, checkpoint_every=10),
                       "keep at least 6 checkpoints, or rewind less")):
        with pytest.raises(ValueError, match=why):
            JobSettings.from_spec(spec)

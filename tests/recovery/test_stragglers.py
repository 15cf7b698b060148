"""The straggler policy (pure): hand cases, an exhaustive sweep of slow patterns, and properties."""

from __future__ import annotations

import itertools
import statistics
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.recovery.stragglers import Keep, Migrate, StragglerSettings, judge, straggling

S = StragglerSettings(factor=2.0, window=4, persist=3, min_excess_s=0.01)
WORKERS = {"a": "w0", "b": "w1", "c": "w2", "d": "w3"}
BASE = {"a": 0.01, "b": 0.02, "c": 0.01, "d": 0.04}


def steady(n: int = 4, **slow: list[float]) -> dict[str, list[float]]:
    """Every slice at its baseline for ``n`` steps, except the slowdowns given (a multiple per step)."""
    return {s: [BASE[s] * m for m in slow.get(s, [1.0] * n)] for s in BASE}


def test_a_slice_slow_in_enough_steps_is_migrated_with_its_evidence() -> None:
    got = judge(steady(a=[1, 5, 5, 5]), BASE, WORKERS, settings=S, step=40)
    assert isinstance(got, Migrate) and (got.slice, got.worker) == ("a", "w0")
    ev = got.evidence
    assert ev["straggler"] == "a" and ev["slices"]["a"]["slow_steps"] == 3 and ev["slow_since_index"] == 1
    assert ev["slices"]["a"]["step_slowdown"] == [1.0, 5.0, 5.0, 5.0] and ev["slices"]["a"]["slowdown"] == 4.0
    assert ev["slices"]["a"]["peers_slowdown"] == 1.0 and ev["slices"]["a"]["excess_s"] == 0.03
    assert ev["slices"]["a"]["straggles"] and ev["slices"]["b"]["slow_steps"] == 0
    assert ev["slices"]["a"]["baseline_s"] == 0.01 and ev["step"] == 40 and ev["factor"] == 2.0


def test_too_few_slow_steps_keep_it_however_slow_they_were() -> None:
    got = judge(steady(a=[40, 1, 1, 1]), BASE, WORKERS, settings=S, step=40)  # one long hiccup
    assert isinstance(got, Keep) and got.reason == "no slice straggles" and got.straggling == ()
    assert got.evidence["slices"]["a"]["slowdown"] > 10 and got.evidence["slices"]["a"]["slow_steps"] == 1


def test_a_bimodal_straggler_is_judged_on_its_mean() -> None:
    # stopped during some steps and not others: each step alone is ambiguous, the window is not
    got = judge(steady(a=[9, 1, 9, 9]), BASE, WORKERS, settings=S, step=40)
    assert isinstance(got, Migrate) and got.evidence["slices"]["a"]["slowdown"] == 7.0


def test_a_machine_busy_for_everyone_slows_nobody_down() -> None:
    got = judge(steady(a=[4] * 4, b=[4] * 4, c=[4] * 4, d=[4] * 4), BASE, WORKERS, settings=S, step=9)
    assert isinstance(got, Keep) and got.straggling == ()


def test_a_slice_that_does_more_work_is_not_slower_for_it() -> None:
    # d's own time is 4x a's every step, and always was: its baseline says so.
    got = judge(steady(), BASE, WORKERS, settings=S, step=9)
    assert isinstance(got, Keep) and got.straggling == ()


def test_a_tiny_slowdown_in_seconds_is_noise() -> None:
    base = {"a": 0.001, "b": 0.001}
    got = judge({"a": [0.005] * 4, "b": [0.001] * 4}, base, {"a": "w0", "b": "w1"}, settings=S, step=9)
    assert isinstance(got, Keep) and got.straggling == ()


def test_the_slowest_of_two_stragglers_goes_first() -> None:
    got = judge(steady(a=[3] * 4, c=[9] * 4), BASE, WORKERS, settings=S, step=9)
    assert isinstance(got, Migrate) and got.slice == "c"
    assert got.evidence["slices"]["a"]["straggles"]  # a straggles too; it waits for the next decision


@pytest.mark.parametrize("kw, reason", [
    ({"busy": "drain 1 of worker w3 runs"}, "drain 1 of worker w3 runs"),
    ({"moved_at": {"a": 30}}, "was moved for straggling at step 30; it may move again from step 42"),
])
def test_busy_or_cooling_down_keeps_the_straggler_and_says_why(kw: dict, reason: str) -> None:
    got = judge(steady(a=[5] * 4), BASE, WORKERS, settings=S, step=40, **kw)
    assert isinstance(got, Keep) and reason in got.reason and got.straggling == ("a",)
    assert got.evidence["straggler"] == "a"


def test_after_the_cooldown_it_may_move_again() -> None:
    got = judge(steady(a=[5] * 4), BASE, WORKERS, settings=S, step=42, moved_at={"a": 30})
    assert isinstance(got, Migrate)


def test_report_mode_reports_and_off_judges_nothing() -> None:
    rep = judge(steady(a=[5] * 4), BASE, WORKERS, settings=StragglerSettings(mode="report", window=4, persist=3),
                step=9)
    assert isinstance(rep, Keep) and rep.straggling == ("a",) and "only reported" in rep.reason
    off = judge(steady(a=[5] * 4), BASE, WORKERS, settings=StragglerSettings(mode="off"), step=9)
    assert off == Keep("straggler mitigation is off")


def test_too_little_history_one_slice_and_a_missing_baseline() -> None:
    short = judge({s: xs[:3] for s, xs in steady(a=[5] * 4).items()}, BASE, WORKERS, settings=S, step=3)
    assert isinstance(short, Keep) and "fewer than 4 steps" in short.reason
    alone = judge({"a": [1.0] * 4}, {"a": 0.01}, {"a": "w0"}, settings=S, step=9)
    assert isinstance(alone, Keep) and "no peers" in alone.reason
    with pytest.raises(ValueError, match=r"slices \['b'\] have samples but no baseline"):
        judge({"a": [1.0] * 4, "b": [1.0] * 4}, {"a": 1.0}, WORKERS, settings=S, step=9)


def test_only_the_last_window_counts() -> None:
    old_slow = {s: [BASE[s] * 9] * 6 + xs for s, xs in steady().items()}
    assert isinstance(judge(old_slow, BASE, WORKERS, settings=S, step=9), Keep)


@pytest.mark.parametrize("kw, message", [
    ({"mode": "always"}, "is not one of"), ({"factor": 1.0}, "straggler_factor must be > 1"),
    ({"window": 0}, "straggler_window must be >= 1"), ({"window": 3, "persist": 4}, "between 1 and straggler_window"),
    ({"min_excess_s": -1.0}, "must be >= 0"),
])
def test_bad_settings_name_the_field(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerSettings(**kw)


# -- exhaustive: every pattern of slow steps for three slices over a window of three ------------------


def reference(pattern: dict[str, tuple[int, ...]], settings: StragglerSettings) -> tuple[str | None, bool]:
    """The rules written out plainly, in exact fractions (every baseline 10 ms, samples as multiples of it):
    the slice to move or None, and whether some slice sat exactly on a threshold (floats may fall either way)."""
    factor, excess_min = Fraction(settings.factor), Fraction(settings.min_excess_s)
    mean = {s: Fraction(sum(ms), len(ms)) for s, ms in pattern.items()}  # the window's slowdown
    cands, tie = [], False
    for s, ms in pattern.items():
        peers = sorted(mean[p] for p in pattern if p != s)
        peer = (peers[(len(peers) - 1) // 2] + peers[len(peers) // 2]) / 2
        excess = Fraction(1, 100) * (mean[s] - 1)
        tie = tie or mean[s] == factor * peer or abs(excess - excess_min) < Fraction(1, 10 ** 12)
        if mean[s] >= factor and mean[s] >= factor * peer and excess >= excess_min \
                and sum(m >= factor for m in ms) >= settings.persist:
            cands.append(s)
    if not cands:
        return None, tie
    return min(cands, key=lambda s: (-mean[s], s)), tie


@pytest.mark.parametrize("persist", [1, 2, 3])
def test_every_slow_pattern_of_three_slices_matches_the_rules(persist: int) -> None:
    cfg = StragglerSettings(factor=2.0, window=3, persist=persist, min_excess_s=0.005)
    levels = (1, 2, 6)  # at the baseline, at the factor, far past it
    slices = ("a", "b", "c")
    seen = 0
    for cells in itertools.product(levels, repeat=9):
        pattern = {s: tuple(cells[3 * i: 3 * i + 3]) for i, s in enumerate(slices)}
        samples = {s: [0.01 * m for m in ms] for s, ms in pattern.items()}
        got = judge(samples, {s: 0.01 for s in slices}, WORKERS, settings=cfg, step=100)
        want, tie = reference(pattern, cfg)
        if tie:
            continue
        if want is None:
            assert isinstance(got, Keep) and got.straggling == (), (pattern, got)
        else:
            assert isinstance(got, Migrate) and got.slice == want, (pattern, got)
            seen += 1
    assert seen > 0


# -- properties ---------------------------------------------------------------------------------------

SAMPLES = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                          st.lists(st.floats(0.0005, 1.0), min_size=4, max_size=4), min_size=2, max_size=4)


@settings(max_examples=300, deadline=None)
@given(samples=SAMPLES, scale=st.floats(0.5, 20.0))
def test_slowing_every_slice_alike_makes_no_slice_stand_out_from_its_peers(samples: dict, scale: float) -> None:
    base = {s: statistics.median(xs) for s, xs in samples.items()}
    slower = {s: [x * scale for x in xs] for s, xs in samples.items()}
    before, after = straggling(samples, base, S), straggling(slower, base, S)
    for s in samples:  # rule 2 compares with the peers: a slowdown for everyone changes no ratio
        assert (before[s]["slowdown"] >= 2.0 * before[s]["peers_slowdown"]) == \
            (after[s]["slowdown"] >= 2.0 * after[s]["peers_slowdown"]) or \
            abs(before[s]["slowdown"] - 2.0 * before[s]["peers_slowdown"]) < 1e-9 * before[s]["slowdown"]
        if after[s]["straggles"]:
            assert after[s]["slowdown"] >= 2.0 * after[s]["peers_slowdown"]


@settings(max_examples=300, deadline=None)
@given(samples=SAMPLES, who=st.sampled_from(["a", "b", "c", "d"]), factor=st.floats(4.0, 50.0))
def test_one_slice_persistently_far_slower_than_all_its_peers_is_moved(samples: dict, who: str, factor: float) -> None:
    if who not in samples:
        return
    base = {s: 0.01 for s in samples}
    calm = {s: [0.01] * 4 for s in samples}
    calm[who] = [0.01 * factor] * 4
    got = judge(calm, base, WORKERS, settings=S, step=9)
    assert isinstance(got, Migrate) and got.slice == who and got.worker == WORKERS[who]


@settings(max_examples=300, deadline=None)
@given(samples=SAMPLES, busy=st.sampled_from(["", "a drain runs"]), moved=st.integers(0, 20))
def test_a_decision_always_names_a_straggling_slice_and_keep_always_says_why(samples: dict, busy: str,
                                                                             moved: int) -> None:
    base = {s: statistics.median(xs) / 2 for s, xs in samples.items()}
    got = judge(samples, base, WORKERS, settings=S, step=20, busy=busy, moved_at={"a": moved})
    judged = straggling(samples, base, S)
    if isinstance(got, Migrate):
        assert not busy and judged[got.slice]["straggles"] and judged[got.slice]["slow_steps"] >= S.persist
        assert not (got.slice == "a" and 20 - moved < S.cooldown_steps)
        assert got.slice == max((s for s in judged if judged[s]["straggles"]),
                                key=lambda s: (judged[s]["slowdown"], [-ord(c) for c in s]))
    else:
        assert got.reason
        assert set(got.straggling) == {s for s, j in judged.items() if j["straggles"]}


def test_a_first_straggler_move_is_probation_and_a_second_within_the_window_keeps_the_worker_out() -> None:
    from rallypoint.recovery.stragglers import probation
    settings = StragglerSettings(probation_s=300.0, repeat_window_s=1000.0)
    first = probation([], 5000.0, settings)
    assert first.lapse_s == 300.0 and first.moves == (5000.0,)
    old = probation([3000.0], 5000.0, settings)  # the earlier move left the window: probation again
    assert old.lapse_s == 300.0 and old.moves == (5000.0,)
    again = probation([3000.0, 4500.0], 5000.0, settings)
    assert again.lapse_s is None and again.moves == (4500.0, 5000.0) and "2 times within 1000 s" in again.reason
    with pytest.raises(ValueError, match="straggler_probation_s"):
        StragglerSettings(probation_s=0.0)

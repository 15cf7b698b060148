"""The preemption policy: which lower-priority slices a job takes (pure; checked against brute force)."""

from __future__ import annotations

from itertools import chain, combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.recovery.fairness import Holding, NoVictims, Preempt, plan_preemption


def h(job: str, slice_name: str, worker: str, devices: int, priority: int) -> Holding:
    return Holding(job, slice_name, worker, devices, priority)


def test_takes_the_lowest_priority_slice_that_makes_room() -> None:
    holdings = [h("a", "s0", "w0", 1, 5), h("b", "s0", "w1", 1, 1)]
    got = plan_preemption({"x": 1}, priority=10, free={"w0": 0, "w1": 0}, holdings=holdings)
    assert got == Preempt(victims=(holdings[1],), places={"x": "w1"})


def test_never_takes_an_equal_or_higher_priority() -> None:
    holdings = [h("a", "s0", "w0", 2, 3), h("b", "s0", "w1", 2, 7)]
    got = plan_preemption({"x": 2}, priority=3, free={"w0": 0, "w1": 0}, holdings=holdings)
    assert isinstance(got, NoVictims)
    assert "needs 2 devices on one worker" in got.reason and "priority below 3" in got.reason


def test_two_low_slices_beat_one_higher_one_and_free_devices_count() -> None:
    holdings = [h("mid", "s", "w0", 2, 5), h("low", "a", "w1", 1, 1), h("low", "b", "w1", 1, 1)]
    got = plan_preemption({"x": 3}, priority=9, free={"w0": 1, "w1": 1}, holdings=holdings)
    assert isinstance(got, Preempt) and got.places == {"x": "w1"}
    assert sorted(v.slice for v in got.victims) == ["a", "b"]


def test_several_slices_are_placed_largest_first_and_a_victim_is_taken_once() -> None:
    holdings = [h("low", "a", "w0", 2, 0), h("low", "b", "w1", 1, 0)]
    got = plan_preemption({"small": 1, "big": 2}, priority=1, free={"w0": 0, "w1": 0}, holdings=holdings)
    assert isinstance(got, Preempt) and got.places == {"big": "w0", "small": "w1"}
    assert len(set(got.victims)) == 2


def test_a_bad_need_is_refused() -> None:
    with pytest.raises(ValueError, match="positive device count"):
        plan_preemption({"x": 0}, priority=1, free={}, holdings=[])


def subsets(xs):  # type: ignore[no-untyped-def]
    return chain.from_iterable(combinations(xs, k) for k in range(len(xs) + 1))


HOLDINGS = st.lists(st.builds(h, st.sampled_from(["j0", "j1", "j2"]), st.sampled_from(["s0", "s1", "s2"]),
                              st.sampled_from(["w0", "w1", "w2"]), st.integers(1, 3), st.integers(0, 4)),
                    max_size=6, unique_by=lambda x: (x.job, x.slice))


@settings(max_examples=400, deadline=None)
@given(holdings=HOLDINGS, need=st.integers(1, 6), priority=st.integers(0, 5),
       free=st.fixed_dictionaries({w: st.integers(0, 2) for w in ("w0", "w1", "w2")}))
def test_one_slice_gets_the_best_victims_a_brute_force_finds(holdings, need, priority, free) -> None:  # type: ignore[no-untyped-def]
    best = None
    for w in sorted(free):
        pool = [x for x in holdings if x.worker == w and x.priority < priority]
        for combo in subsets(pool):
            if free[w] + sum(v.devices for v in combo) >= need:
                cost = (max((v.priority for v in combo), default=-(2 ** 31)), len(combo),
                        sum(v.devices for v in combo), w, tuple(sorted((v.job, v.slice) for v in combo)))
                best = min(best, cost) if best is not None else cost
    got = plan_preemption({"x": need}, priority=priority, free=free, holdings=holdings)
    if best is None:
        assert isinstance(got, NoVictims)
        return
    assert isinstance(got, Preempt)
    w = got.places["x"]
    assert all(v.worker == w and v.priority < priority for v in got.victims)
    assert free[w] + sum(v.devices for v in got.victims) >= need
    cost = (max((v.priority for v in got.victims), default=-(2 ** 31)), len(got.victims),
            sum(v.devices for v in got.victims), w, tuple(sorted((v.job, v.slice) for v in got.victims)))
    assert cost == best


@settings(max_examples=300, deadline=None)
@given(holdings=HOLDINGS, needs=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(1, 4), min_size=1),
       priority=st.integers(0, 5), free=st.fixed_dictionaries({w: st.integers(0, 2) for w in ("w0", "w1", "w2")}))
def test_every_plan_for_several_slices_is_feasible_and_takes_only_lower_priorities(holdings, needs, priority,
                                                                                    free) -> None:  # type: ignore[no-untyped-def]
    got = plan_preemption(needs, priority=priority, free=free, holdings=holdings)
    if isinstance(got, NoVictims):
        return
    assert set(got.places) == set(needs) and len(set(got.victims)) == len(got.victims)
    assert all(v.priority < priority for v in got.victims)
    for w in free:  # each worker's room (free plus what was taken there) covers what is placed on it
        placed = sum(n for s, n in needs.items() if got.places[s] == w)
        assert free[w] + sum(v.devices for v in got.victims if v.worker == w) >= placed

"""The warm-spare policy (recovery/warm.py): hand cases, and properties over every small input."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.recovery.remap import Remap, RemapPolicy, plan_remap
from rallypoint.recovery.warm import DEFAULT_PER_SPARE, plan_warm, warm_devices
from tests.helpers.snapshots import cluster, worker


def test_off_warms_nothing() -> None:
    assert plan_warm({"a": 4, "b": 4}, {"s0": 1}, max_spares=0) == {}


def test_no_spare_or_no_room_warms_nothing() -> None:
    assert plan_warm({}, {"s0": 1}, max_spares=2) == {}
    assert plan_warm({"a": 1}, {"s0": 2}, max_spares=2) == {}


def test_every_slice_on_the_spare_a_remap_would_take_then_backups_in_fallback_order() -> None:
    got = plan_warm({"a": 2, "b": 2, "c": 2}, {"s0": 1, "s1": 1, "s2": 1}, max_spares=2)
    assert got == {"a": ["s0", "s1", "s2"], "b": ["s0", "s1", "s2"]}


def test_tightest_fit_first_and_a_big_slice_only_where_it_fits() -> None:
    got = plan_warm({"big": 8, "small": 2, "mid": 4}, {"x": 1, "y": 4, "z": 2}, max_spares=1)
    assert got == {"mid": ["y", "z", "x"]}
    got = plan_warm({"big": 8, "small": 2, "mid": 4}, {"x": 1, "y": 4, "z": 2}, max_spares=3)
    assert got == {"big": ["y", "z", "x"], "mid": ["y", "z", "x"], "small": ["z", "x"]}


def test_the_per_spare_budget_spreads_slices_over_more_spares() -> None:
    got = plan_warm({"a": 1, "b": 1}, {"s0": 1, "s1": 1, "s2": 1}, max_spares=2, per_spare=2)
    assert got == {"a": ["s0", "s1"], "b": ["s0", "s2"]}
    assert set().union(*got.values()) == {"s0", "s1", "s2"}


def test_a_spare_of_zero_free_devices_warms_nothing() -> None:
    assert plan_warm({"full": 0, "b": 1}, {"s0": 1}, max_spares=2) == {"b": ["s0"]}


@pytest.mark.parametrize("kwargs, field", [
    ({"max_spares": -1}, "warm_spares"), ({"max_spares": 1.5}, "warm_spares"), ({"max_spares": True}, "warm_spares"),
    ({"max_spares": 1, "per_spare": 0}, "per_spare"),
])
def test_a_bad_budget_is_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        plan_warm({"a": 1}, {"s0": 1}, **kwargs)


def test_a_bad_device_count_is_refused() -> None:
    with pytest.raises(ValueError, match="slice 's0'"):
        plan_warm({"a": 1}, {"s0": 0}, max_spares=1)
    with pytest.raises(ValueError, match="spare 'a'"):
        plan_warm({"a": -1}, {"s0": 1}, max_spares=1)


def test_warm_devices_are_the_lowest_free_as_a_remap_leases_them() -> None:
    assert warm_devices([5, 1, 3, 2], 2) == (1, 2)
    snap = cluster(worker("w", 6, held=[0, 4]))
    (a,) = plan_remap(snap, {"s": 3}, RemapPolicy()).assignments  # type: ignore[union-attr]
    assert warm_devices(snap.workers["w"].free, 3) == a.devices


def best_coverage(spares: dict[str, int], slices: dict[str, int], max_spares: int, per_spare: int) -> int:
    """Brute force: the most slices warm on at least one spare under the budget, over every assignment."""
    names, options = sorted(slices), [None, *sorted(spares)]
    best = 0
    for choice in itertools.product(options, repeat=len(names)):
        used = [w for w in choice if w is not None]
        if len(set(used)) > max_spares or any(used.count(w) > per_spare for w in set(used)):
            continue
        if all(w is None or spares[w] >= slices[s] for s, w in zip(names, choice, strict=True)):
            best = max(best, len(used))
    return best


spares_st = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 4), max_size=4)
slices_st = st.dictionaries(st.sampled_from(["s0", "s1", "s2", "s3"]), st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(spares_st, slices_st, st.integers(0, 4), st.integers(1, 3))
def test_properties(spares: dict[str, int], slices: dict[str, int], max_spares: int, per_spare: int) -> None:
    plan = plan_warm(spares, slices, max_spares=max_spares, per_spare=per_spare)
    # The budget holds, and a spare warms only slices it has room for, each once, largest first.
    assert len(plan) <= max_spares
    for w, held in plan.items():
        assert held and len(held) <= per_spare and len(set(held)) == len(held)
        assert all(spares[w] >= slices[s] for s in held)
        assert held == sorted(held, key=lambda s: (-slices[s], s))
    # Every slice is warm somewhere whenever some assignment under the budget could make it so.
    covered = {s for held in plan.values() for s in held}
    assert len(covered) == best_coverage(spares, slices, max_spares, per_spare)
    # Deterministic, and blind to the order the inputs come in.
    again = plan_warm(dict(reversed(list(spares.items()))), dict(reversed(list(slices.items()))),
                      max_spares=max_spares, per_spare=per_spare)
    assert again == plan
    # Where the budget has room, a slice is warm on the very spare a remap of it alone would take.
    if max_spares >= len(spares) and per_spare >= len(slices):
        snap = cluster(*(worker(w, n) for w, n in spares.items()))
        for s, need in slices.items():
            decision = plan_remap(snap, {s: need}, RemapPolicy(on_no_spare="fail"))
            if isinstance(decision, Remap):
                (a,) = decision.assignments
                assert s in plan[a.worker], (s, a.worker, plan)
        # ... and on every spare with room for it: a spare holds whatever it could take.
        for w, n in spares.items():
            assert set(plan.get(w, [])) == {s for s, need in slices.items() if n >= need}


def test_default_per_spare_is_a_positive_budget() -> None:
    assert DEFAULT_PER_SPARE >= 1

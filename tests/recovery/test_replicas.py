"""The replica holder policy (recovery/replicas.py): hand cases and hypothesis properties."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.recovery.replicas import part_name, plan_replicas, replica_sources, with_parts, worker_ring

WORKERS = [f"w{i}" for i in range(6)]
SLICES = [f"stage{i}" for i in range(6)]


def test_pipeline_ring_each_worker_holds_the_next_one_back() -> None:
    placement = {"stage0": "w1", "stage1": "w2", "stage2": "w3"}
    assert plan_replicas(placement, ["w4"]) == {"stage0": "w2", "stage1": "w3", "stage2": "w1"}


def test_one_worker_job_uses_the_first_spare_and_none_without_one() -> None:
    assert plan_replicas({"a": "w1", "b": "w1"}, ["w9", "w4", "w1"]) == {"a": "w4", "b": "w4"}
    assert plan_replicas({"a": "w1"}, []) == {}
    assert plan_replicas({"a": "w1"}, ["w1"]) == {}
    assert plan_replicas({}, ["w1"]) == {}


def test_a_moved_slice_keeps_the_other_holders() -> None:
    before = plan_replicas({"stage0": "w1", "stage1": "w2", "stage2": "w3"})
    after = plan_replicas({"stage0": "w1", "stage1": "w2", "stage2": "w4"})
    assert after["stage0"] == before["stage0"] and after["stage2"] == before["stage2"] == "w1"
    assert after["stage1"] == "w4"  # the holder that was lost is replaced by the worker that took its place


def test_sources_put_the_old_holder_first_and_skip_lost_ones() -> None:
    previous = {"stage0": "w2", "stage1": "w3", "stage2": "w1"}
    current = {"stage0": "w2", "stage1": "w4", "stage2": "w1"}
    alive = ["w1", "w2", "w4"]
    assert replica_sources(previous, current, ["stage1", "stage2"], alive) == {"stage1": ["w4"], "stage2": ["w1"]}
    assert replica_sources({"a": "w5"}, {"a": "w4"}, ["a"], ["w5", "w4"]) == {"a": ["w5", "w4"]}
    assert replica_sources({}, {}, ["stage9"], alive) == {}


placements = st.dictionaries(st.sampled_from(SLICES), st.sampled_from(WORKERS), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(placements, st.lists(st.sampled_from(WORKERS + ["s1", "s2"]), max_size=4))
def test_properties(placement: dict[str, str], spares: list[str]) -> None:
    plan = plan_replicas(placement, spares)
    ring = worker_ring(placement)
    for s, holder in plan.items():
        assert holder != placement[s], "a slice's copy must live on another worker"
    if len(ring) >= 2:
        assert set(plan) == set(placement)
        assert set(plan.values()) <= set(ring), "a multi-worker job keeps its copies among its own workers"
        # every worker holds the copies of exactly one other worker
        per_holder = Counter(plan.values())
        assert set(per_holder) == set(ring)
        owners = {h: {placement[s] for s in plan if plan[s] == h} for h in per_holder}
        assert all(len(o) == 1 for o in owners.values())
    else:
        spare_set = set(spares) - set(ring)
        assert (plan == {}) == (not spare_set)
        assert all(h in spare_set for h in plan.values())
    assert plan == plan_replicas(dict(reversed(list(placement.items()))), list(reversed(spares))), "order-free"


def test_a_multi_host_slices_parts_are_held_off_their_members_workers() -> None:
    """Each member's part of a gang is planned as a slice of its own, on its member's worker: its holder is
    another worker, so with the member's own copy (workers/gang/replicas.py) two hosts hold every part."""
    where = with_parts({"dp": "w0", "head": "w2"}, {"dp": ["w0", "w1"]})
    assert where == {"dp": "w0", "dp#0": "w0", "dp#1": "w1", "head": "w2"}
    plan = plan_replicas(where)
    assert all(plan[part_name("dp", j)] != w for j, w in enumerate(["w0", "w1"])), plan
    assert plan == {"dp": "w1", "dp#0": "w1", "dp#1": "w2", "head": "w0"}
    # a gang alone: its two members hold each other's part
    assert plan_replicas(with_parts({"dp": "w0"}, {"dp": ["w0", "w1"]})) == {"dp": "w1", "dp#0": "w1", "dp#1": "w0"}

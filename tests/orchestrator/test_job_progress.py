"""JobProgress alone: instances, steps, grants, the cut (up and down) and the log floor, no executor."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.orchestrator.job.progress import JobProgress
from rallypoint.recovery.replay import Graph
from tests.helpers.executor import eval_spec, progress, run


def test_a_step_completes_when_every_instance_is_heard_and_the_grant_follows() -> None:
    p = progress()
    assert p.widen(2) and p.granted == 2
    p.instance(pb.InstanceDone(node="fwd0", step=0))
    assert p.complete() == [] and p.done_through("fwd0") == 1 and p.done_through("fwd1") == 0
    p.instance(pb.InstanceDone(node="fwd1", step=0, metrics={"loss": 2.0}))
    done = p.complete()
    assert [(d.step, d.metrics) for d in done] == [(0, {"loss": 2.0})] and p.completed == 1
    assert p.widen(2) and p.granted == 3
    assert not p.widen(2)  # nothing new to grant


def test_an_instance_heard_again_counts_as_replayed_not_as_progress() -> None:
    p = progress()
    run(p, 0)
    assert not p.instance(pb.InstanceDone(node="fwd0", step=0, compute_s=0.25))
    assert p.replayed["fwd0"] == 1 and p.redone_s == 0.25 and p.compute_s["fwd0"] == 0.5 and p.completed == 1


def test_the_cut_rises_once_every_slice_with_states_committed_a_step() -> None:
    p = progress()
    assert p.commit("s0", 5) is None and p.cut == 0  # s1 has not committed 5
    assert p.saved("s0", 5) and not p.saved("s1", 5)
    assert p.commit("s1", 5) == 5 and p.cut == 5
    assert p.commit("s1", 10) is None and p.commit("s0", 10) == 10
    assert p.commit("s0", 5) is None and p.cut == 10  # an old commit heard again (a replay) moves nothing


def test_the_cut_never_passes_a_step_a_slice_without_states_has_not_reached() -> None:
    # Slice ev holds no state and saves nothing: restarted from a cut past its progress, it would skip the steps
    # between (held at 13 and 14 here) and the job would wait on them for ever.
    spec = eval_spec()
    p = JobProgress(spec, Graph.from_spec(spec))
    for step in range(13):
        for node in ("fwd0", "fwd1", "held", *(["evaluate"] if step % 3 == 0 else [])):
            p.instance(pb.InstanceDone(node=node, step=step))
    for step in (13, 14):  # the stages run on; ev is stuck before step 13
        for node in ("fwd0", "fwd1"):
            p.instance(pb.InstanceDone(node=node, step=step))
    assert [d.step for d in p.complete()][-1] == 12 and p.stateless_through == 13
    for s in ("s0", "s1"):
        p.commit(s, 10)
    assert p.cut == 10
    assert p.commit("s0", 15) is None and p.commit("s1", 15) is None and p.cut == 10  # ev has not reached 15
    for step in (13, 14):
        p.instance(pb.InstanceDone(node="held", step=step))
    p.instance(pb.InstanceDone(node="evaluate", step=15))  # ev runs ahead: its next instance is at 15
    assert p.stateless_through == 15
    assert p.commit("s0", 20) == 15 == p.cut  # the commits at 15 count once ev passed them (a later one heard)


def test_a_restore_from_an_older_cut_lowers_it_and_forgets_commits_past_it() -> None:
    p = progress()
    for s in ("s0", "s1"):
        p.commit(s, 5)
        p.commit(s, 10)
    p.floor(["fwd1"], 12)
    assert p.cut == 10 and p.log_floor == {"fwd1": 12}
    p.drop_commit("s1", 10)  # it did not restore
    assert p.restored(5, {"s0": [5, 10], "s1": [5]}) == 5 and p.cut == 5
    assert p.log_floor == {"fwd1": 12}
    assert p.commit("s0", 15) is None  # s0's 10 still counts, s1's does not: no cut past 5 yet
    assert p.commit("s1", 10) == 10  # saved anew by the replay
    assert p.log_floor == {"fwd1": 12}
    assert p.commit("s1", 15) == 15 and p.log_floor == {}  # a floor at or below the cut is gone


def test_a_restore_that_falls_back_ignores_the_commits_past_the_bad_cut_even_if_etcd_keeps_them() -> None:
    p = progress()
    for s in ("s0", "s1"):
        p.commit(s, 10)
    assert p.restored(5, {"s0": [5], "s1": [5]}) == 5  # the caller passed only the commits below the bad cut
    assert p.commit("s0", 10) is None and p.cut == 5
    assert p.commit("s1", 10) == 10


def test_begin_from_a_resumed_cut_counts_only_later_steps() -> None:
    p = progress()
    p.begin(10, {"s0": [5, 10], "s1": [5, 10]})
    assert (p.start, p.completed, p.granted, p.cut) == (10, 10, 10, 10)
    assert p.done_through("fwd0") == 10
    assert run(p, 10) == [10]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["s0", "s1"]), st.sampled_from([5, 10, 15])), max_size=12))
def test_the_cut_is_always_the_newest_step_every_slice_committed(commits: list[tuple[str, int]]) -> None:
    p = progress()
    seen: dict[str, set[int]] = {"s0": set(), "s1": set()}
    for s, step in commits:
        p.commit(s, step)
        seen[s].add(step)
        assert p.cut == max(seen["s0"] & seen["s1"], default=0)

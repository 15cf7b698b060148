"""The remap policy (recovery/remap.py) over fake clusters: hand cases and hypothesis properties."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.etcd.cluster_view import ClusterSnapshot
from rallypoint.recovery.remap import Assignment, NoRoom, Remap, RemapPolicy, Shrink, Wait, eligible, plan_remap
from tests.helpers.snapshots import cluster, worker


WAIT = RemapPolicy(on_no_spare="wait", wait_timeout_s=60.0)
SHRINK = RemapPolicy(on_no_spare="shrink", wait_timeout_s=0.0)
FAIL = RemapPolicy(on_no_spare="fail", wait_timeout_s=0.0)


def test_a_lost_slice_goes_to_a_whole_spare_not_beside_another_job() -> None:
    snap = cluster(worker("busy", 8, held=[0, 1]), worker("spare", 4))
    assert plan_remap(snap, {"stage1": 2}, WAIT) == Remap(assignments=(Assignment("stage1", "spare", (0, 1), 2),))


def test_the_slices_of_one_lost_host_land_together_on_one_replacement() -> None:
    snap = cluster(worker("a", 4), worker("b", 4), worker("c", 8))
    got = plan_remap(snap, {"stage0": 2, "stage1": 2}, WAIT)
    assert got == Remap(assignments=(Assignment("stage0", "a", (0, 1), 2), Assignment("stage1", "a", (2, 3), 2)))


def test_largest_first_and_tightest_spare() -> None:
    snap = cluster(worker("big", 8), worker("small", 2), worker("mid", 4))
    got = plan_remap(snap, {"x": 1, "y": 4, "z": 2}, WAIT)
    assert got == Remap(assignments=(Assignment("y", "mid", (0, 1, 2, 3), 4), Assignment("z", "small", (0, 1), 2),
                                     Assignment("x", "big", (0,), 1)))


def test_a_partly_leased_worker_is_the_last_resort() -> None:
    snap = cluster(worker("busy", 8, held=[0, 3]), worker("spare", 2))
    got = plan_remap(snap, {"s": 4}, WAIT)
    assert got == Remap(assignments=(Assignment("s", "busy", (1, 2, 4, 5), 4),))


def test_cordoned_leaving_and_lost_workers_are_never_used() -> None:
    snap = cluster(worker("cord", 4, cordoned=True), worker("leave", 4, state="leaving"),
                   worker("dead", 4, incarnation=5), worker("back", 4, incarnation=9),
                   lost={"dead": {"incarnation": 5}, "back": {"incarnation": 3}})
    got = plan_remap(snap, {"s": 4}, WAIT)
    assert got == Remap(assignments=(Assignment("s", "back", (0, 1, 2, 3), 4),))  # re-registered: a new incarnation
    assert plan_remap(snap, {"s": 4}, WAIT, exclude=frozenset({"back"})) == Wait(
        missing={"s": 4}, timeout_s=60.0, waited_s=0.0, largest_free=0)
    assert not eligible("dead", snap.workers["dead"], snap) and eligible("back", snap.workers["back"], snap)
    flagged_only = ClusterSnapshot(revision=1, workers={"a": worker("a", cordoned=True)}, cordoned=frozenset())
    listed_only = ClusterSnapshot(revision=1, workers={"a": worker("a")}, cordoned=frozenset({"a"}))
    for snap in (flagged_only, listed_only):
        assert isinstance(plan_remap(snap, {"s": 1}, FAIL), NoRoom)


def test_a_lost_incarnation_is_excluded_and_a_newer_one_of_the_same_worker_is_not() -> None:
    snap = cluster(worker("w1", 4, incarnation=300))
    assert plan_remap(snap, {"s": 4}, FAIL, lost_incarnations={"w1": 300}) == NoRoom(
        missing={"s": 4}, reason=plan_remap(cluster(), {"s": 4}, FAIL).reason)
    assert plan_remap(snap, {"s": 4}, FAIL, lost_incarnations={"w1": 101}) == Remap(
        assignments=(Assignment("s", "w1", (0, 1, 2, 3), 4),))
    assert not eligible("w1", snap.workers["w1"], snap, lost={"w1": 301})
    assert eligible("w1", snap.workers["w1"], snap, lost={"w1": 299})


def test_no_lost_slices_is_an_empty_remap() -> None:
    assert plan_remap(cluster(), {}, FAIL) == Remap(assignments=())


def test_wait_then_fail_after_the_timeout() -> None:
    snap = cluster(worker("a", 2))
    got = plan_remap(snap, {"s": 4}, WAIT, waited_s=20.0)
    assert got == Wait(missing={"s": 4}, timeout_s=60.0, waited_s=20.0, largest_free=2)
    assert isinstance(got, Wait) and got.remaining_s == 40.0
    late = plan_remap(snap, {"s": 4}, WAIT, waited_s=60.0)
    assert isinstance(late, NoRoom) and late.missing == {"s": 4}
    assert late.reason.startswith("lost slice 's' (4 devices) finds no live, uncordoned worker with that many free")
    assert "waited 60 s of wait_timeout_s=60" in late.reason and "raise wait_timeout_s" in late.reason


def test_shrink_onto_a_divisor_of_the_old_count() -> None:
    snap = cluster(worker("a", 3), worker("b", 4, held=[0, 1, 2]))
    got = plan_remap(snap, {"s": 4}, SHRINK)
    assert got == Shrink(assignments=(Assignment("s", "a", (0, 1), 4),))  # 3 free, 2 divides 4
    assert isinstance(got, Shrink) and got.shrunk == {"s": 2} and got.assignments[0].shrunk


def test_shrink_places_the_slices_that_fit_at_full_size() -> None:
    snap = cluster(worker("a", 4), worker("b", 2))
    got = plan_remap(snap, {"big": 6, "ok": 4}, SHRINK)
    assert got == Shrink(assignments=(Assignment("ok", "a", (0, 1, 2, 3), 4), Assignment("big", "b", (0, 1), 6)))
    assert isinstance(got, Shrink) and got.shrunk == {"big": 2}


def test_shrink_with_no_free_device_at_all_fails() -> None:
    got = plan_remap(cluster(worker("a", 2, held=[0, 1])), {"s": 2}, SHRINK)
    assert isinstance(got, NoRoom) and "(the most free on one is 0; on_no_spare='shrink' needs a worker with at least 1" \
        in got.reason


def test_shrink_only_onto_the_counts_the_slice_was_exported_for() -> None:
    snap = cluster(worker("a", 3), worker("b", 4, held=[0, 1, 2]))
    got = plan_remap(snap, {"s": 4}, SHRINK, allowed={"s": (4, 2)})
    assert got == Shrink(assignments=(Assignment("s", "a", (0, 1), 4),))
    low = plan_remap(cluster(worker("a", 1), worker("b", 4, held=[0, 1, 2, 3])), {"s": 4}, SHRINK,
                     allowed={"s": (4, 2)})
    assert isinstance(low, NoRoom)
    assert "needs a worker with at least 2 free devices for 's', the fewest it runs on (its device counts: [2, 4])" \
        in low.reason and "lower the slice's minimum (devices=(min, max))" in low.reason


def test_fail_names_the_slice_the_count_the_largest_free_and_the_setting() -> None:
    got = plan_remap(cluster(worker("a", 3), worker("b", 4, held=[0])), {"stage2": 4}, FAIL)
    assert got == NoRoom(missing={"stage2": 4}, reason=(
        "lost slice 'stage2' (4 devices) finds no live, uncordoned worker with that many free devices (the most "
        "free on one is 3; on_no_spare='fail'). To go on, add a worker with at least 4 free devices, or set "
        "on_no_spare='wait' to wait for a worker, or declare the slice devices=(min, max) and set "
        "on_no_spare='shrink' to restore onto fewer devices in the job's recovery policy"))
    two = plan_remap(cluster(worker("a", 3)), {"x": 4, "y": 6}, FAIL)
    assert isinstance(two, NoRoom) and two.reason.startswith("lost slices 'y' (6 devices), 'x' (4 devices) find no ")
    assert "at least 6 free devices" in two.reason


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"on_no_spare": "pray"}, "on_no_spare must be one of"),
    ({"wait_timeout_s": -1.0}, "wait_timeout_s must be a finite number"),
    ({"wait_timeout_s": float("inf")}, "wait_timeout_s must be a finite number"),
])
def test_bad_policies_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RemapPolicy(**kwargs)


def test_policy_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        RemapPolicy("wait", 1.0)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        WAIT.on_no_spare = "fail"  # type: ignore[misc]


def test_a_bad_device_count_is_refused() -> None:
    with pytest.raises(ValueError, match="lost slice 's' needs a positive device count"):
        plan_remap(cluster(worker("a")), {"s": 0}, WAIT)


# --- properties ------------------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> tuple[ClusterSnapshot, dict[str, int]]:
    workers, lost = [], {}
    for i in range(draw(st.integers(0, 7))):
        n = draw(st.integers(1, 8))
        held = draw(st.sets(st.integers(0, n - 1), max_size=n)) if draw(st.booleans()) else set()
        workers.append(worker(f"w{i}", n, held=held, cordoned=draw(st.integers(0, 5)) == 0,
                              state="leaving" if draw(st.integers(0, 6)) == 0 else "serving", incarnation=10 + i))
        if draw(st.integers(0, 5)) == 0:
            lost[f"w{i}"] = {"incarnation": draw(st.sampled_from([10 + i, 1]))}
    slices = draw(st.dictionaries(st.sampled_from([f"s{i}" for i in range(6)]), st.integers(1, 6), max_size=5))
    return cluster(*workers, lost=lost), slices


POLICIES = st.builds(RemapPolicy, on_no_spare=st.sampled_from(["wait", "shrink", "fail"]),
                     wait_timeout_s=st.floats(0, 100))


@settings(max_examples=300, deadline=None)
@given(clusters(), POLICIES, st.floats(0, 200), st.frozensets(st.sampled_from([f"w{i}" for i in range(7)])))
def test_remap_properties(case: tuple[ClusterSnapshot, dict[str, int]], policy: RemapPolicy, waited_s: float,
                          exclude: frozenset[str]) -> None:
    snap, lost = case
    got = plan_remap(snap, lost, policy, exclude=exclude, waited_s=waited_s)
    assert got == plan_remap(snap, dict(reversed(list(lost.items()))), policy, exclude=exclude, waited_s=waited_s)
    usable = {w for w, s in snap.workers.items()
              if not s.cordoned and w not in snap.cordoned and s.info.state != "leaving" and w not in exclude
              and snap.lost.get(w, {}).get("incarnation") != s.info.incarnation}
    assert usable == {w for w, s in snap.workers.items() if eligible(w, s, snap, exclude)}
    big_enough = [w for w in usable if len(snap.workers[w].free) >= max(lost.values(), default=0)]
    if len(big_enough) >= len(lost):
        assert isinstance(got, Remap)  # enough room for every slice on a worker of its own
    if isinstance(got, (Wait, NoRoom)):
        assert got.missing and set(got.missing) <= set(lost)
        assert all(lost[s] == n for s, n in got.missing.items())
        if isinstance(got, Wait):
            assert policy.on_no_spare == "wait" and waited_s < policy.wait_timeout_s
        else:
            assert all(s in got.reason for s in got.missing) and "on_no_spare" in got.reason
        return
    assert isinstance(got, (Remap, Shrink))
    assert sorted(a.slice for a in got.assignments) == sorted(lost)
    if isinstance(got, Remap):
        assert not any(a.shrunk for a in got.assignments)
    else:
        assert policy.on_no_spare == "shrink" and got.shrunk
    spare = {w for w in usable if not snap.workers[w].holders}
    free = {w: set(snap.workers[w].free) for w in usable}
    for a in got.assignments:  # in placement order: replay the choices
        assert a.worker in usable and a.needed == lost[a.slice]
        assert list(a.devices) == sorted(a.devices) and set(a.devices) <= free[a.worker]  # free, not taken twice
        if a.shrunk:
            assert 1 <= len(a.devices) < a.needed and a.needed % len(a.devices) == 0
        else:
            assert len(a.devices) == a.needed
            if a.worker not in spare:  # whole spares first
                assert all(len(free[w]) < a.needed for w in spare)
        free[a.worker] -= set(a.devices)

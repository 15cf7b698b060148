"""The applied-exactly-once invariant's lineage logic (chaos/invariants.py), on recorded runtimes: no processes.

Each runtime is what ``read_records`` gives for one runtime file: its header (slices, the step it started at,
the checkpoint step it restored, when it was loaded) and the instances it ran. Slice ``s0`` runs node ``a``
once per step, ``s1`` node ``b`` per microbatch (2), both with state; ``s2`` runs ``e`` every 3 steps and
holds no state.
"""

from __future__ import annotations

from rallypoint.chaos.invariants import NodeInfo, check_applied_once

NODES = {"a": NodeInfo("s0", 1, False), "b": NodeInfo("s1", 1, True)}
MBS = (0, 1)


def runtime(name: str, slices: list[str], start: int, restored: int | None, inst: list[tuple[str, int, int]],
            at: float) -> dict:
    return {"runtime": name, "slices": slices, "start_step": start, "restored_from": restored, "loaded_at": at,
            "instances": [{"n": n, "s": s, "m": m} for n, s, m in inst]}


def full(node: str, lo: int, hi: int, mbs: tuple[int, ...]) -> list[tuple[str, int, int]]:
    return [(node, s, m) for s in range(lo, hi) for m in mbs]


def check(runtimes: list[dict], *, steps: int, nodes: dict[str, NodeInfo] = NODES, stateless: tuple[str, ...] = ()):
    return check_applied_once(sorted(runtimes, key=lambda r: r["loaded_at"]), nodes, microbatches=2, steps=steps,
                              stateless=stateless)


def test_applied_once_accepts_a_lineage_restored_at_a_cut_and_catches_gaps_skips_and_repeats() -> None:
    a_all = runtime("w0", ["s0"], 0, None, full("a", 0, 6, (-1,)), 1.0)
    b_dead = runtime("w1", ["s1"], 0, None, full("b", 0, 4, MBS) + [("b", 5, 0)], 1.0)  # ran ahead, then died
    b_new = runtime("w2", ["s1"], 3, 3, full("b", 3, 6, MBS), 2.0)
    ok = check([a_all, b_dead, b_new], steps=6)
    assert ok.ok, ok.evidence
    skipped = runtime("w2", ["s1"], 4, 3, full("b", 4, 6, MBS), 2.0)  # restored 3, started at 4: no replay
    bad = check([a_all, b_dead, skipped], steps=6)
    assert not bad.ok and "started at step 4 but restored the checkpoint of step 3" in bad.evidence
    gap = runtime("w2", ["s1"], 3, 3, full("b", 3, 6, MBS)[:-1], 2.0)
    bad = check([a_all, b_dead, gap], steps=6)
    assert not bad.ok and "never ran 1 instances: b@5/1" in bad.evidence
    twice = runtime("w0", ["s0"], 0, None, full("a", 0, 6, (-1,)) + [("a", 2, -1)], 1.0)
    bad = check([twice, b_dead, b_new], steps=6)
    assert not bad.ok and "ran a step 2 microbatch -1 twice" in bad.evidence


def adoption(*, replayed: int, lost_ran: int = 8, skip: tuple[str, int, int] | None = None) -> list[dict]:
    """s1's worker is lost at step 7 (it made the checkpoint of step 6 first); the leader's recovery loads s1's
    replacement at the cut it knew (3), which replays ``replayed`` steps before the leader is lost too; the next
    leader adopts the job and reloads every slice from the newest cut, 6, made by the lost worker's runtime."""
    lost = [x for x in full("b", 0, lost_ran, MBS) if x != skip]
    return [
        runtime("w0-1-a", ["s0"], 0, None, full("a", 0, 8, (-1,)), 1.0),
        runtime("w1-1-b", ["s1"], 0, None, lost, 1.0),
        runtime("w5-1-c", ["s1"], 3, 3, full("b", 3, 3 + replayed, MBS), 2.0),  # the recovery, cut short
        runtime("w0-1-d", ["s0"], 6, 6, full("a", 6, 10, (-1,)), 3.0),  # the adoption: every slice from 6
        runtime("w5-1-e", ["s1"], 6, 6, full("b", 6, 10, MBS), 3.0),
    ]


def test_a_recovery_finished_by_adoption_carries_on_from_the_checkpoint_the_lost_runtime_made() -> None:
    for replayed in (0, 1):  # the replacement replayed nothing, or part of what it had to
        ok = check(adoption(replayed=replayed), steps=10)
        assert ok.ok, ok.evidence
    assert "5 runtimes over 2 slices" in ok.evidence


def test_an_adoption_from_a_checkpoint_no_runtime_applied_fully_is_caught() -> None:
    bad = check(adoption(replayed=0, skip=("b", 4, 1)), steps=10)  # the lost runtime never ran b@4/1
    assert not bad.ok
    assert ("runtime w5-1-e restored the checkpoint of step 6, but no earlier runtime applied every instance "
            "before it: the nearest, w1-1-b (steps 0..6), never ran 1 instances: b@4/1") in bad.evidence
    short = check(adoption(replayed=0, lost_ran=5), steps=10)  # no runtime got to step 6 at all
    assert not short.ok and "never ran 2 instances: b@5/0, b@5/1" in short.evidence


def test_a_replay_another_runtime_completed_counts_that_runtimes_instances() -> None:
    """s1's replacement A restores 3 and replays step 3 before it is lost; B restores 3 again and does it all."""
    a_all = runtime("w0-1-a", ["s0"], 0, None, full("a", 0, 10, (-1,)), 1.0)
    lost = runtime("w1-1-b", ["s1"], 0, None, full("b", 0, 5, MBS), 1.0)
    a = runtime("w5-1-c", ["s1"], 3, 3, full("b", 3, 4, MBS) + [("b", 4, 0)], 2.0)
    b = runtime("w6-1-d", ["s1"], 3, 3, full("b", 3, 10, MBS), 3.0)
    ok = check([a_all, lost, a, b], steps=10)
    assert ok.ok, ok.evidence
    b_short = runtime("w6-1-d", ["s1"], 3, 3, [x for x in full("b", 3, 10, MBS) if x != ("b", 3, 1)], 3.0)
    bad = check([a_all, lost, a, b_short], steps=10)  # what A ran does not stand in for what B skipped
    assert not bad.ok and "runtime w6-1-d (steps 3..10) never ran 1 instances: b@3/1" in bad.evidence


STATELESS = {**NODES, "e": NodeInfo("s2", 3, False)}


def test_a_slice_without_state_may_start_anywhere_without_a_checkpoint() -> None:
    """s2 holds no state: the adoption reloads it at 7 with nothing to restore (restored None)."""
    base = [runtime("w0-1-a", ["s0"], 0, None, full("a", 0, 10, (-1,)), 1.0),
            runtime("w1-1-b", ["s1"], 0, None, full("b", 0, 10, MBS), 1.0)]
    e_old = runtime("w2-1-c", ["s2"], 0, None, [("e", 0, -1), ("e", 3, -1), ("e", 6, -1)], 1.0)
    e_new = runtime("w5-1-d", ["s2"], 7, None, [("e", 9, -1)], 3.0)
    ok = check([*base, e_old, e_new], steps=10, nodes=STATELESS, stateless=("s2",))
    assert ok.ok, ok.evidence
    # A slice with state started past 0 without restoring that step is still caught.
    bad = check([*base, e_old, e_new], steps=10, nodes=STATELESS)
    assert not bad.ok and "started at step 7 but restored the checkpoint of step None" in bad.evidence
    # Every instance of a slice without state must still have run somewhere, once per runtime.
    e_short = runtime("w2-1-c", ["s2"], 0, None, [("e", 0, -1), ("e", 3, -1)], 1.0)
    bad = check([*base, e_short, e_new], steps=10, nodes=STATELESS, stateless=("s2",))
    assert not bad.ok and "slice s2 (no state): no runtime of it ran 1 instances: e@6/-1" in bad.evidence
    e_twice = runtime("w5-1-d", ["s2"], 7, None, [("e", 9, -1), ("e", 9, -1)], 3.0)
    bad = check([*base, e_old, e_twice], steps=10, nodes=STATELESS, stateless=("s2",))
    assert not bad.ok and "runtime w5-1-d ran e step 9 microbatch -1 twice" in bad.evidence


def test_an_instance_applied_again_on_a_restored_state_is_caught() -> None:
    """The adoption's s1 runtime restored step 6 and ran b@5/0 again: step 5 applied twice along the lineage."""
    runtimes = adoption(replayed=0)
    runtimes[-1]["instances"].insert(0, {"n": "b", "s": 5, "m": 0})
    bad = check(runtimes, steps=10)
    assert not bad.ok and ("runtime w5-1-e started at step 6 but ran b step 5 microbatch 0: applied again on a "
                           "state that had it") in bad.evidence


def test_a_doubled_instance_in_a_runtime_whose_work_was_thrown_away_is_still_caught() -> None:
    runtimes = adoption(replayed=1)
    runtimes[2]["instances"].append({"n": "b", "s": 3, "m": 0})  # the cut-short replay ran b@3/0 twice
    bad = check(runtimes, steps=10)
    assert not bad.ok and "runtime w5-1-c ran b step 3 microbatch 0 twice" in bad.evidence


def test_a_first_runtime_past_step_0_has_no_producer() -> None:
    bad = check([runtime("w0", ["s0"], 0, None, full("a", 0, 4, (-1,)), 1.0),
                 runtime("w1", ["s1"], 2, 2, full("b", 2, 4, MBS), 1.0)], steps=4)
    assert not bad.ok and "no earlier runtime of the slice started before step 2" in bad.evidence

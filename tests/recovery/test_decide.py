"""The recovery decision function (recovery/decide.py): every branch, the budgets, and the plan choice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.recovery.decide import (Budget, Escalate, Fail, FallBack, Refence, Retry, Setback, Verdict, decide,
                                        plan_recovery)
from rallypoint.recovery.replay import Edge, Graph, Node, State


def test_lost_and_suspect_workers_are_fenced() -> None:
    for verdict in (Verdict.LOST, Verdict.SUSPECT):
        d = decide(Setback(verdict, workers={"w1": "gone", "w2": "no answer"}), 1, Budget())
        assert isinstance(d, Refence) and dict(d.lost) == {"w1": "gone", "w2": "no answer"}
        assert verdict.value in d.reason


def test_a_refusal_from_an_ended_incarnation_is_a_loss_and_from_live_workers_a_retry() -> None:
    d = decide(Setback(Verdict.REFUSED, workers={"w1": "stale", "w2": "disk"}, registered={"w1": False, "w2": True}),
               1, Budget())
    assert isinstance(d, Refence) and dict(d.lost) == {"w1": "stale"}
    d = decide(Setback(Verdict.REFUSED, workers={"w2": "disk"}, registered={"w2": True}), 1, Budget())
    assert isinstance(d, Retry) and d.after_s > 0 and "w2: disk" in d.reason


def test_a_corrupt_cut_falls_back_below_it_dropping_its_commit_but_not_past_the_inits() -> None:
    d = decide(Setback(Verdict.CORRUPT, workers={"w1": "bad"}, corrupt=("s1", 10), cut=10), 1, Budget())
    assert isinstance(d, FallBack) and d.before == 10 and d.drop == ("s1", 10)
    d = decide(Setback(Verdict.CORRUPT, workers={"w1": "bad"}, corrupt=None, cut=0), 1, Budget())
    assert isinstance(d, Fail) and "step 0" in d.reason


def test_a_short_output_log_escalates_to_restart_all_from_the_same_cut() -> None:
    d = decide(Setback(Verdict.LOG_SHORT, workers={"w1": "log starts at 12"}, cut=10), 1, Budget())
    assert isinstance(d, Escalate) and "step 10" in d.reason


def test_an_invalid_request_fails_at_once_and_a_stall_blames_the_laggards() -> None:
    assert isinstance(decide(Setback(Verdict.INVALID, workers={"w1": "bad route"}), 1, Budget()), Fail)
    d = decide(Setback(Verdict.INVALID, workers={"w1": "bad route"}), 1, Budget(invalid=1))
    assert isinstance(d, Fail) and "rejected the request" in d.reason
    d = decide(Setback(Verdict.STALL, workers={"w3": "node 'x' made no progress"}), 1, Budget())
    assert isinstance(d, Refence) and set(d.lost) == {"w3"}
    d = decide(Setback(Verdict.STALL, detail="nobody behind"), 1, Budget())
    assert isinstance(d, Fail) and "nobody behind" in d.reason


@pytest.mark.parametrize("verdict", [s for s in Verdict if s is not Verdict.PROGRAM])  # that one: at once, below
def test_past_its_budget_every_verdict_fails_naming_verdict_count_and_limit(verdict: Verdict) -> None:
    budget = Budget()
    limit = budget.limit(verdict)
    d = decide(Setback(verdict, workers={"w1": "x"}, cut=5, corrupt=("s", 5)), limit + 1, budget)
    assert isinstance(d, Fail)
    assert f"{verdict.value} setbacks {limit + 1} > limit {limit}" in d.reason


@given(verdict=st.sampled_from(list(Verdict)), count=st.integers(1, 30), cut=st.integers(0, 50),
       registered=st.booleans())
def test_the_decision_is_a_function_of_its_inputs_and_respects_the_budget(verdict: Verdict, count: int, cut: int,
                                                                          registered: bool) -> None:
    setback = Setback(verdict, workers={"w1": "x"}, registered={"w1": registered}, cut=cut, corrupt=("s", cut))
    d = decide(setback, count, Budget())
    assert d == decide(setback, count, Budget())  # pure: same inputs, same answer
    if count > Budget().limit(verdict):
        assert isinstance(d, Fail)
    elif verdict in (Verdict.LOST, Verdict.SUSPECT, Verdict.STALL):
        assert isinstance(d, Refence)
    elif verdict is Verdict.REFUSED:
        assert isinstance(d, Refence if not registered else Retry)
    elif verdict is Verdict.CORRUPT:
        assert isinstance(d, FallBack if cut > 0 else Fail)


def _pipeline() -> Graph:
    """Two stages: s0 (fwd0 with state p0) feeds s1 (fwd1 with state p1)."""
    return Graph(nodes=(Node("fwd0", "s0"), Node("fwd1", "s1")),
                 edges=(Edge("fwd0", "fwd1"), Edge("fwd0", "fwd0", "state", "p0"), Edge("fwd1", "fwd1", "state", "p1")),
                 states=(State("p0", "s0", "fwd0"), State("p1", "s1", "fwd1")))


def test_plan_recovery_stays_partial_when_the_survivors_logs_reach_back() -> None:
    plan, why = plan_recovery(_pipeline(), policy="partial", lost_slices={"s1"}, cut=4,
                              done_through={"fwd0": 8, "fwd1": 7}, logged_from={"fwd0": 4, "fwd1": 4})
    assert why == "" and plan.policy == "partial" and set(plan.nodes) == {"fwd1"}


def test_plan_recovery_escalates_when_a_survivor_would_have_to_rerun() -> None:
    plan, why = plan_recovery(_pipeline(), policy="partial", lost_slices={"s1"}, cut=4,
                              done_through={"fwd0": 8, "fwd1": 7}, logged_from={"fwd0": 6, "fwd1": 4})
    assert plan.policy == "restart-all" and "fwd0" in why and set(plan.nodes) == {"fwd0", "fwd1"}
    plan, why = plan_recovery(_pipeline(), policy="restart-all", lost_slices={"s1"}, cut=4,
                              done_through={"fwd0": 8, "fwd1": 7}, logged_from={"fwd0": 4, "fwd1": 4})
    assert plan.policy == "restart-all" and why == ""


def test_the_programs_own_failure_fails_at_once_whatever_the_budget_and_fences_nobody() -> None:
    detail = "worker w1: LoadJob failed: INTERNAL state 'w' init failed on worker w1: RESOURCE_EXHAUSTED"
    for count in (1, 2):
        d = decide(Setback(Verdict.PROGRAM, workers={"w1": detail}, detail=detail), count, Budget())
        assert isinstance(d, Fail) and "state 'w' init" in d.reason and "w1" in d.reason
        assert "none was fenced" in d.reason


def test_a_cancelled_call_is_never_a_suspicion_only_an_ended_registration_is_a_loss() -> None:
    d = decide(Setback(Verdict.CANCELLED, workers={"w1": "CANCELLED"}, registered={"w1": True}), 1, Budget())
    assert isinstance(d, Retry) and "cancelled" in d.reason
    d = decide(Setback(Verdict.CANCELLED, workers={"w1": "CANCELLED", "w2": "CANCELLED"},
                       registered={"w1": False, "w2": True}), 1, Budget())
    assert isinstance(d, Refence) and dict(d.lost) == {"w1": "CANCELLED"}


def test_the_failure_window_allows_so_many_faults_in_any_window_and_then_fails_listing_them() -> None:
    from rallypoint.recovery.decide import Disruption, FailurePolicy, FailureWindow

    w = FailureWindow(FailurePolicy(max_faults=2, max_preemptions=1, window_s=100.0))
    assert w.admit(Disruption(1, 0.0, False, "w1: lost")) is None
    assert w.admit(Disruption(2, 50.0, False, "w2: stalled")) is None
    assert w.admit(Disruption(3, 60.0, True, "w3: preempted")) is None  # preemptions count apart
    assert w.admit(Disruption(4, 101.0, False, "w4: lost")) is None  # the first fault left the window
    d = w.admit(Disruption(5, 120.0, False, "w5: lost"))
    assert isinstance(d, Fail)
    assert "failed 3 times from faults in the last 100s, more than its max_faults=2" in d.reason
    assert "recovery 2 (70s ago): w2: stalled; recovery 4 (19s ago): w4: lost; recovery 5 (0s ago): w5: lost" in d.reason
    assert "w3" not in d.reason and "w1" not in d.reason
    d = w.admit(Disruption(6, 130.0, True, "w6: preempted"))
    assert isinstance(d, Fail) and "from preemptions" in d.reason and "max_preemptions=1" in d.reason

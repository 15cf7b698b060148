"""Grants alone: the window, holds, the halt and refused grants, and what each worker is sent; no executor."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.orchestrator.job.grants import Grants, Hold, StepGrant


def test_the_window_widens_with_the_steps_completed_and_stops_at_the_last_step() -> None:
    g = Grants(steps=5)
    assert g.granted == 0 and not g.all_granted
    assert g.widen(0, 2) and g.granted == 2
    assert not g.widen(0, 2) and not g.widen(1, 1)  # nothing new to grant
    assert g.widen(1, 0) is False and g.widen(2, 0) and g.granted == 3  # a window of 0 is one step
    assert g.widen(4, 4) and g.granted == 5 and g.all_granted
    assert not g.widen(5, 4)


def test_begin_grants_nothing_past_the_start() -> None:
    g = Grants(steps=20)
    g.begin(10)
    assert g.granted == 10 and g.widen(10, 2) and g.granted == 12


def test_a_halt_stops_the_window_for_good_and_the_earliest_halt_stands() -> None:
    g = Grants(steps=20)
    g.widen(0, 3)
    g.halt(7)
    g.halt(9)
    assert g.halted == 7 and not g.widen(5, 3) and g.granted == 3


def test_a_held_worker_is_sent_no_step_at_or_past_its_hold_and_saves_there() -> None:
    g = Grants(steps=20)
    g.widen(0, 6)
    assert g.hold(Hold(("w1",), 4), among={"w0", "w1"}) == ["w1"]  # to grant now
    assert g.now(["w0", "w1"], cut=2) == [StepGrant("w0", 6, 2, 0), StepGrant("w1", 4, 2, 4)]
    assert g.until("w1") == 4 and g.until("w0") == 6 and dict(g.holds) == {"w1": 4}
    assert g.hold(Hold(("w1", "w2"), None), among={"w1"}) == ["w1"]  # w2 is not the job's: not granted
    assert g.hold(None, among={"w1"}) == []  # no hold: nobody to grant
    assert g.now(["w1"], cut=2) == [StepGrant("w1", 6, 2, 0)] and dict(g.holds) == {}
    g.hold(Hold(("w0",), 9), among=())  # a hold past the window: the window stands
    assert g.now(["w0"], cut=0) == [StepGrant("w0", 6, 0, 9)]
    with pytest.raises(TypeError):
        g.holds["w3"] = 1  # type: ignore[index]  # read-only to everyone else


def test_refused_grants_are_retried_once_for_the_workers_the_job_still_runs_on() -> None:
    g = Grants(steps=20)
    g.refused("w1")
    g.refused("w2")
    assert g.retry(["w0", "w1"]) == ["w1"]
    assert g.retry(["w0", "w1", "w2"]) == []  # every refusal is forgotten once retried (w2 had left the job)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), max_size=20), st.integers(1, 30))
def test_the_grant_never_shrinks_and_never_passes_the_job(moves: list[tuple[int, int]], steps: int) -> None:
    g = Grants(steps=steps)
    completed = 0
    for c, window in moves:
        completed = max(completed, min(c, steps))  # steps complete in order, never past the job
        before = g.granted
        g.widen(completed, window)
        assert before <= g.granted <= steps
        assert g.granted >= min(completed + max(1, window), steps) or g.granted == before

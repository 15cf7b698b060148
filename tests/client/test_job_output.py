"""What a client prints of a job it did not start: what happened before it watched, a log line, a stop."""

from __future__ import annotations

from rallypoint.client.commands.output import describe_event
from rallypoint.client.commands.lifecycle import describe_line, describe_past


def test_a_watch_says_what_happened_before_it_came() -> None:
    lines = describe_past({
        "recoveries": [{"recovery": 1, "lost": {"w1": ["stage1"]}, "checkpoint_step": 10, "mttr_s": 0.42}],
        "drains": [{"drain": 1, "worker": "w2", "reason": "operator", "step": 14, "state": "done"}],
        "stop": {"action": "suspend", "by": "operator ann", "reason": "maintenance"}})
    assert lines == ["  recovery 1: lost w1, restored the cut at step 10, MTTR 0.42s",
                     "  drain 1 of worker w2 (operator) at step 14: done",
                     "  suspend asked by operator ann: maintenance"]
    assert describe_past({"recoveries": [], "drains": []}) == []


def test_a_log_line_has_the_time_step_event_and_fields_but_not_the_placement() -> None:
    line = describe_line({"t": 0.0, "event": "job.suspended", "step": 22, "term": 3, "cut": 22,
                          "reason": "by operator ann", "placement": {"s0": {"worker": "w0"}}, "failures": []})
    assert "step     22  job.suspended" in line and "cut=22" in line and "reason=by operator ann" in line
    assert "placement" not in line and "failures" not in line and "term" not in line


def test_a_stop_and_a_resume_by_the_leader_are_one_line_each() -> None:
    assert "suspend[/yellow] asked by operator ann: every slice saves at step 22" in describe_event(
        {"event": "job.stopping", "action": "suspend", "by": "operator ann", "boundary": 22, "checkpoint": True})
    assert "cancel[/yellow] asked by op: stopping at step 9" in describe_event(
        {"event": "job.stopping", "action": "cancel", "by": "op", "boundary": 9, "checkpoint": False})
    assert "resumed by the leader (room returned)" in describe_event({"event": "job.resumed", "auto": True,
                                                                      "checkpoint_step": 30})

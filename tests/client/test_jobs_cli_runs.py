"""`rallypoint status` and `rallypoint jobs` show the run id; status lists the earlier runs kept."""

from __future__ import annotations

from pathlib import Path

from rallypoint.client.commands.jobs import job_rows, job_status
from tests.helpers.executor import a_run


def test_status_and_jobs_show_the_current_run_and_the_earlier_ones(tmp_path: Path) -> None:
    first = a_run(tmp_path)
    second = a_run(tmp_path, first.store)
    rec = job_status(first.store, first.keys, "pipe")
    assert rec["run"] == second.x.run_id and rec["run_dir"] == str(second.x.run_dir)
    assert rec["earlier_runs"] == [{"run": first.x.run_id, "state": "succeeded", "step_done": 20, "steps": 20,
                                    "commits": 10, "run_dir": str(first.x.run_dir)}]
    assert {s: c["step"] for s, c in rec["last_commits"].items()} == {"s0": 20, "s1": 20}  # the final cut
    row, earlier = job_rows(first.store, first.keys)  # the current run, then the history
    assert row["job"] == "pipe" and row["run"] == second.x.run_id and row["current"]
    assert earlier["run"] == first.x.run_id and not earlier["current"] and earlier["state"] == "succeeded"
    assert earlier["started_at"] <= earlier["ended_at"] <= row["started_at"] and earlier["steps"] == 20
    assert [r["run"] for r in job_rows(first.store, first.keys, history=False)] == [second.x.run_id]

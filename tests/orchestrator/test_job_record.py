"""The job record stays under a fixed size however many recoveries a job has, and the work an
instance costs does not grow with them (fakes: no process starts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rallypoint.orchestrator.job.executor import JobState, run_dir
from rallypoint.orchestrator.job.record import HISTORY_FILE, RECENT_FAILURES, RECENT_RECOVERIES
from rallypoint.orchestrator.job.recovery_machine import Recovery
from tests.fakes import register_worker
from tests.helpers.executor import Harness, pipeline_spec, recovered

LOSSES = 24


def _lose_s1(h: Harness, n: int) -> None:
    """s1's worker dies; a fresh worker joins to take its slice."""
    register_worker(h.store, h.keys, f"spare{n}", 1)
    victim = h.worker_of("s1")
    h.store.revoke_lease(h.store.get(h.keys.worker(victim)).lease)  # type: ignore[union-attr]
    h.workers.end(victim)


def test_the_record_keeps_the_newest_recoveries_summarises_the_rest_and_the_run_dir_has_them_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal_observed: list[int] = []
    real_observe = Recovery.observe

    def observe(self: Recovery, *args: Any) -> None:
        if self.phase.is_terminal:
            terminal_observed.append(self.record.number)
        real_observe(self, *args)

    monkeypatch.setattr(Recovery, "observe", observe)
    h = Harness(tmp_path, spec=pipeline_spec(steps=12 * LOSSES + 20, checkpoint_every=5, max_faults=10 * LOSSES))
    h.x.begin()
    sizes: dict[int, int] = {}
    for n in range(1, LOSSES + 1):
        h.steps_until(h.x.progress.completed + 6)
        _lose_s1(h, n)
        recovered(h, n)
        h.steps_until(h.x.progress.completed + 4)
        sizes[n] = len(json.dumps(h.record()))
    assert len(h.x.recovery.records) == LOSSES
    rec = h.record()
    assert [r["recovery"] for r in rec["recoveries"]] == list(range(LOSSES - RECENT_RECOVERIES + 1, LOSSES + 1))
    earlier = rec["recoveries_earlier"]
    assert earlier["count"] == LOSSES - RECENT_RECOVERIES and (earlier["first"], earlier["last"]) == (1, 16)
    assert earlier["workers_lost"] == LOSSES - RECENT_RECOVERIES and earlier["policies"] == {"partial": 16}
    # A fixed size: once every list is at its bound (a failure and a recovery per loss), more recoveries
    # leave the record as it was (numbers grow by a digit now and then).
    full = max(RECENT_RECOVERIES, RECENT_FAILURES) + 2
    assert sizes[LOSSES] <= sizes[full] * 1.02, sizes
    # Instances done after many recoveries touched no finished recovery.
    assert terminal_observed == [], f"finished recoveries were asked about {len(terminal_observed)} instances"

    h.steps_until(h.x.spec.steps)
    h.x.finish()
    h.x._set_state(JobState.SUCCEEDED)  # the final record: the whole history goes to the run directory
    history = run_dir(tmp_path, "pipe", create=False) / HISTORY_FILE
    assert earlier["history"] == str(history)
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert [r["recovery"] for r in lines] == list(range(1, LOSSES + 1))
    assert all(r["term"] == h.election.term and r["lost"] for r in lines)

"""A worker lost while the job's final state is fetched is recovered, and the job still finishes."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from rallypoint.orchestrator.job.failures import WorkerCallFailed
from rallypoint.orchestrator.job.state import JobFailed, JobState
from rallypoint.proto import rallypoint_pb2 as pb
from tests.helpers.executor import Harness


def test_a_worker_lost_while_its_final_state_is_fetched_is_recovered_and_the_job_finishes(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    h.steps_until(20)
    victim = h.worker_of("s1")
    fetches: list[list[str]] = []
    real = h.workers.fetch_all

    def fetch_all() -> tuple[list[pb.StateValue], dict[str, WorkerCallFailed]]:
        fetches.append(list(h.workers.workers))
        if len(fetches) == 1:  # the worker's process died as it was asked: its lease goes, its socket resets
            h.store.revoke_lease(h.store.get(h.keys.worker(victim)).lease)
            h.workers.end(victim)
            return [], {victim: WorkerCallFailed(victim, "FetchState", grpc.StatusCode.UNAVAILABLE, "Socket closed")}
        return real()

    h.workers.fetch_all = fetch_all  # type: ignore[method-assign]
    end = h.x.finish()
    assert end.event == "job.finished" and h.x.state is JobState.FINISHING
    [rec] = json.loads(end.detail)["recoveries"]
    assert list(rec["lost"]) == [victim]
    spare = h.worker_of("s1")
    assert spare != victim and len(fetches) == 2 and spare in fetches[1] and victim not in fetches[1]
    assert h.x.recovery.active is None


def test_a_fetch_that_fails_for_another_reason_fails_the_job(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.x.begin()
    h.steps_until(20)
    w = h.worker_of("s0")
    h.workers.fetch_all = lambda: ([], {w: WorkerCallFailed(  # type: ignore[method-assign]
        w, "FetchState", grpc.StatusCode.ABORTED, "job 'pipe' failed: boom")})
    with pytest.raises(JobFailed, match="could not fetch the final state.*boom"):
        h.x.finish()

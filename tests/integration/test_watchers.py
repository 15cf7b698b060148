"""One coordinator serves 100 concurrent ``WatchJob`` streams and still takes a submission.

A real etcd and a real :class:`~rallypoint.orchestrator.service.coordinator.Coordinator` with its gRPC server,
leading; the executor is the service's stand-in (:class:`tests.fakes_service.StandInExecutor`),
so no worker process starts: what is under test is the server's threads, the watch cap and the fan-out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rallypoint.etcd.server import EtcdCluster
from rallypoint.orchestrator.service import jobs as service_mod
from rallypoint.orchestrator.service.coordinator import Coordinator, CoordinatorConfig
from rallypoint.orchestrator.service.jobs import serve_jobs
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.proto import rallypoint_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.fakes_service import StandInExecutor

WATCHERS = 100


@pytest.fixture
def leader(etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Coordinator, Any]]:
    monkeypatch.setattr(service_mod, "JobExecutor", StandInExecutor)
    StandInExecutor.made.clear()
    c = Coordinator(CoordinatorConfig(cluster="t", coordinator_id="c0", endpoints=tuple(etcd.endpoints),
                                      checkpoint_dir=str(tmp_path), suspect_after_s=0, max_watchers=WATCHERS))
    svc = serve_jobs(c)
    thread = threading.Thread(target=c.run, name="coordinator", daemon=True)
    thread.start()
    try:
        wait_until(lambda: c.election.is_leader, 15, "the coordinator to lead")
        yield c, svc
    finally:
        for x in StandInExecutor.made:
            x.go.set()
        c.stop()
        thread.join(15)


def _executor(job: str) -> StandInExecutor:
    return wait_until(lambda: next((x for x in StandInExecutor.made if x.spec.job == job), None), 10,
                      f"the executor of {job}")


def test_a_hundred_watchers_neither_hold_the_service_nor_block_a_submission(leader: tuple[Coordinator, Any]) -> None:
    c, svc = leader
    channels = [grpc.insecure_channel(c.address) for _ in range(4)]
    try:
        stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
        long_run = stubs[0].SubmitJob(pb.JobSpec(job="long", steps=5), timeout=60)
        assert next(long_run).event == "job.placed"
        seen: list[list[str]] = [[] for _ in range(WATCHERS)]
        errors: list[BaseException] = []

        def watch(i: int) -> None:
            try:
                for ev in stubs[i % len(stubs)].WatchJob(pb.WatchJobRequest(job="long"), timeout=60):
                    seen[i].append(ev.event)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        watchers = [threading.Thread(target=watch, args=(i,), daemon=True) for i in range(WATCHERS)]
        for t in watchers:
            t.start()
        wait_until(lambda: all(s[:1] == ["job.watching"] for s in seen) or errors, 20,
                   f"{WATCHERS} watchers to be served")
        assert not errors, errors[:3]
        assert svc.watching == WATCHERS

        # One more watcher is refused at once, with the reason.
        with pytest.raises(grpc.RpcError) as refused:
            next(stubs[1].WatchJob(pb.WatchJobRequest(job="long"), timeout=10))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"already serves {WATCHERS} WatchJob streams" in (refused.value.details() or "")

        # A submission still goes through while every watcher holds its stream.
        quick = stubs[2].SubmitJob(pb.JobSpec(job="quick", steps=3), timeout=10)
        assert next(quick).event == "job.placed"
        _executor("quick").go.set()
        assert [ev.event for ev in quick] == ["job.finished"]

        _executor("long").go.set()
        assert [ev.event for ev in long_run] == ["job.finished"]
        for t in watchers:
            t.join(15)
        assert not errors, errors[:3]
        assert all(s == ["job.watching", "job.finished"] for s in seen), [s for s in seen if s[-1:] != ["job.finished"]][:3]
        wait_until(lambda: svc.watching == 0, 5, "the watch count to drop as the streams end")
    finally:
        for ch in channels:
            ch.close()

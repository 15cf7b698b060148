"""Two jobs sharing one pool of workers, with priorities: real etcd, real processes.

A low-priority pipeline holds every device. A high-priority job arrives: it takes one
of the pipeline's slices, which is saved at a step boundary and parked (its devices
released), runs, and ends; the pipeline then takes devices back and finishes bitwise
equal to its reference with nothing replayed. ``rallypoint jobs`` shows both meanwhile.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any


from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.commands.jobs import job_rows
from rallypoint.client.submission import submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.faults import WorkerFaults
from tests.helpers.cli import rp
from tests.helpers.cluster import assert_settled, cluster_args, counter_job


def test_a_higher_priority_job_takes_a_slice_of_a_lower_one_which_takes_it_back_with_no_lost_work(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    low, reference = pipeline
    # Long enough (a second or two) that the listing read at job.yielded sees the urgent job still holding the slice.
    high = compile_program(counter_job(300))
    high_reference = ReferenceExecutor(high).run().state_digest
    # Every commit waits 1 s, the drain's save included: the yield request stays up that long after the urgent job
    # asked (it withdraws it once placed), so a listing read then, over a fresh TLS connection, sees it.
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1,
                       worker_faults=WorkerFaults(commit_delay_s=1.0))
    results: dict[str, Any] = {}
    listing: list[list[dict[str, Any]]] = []
    asking: list[list[dict[str, Any]]] = []
    events: list[pb.JobEvent] = []

    def rows_now() -> list[dict[str, Any]]:
        store = lc.store()
        try:
            return job_rows(store, lc.keys)
        finally:
            store.close()

    def on_high_event(ev: pb.JobEvent) -> None:
        if ev.event == "job.waiting" and not asking:  # it has asked pipeline-mlp to yield a slice
            asking.append(rows_now())

    def run_high() -> None:
        results["high"] = submit(high, endpoints=lc.endpoints, cluster=lc.keys.cluster, priority=10,
                                 on_event=on_high_event)

    started: list[threading.Thread] = []

    def on_event(ev: pb.JobEvent) -> None:
        events.append(ev)
        if ev.event == "step.done" and ev.step == 3 and not started:
            started.append(threading.Thread(target=run_high))
            started[0].start()
        if ev.event == "job.yielded":  # read at once (the CLI's start-up would outlast the short job)
            listing.append(rows_now())

    results["low"] = submit(low, endpoints=lc.endpoints, cluster=lc.keys.cluster, on_event=on_event,
                            checkpoint_every=5, priority=0)
    started[0].join(timeout=120)
    assert results["high"].state_digest == high_reference
    lo = results["low"]
    assert lo.state_digest == reference
    rec = lo.recovery
    assert rec["replayed_instances"] == {} and rec["recoveries"] == [] and rec["failures"] == [], rec
    (d,) = rec["drains"]
    assert d["reason"] == "yield" and d["state"] == "done" and d["paused_s"] > 0, d
    assert any(e.event == "job.yielded" for e in events)
    (during,) = listing
    rows = {r["job"]: r for r in during}
    assert rows["pipeline-mlp"]["priority"] == 0 and rows["pipeline-mlp"]["state"] == "running"
    assert rows["pipeline-mlp"]["devices_held"] == 3  # one slice parked
    assert rows["urgent"]["priority"] == 10
    (asked,) = asking
    assert {r["job"]: r["asked_to_yield"] for r in asked}["pipeline-mlp"] == 1, asked
    after = [json.loads(line) for line in rp("jobs", "--json", *cluster_args(lc)).stdout.splitlines()]
    assert [(r["job"], r["priority"], r["state"], r["devices_held"]) for r in after] == [
        ("urgent", 10, "succeeded", 0), ("pipeline-mlp", 0, "succeeded", 0)]
    table = rp("jobs", *cluster_args(lc)).stdout
    assert "urgent" in table and "pipeline-mlp" in table and "highest priority first" in table
    assert_settled(lc)

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

import jax.numpy as jnp

from rallypoint.client import Program
from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.jobs_cli import job_rows
from rallypoint.client.submit import submit
from rallypoint.cluster.local import LocalCluster
from rallypoint.proto import rallypoint_pb2 as pb
from tests.client.test_cli import rp
from tests.integration.test_drain import cluster_args
from tests.integration.test_recovery import assert_settled, pipeline  # noqa: F401 (fixture)


def counter_job(steps: int) -> Program:
    prog = Program("urgent", steps=steps, checkpoint_every=10)
    s = prog.slice("only", devices=1)
    total = prog.state("total", slice=s, init=lambda: jnp.zeros((4,)))
    src = prog.source("x", lambda step, mb: {"x": jnp.full((4,), step, jnp.float32)}, slice=s, per="step",
                      outputs=("x",))
    prog.node("add", lambda total, x: {"total": total + x}, slice=s, inputs={"total": total, "x": src["x"]},
                     outputs=("total",), updates={"total": total})
    return prog


def test_a_higher_priority_job_takes_a_slice_of_a_lower_one_which_takes_it_back_with_no_lost_work(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    low, reference = pipeline
    # Long enough (a second or two) that the listing read at job.yielded, over a fresh TLS connection to etcd, sees
    # the urgent job still holding the slice (30 steps were over in 0.15 s, before the read, on a loaded host).
    high = compile_program(counter_job(300))
    high_reference = ReferenceExecutor(high).run().state_digest
    lc = local_cluster(workers=4, spares=0, devices_per_worker=1, coordinators=1)
    results: dict[str, Any] = {}
    listing: list[list[dict[str, Any]]] = []
    events: list[pb.JobEvent] = []

    def run_high() -> None:
        results["high"] = submit(high, endpoints=lc.endpoints, cluster=lc.keys.cluster, priority=10)

    started: list[threading.Thread] = []

    def on_event(ev: pb.JobEvent) -> None:
        events.append(ev)
        if ev.event == "step.done" and ev.step == 3 and not started:
            started.append(threading.Thread(target=run_high))
            started[0].start()
        if ev.event == "job.yielded":  # read at once (the CLI's start-up would outlast the short job)
            store = lc.store()
            try:
                listing.append(job_rows(store, lc.keys))
            finally:
                store.close()

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
    assert rows["pipeline-mlp"]["asked_to_yield"] == 1 and rows["urgent"]["priority"] == 10
    after = [json.loads(line) for line in rp("jobs", "--json", *cluster_args(lc)).stdout.splitlines()]
    assert [(r["job"], r["priority"], r["state"], r["devices_held"]) for r in after] == [
        ("urgent", 10, "succeeded", 0), ("pipeline-mlp", 0, "succeeded", 0)]
    table = rp("jobs", *cluster_args(lc)).stdout
    assert "urgent" in table and "pipeline-mlp" in table and "highest priority first" in table
    assert_settled(lc)

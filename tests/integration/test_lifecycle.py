"""A job's whole life on a real local cluster: submit and walk away, watch, suspend, resume, cancel, the history
and the event log; a suspend during a recovery, a cancel during a drain, a watch across a leader kill, a
higher-priority job that suspends a lower one which resumes by itself; and the bad inputs, each refused with
nothing changed. One cluster serves the module (its start costs more than most of these tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rallypoint.cli import main as cli_main
from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.lifecycle import control, submit_detached, watch
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.client.submit import JobStoppedError, resume
from rallypoint.cluster.local import LocalCluster, LocalClusterConfig
from rallypoint.etcd.cluster_view import read_cluster
from rallypoint.proto import rallypoint_pb2 as pb
from tests.conftest import stop_cluster, wait_until
from tests.examples import example
from tests.integration.test_drain import cluster_args

pytestmark = pytest.mark.processes

STEPS = 40
EVERY = 5
QUIET = {"warm_spares": 0, "checkpoint_every": EVERY}  # no spare compiles beside the job: this machine has 2 cores


@pytest.fixture(scope="module")
def lc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster.start(LocalClusterConfig(
        state_dir=tmp_path_factory.mktemp("lifecycle"), workers=4, spares=1, devices_per_worker=1, coordinators=2,
        lease_ttl_s=2, compile_cache_dir=tmp_path_factory.getbasetemp() / "lifecycle-compile-cache"))
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


@pytest.fixture(scope="module")
def pipeline() -> tuple[CompiledProgram, str]:
    compiled = compile_program(example("pipeline_mlp").build(steps=STEPS))
    return compiled, ReferenceExecutor(compiled).run().state_digest


def where(lc: LocalCluster) -> dict[str, Any]:
    return {"endpoints": lc.endpoints, "cluster": lc.keys.cluster}


def record(lc: LocalCluster, job: str) -> dict[str, Any]:
    store = lc.store()
    try:
        kv = store.get(lc.keys.job(job))
        return kv.json() if kv is not None else {}
    finally:
        store.close()


def held(lc: LocalCluster, job: str) -> int:
    store = lc.store()
    try:
        return sum(h.job == job for w in read_cluster(store, lc.keys).workers.values() for h in w.holders.values())
    finally:
        store.close()


def cli(lc: LocalCluster, *args: str) -> Any:
    """``rallypoint ARGS --cluster ...`` in this process (the CLI's code, without a new interpreter's start)."""
    verb, rest = args[0], list(args[1:])
    return CliRunner().invoke(cli_main, [verb, *cluster_args(lc), *rest], catch_exceptions=False)


def until_step(lc: LocalCluster, job: str, step: int) -> None:
    wait_until(lambda: int(record(lc, job).get("step_done") or 0) >= step or record(lc, job).get("state") not in
               ("placing", "loading", "running", "recovering", "stopping"), 60, f"{job} at step {step}", 0.1)


def test_a_detached_job_is_suspended_listed_resumed_with_nothing_replayed_and_logged(
    lc: LocalCluster, pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    got = submit_detached(compiled, **where(lc), **QUIET)
    job, run = got["job"], got["run"]
    assert run.startswith("run-") and set(got["placement"]) == {"stage0", "stage1", "stage2", "stage3"}
    again = submit_detached(compiled, submit_id=got["submit_id"], **where(lc), **QUIET)  # a retried submit
    assert again["run"] == run  # followed the run it started: no second run
    until_step(lc, job, 8)
    reply = control(job, "suspend", **where(lc), by="operator test", reason="maintenance")
    assert reply.state == "running" and "suspended at its next step boundary" in reply.message
    with pytest.raises(JobStoppedError) as stopped:
        watch(job, **where(lc))
    assert stopped.value.state == "suspended" and "`rallypoint resume" in str(stopped.value)
    rec = record(lc, job)
    assert rec["state"] == "suspended" and rec["cut"] == rec["step_done"] and 8 < rec["cut"] < STEPS
    assert rec["stop"]["by"] == "operator test" and held(lc, job) == 0
    listed = [json.loads(line) for line in cli(lc, "jobs", "--json").output.splitlines()]
    row = next(r for r in listed if r["job"] == job and r["current"])
    assert row["state"] == "suspended" and row["run"] == run and row["stopped_by"] == "operator test"
    assert [r["run"] for r in listed if r["job"] == job] == [run]  # one run: the retried submit started none
    shown = cli(lc, "watch", job)
    assert shown.exit_code == 4 and "is suspended" in shown.output
    refused = cli(lc, "suspend", job)
    assert refused.exit_code == 1 and "already suspended" in refused.output and record(lc, job) == rec

    done = resume(job, **where(lc))
    assert done["state_digest"] == reference and done["start_step"] == rec["cut"]
    assert done["replayed_instances"] == {} and done["recoveries"] == []  # nothing ran twice
    assert record(lc, job)["run"] == run and held(lc, job) == 0
    log = cli(lc, "logs", job, "--json")
    names = [json.loads(line)["event"] for line in log.output.splitlines()]
    assert names[:2] == ["job.placed", "job.started"] and names[-1] == "job.finished"
    assert names.index("job.stopping") < names.index("job.suspended") < names.index("job.resumed")
    text = cli(lc, "logs", job).output
    assert "job.suspended" in text and "by operator test: maintenance" in text

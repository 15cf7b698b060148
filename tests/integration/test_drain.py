"""Drains on a real local cluster: real etcd, real worker processes, real SIGTERMs.

A drained slice saves its state at a step boundary, a spare restores it and the
survivors are rewired: the job ends bitwise equal to the fault-free reference with
nothing re-run, and the drained worker ends cordoned, holding no lease.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from rallypoint.client.compile import CompiledProgram, compile_program
from rallypoint.client.commands.faults import Fault
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.cluster.local import LocalCluster, is_running
from rallypoint.orchestrator.control.devices import DeviceLeases
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.faults import WorkerFaults
from tests.conftest import wait_until
from tests.examples import example
from tests.helpers.cli import ROOT, rp
from tests.helpers.cluster import EACH_KIND_OF_SLICE, STEPS, assert_settled, cluster_args, run, snapshot


def assert_no_replay(result: Any) -> dict[str, Any]:
    rec = result.recovery
    assert rec["replayed_instances"] == {} and rec["failures"] == [] and rec["recoveries"] == [], rec
    (d,) = rec["drains"]
    assert d["state"] == "done" and d["replayed_instances"] == 0, d
    assert d["paused_s"] is not None and d["paused_s"] > 0, d
    return d


@pytest.mark.parametrize("victim", EACH_KIND_OF_SLICE)
def test_draining_the_worker_of_each_slice_moves_it_with_nothing_replayed_and_ends_bitwise_equal(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str], victim: str,
) -> None:
    compiled, reference = pipeline
    # Early enough that the leader (it polls requests every 0.1 s) sees it well before the job's last steps.
    step = random.Random(f"drain-{victim}").randint(3, STEPS // 2 - 2)
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1)
    result, injector = run(lc, compiled, [Fault(victim, victim, step, "drain")])
    drained = injector.fired[0]["worker"]
    assert result.state_digest == reference, f"drain of {victim} at step {step}"
    d = assert_no_replay(result)
    assert d["worker"] == drained and d["slices"] == [victim] and d["step"] >= step
    assert set(d["moved"]) == {victim} and d["moved"][victim] != drained
    # The drain checkpoint is off the every-5 schedule when the step is, and counts like any other.
    status = json.loads(rp("status", "--json", *cluster_args(lc), compiled.program.name).stdout)
    assert status["placement"][victim]["worker"] == d["moved"][victim]
    w = snapshot(lc).workers[drained]
    assert w.cordoned and not w.holders
    assert is_running(lc.process(drained)), "a drained worker stays up (cordoned), it is not lost"
    assert_settled(lc)


def test_rallypoint_drain_refuses_what_cannot_work_and_changes_nothing(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    lc = local_cluster(workers=2, spares=0, devices_per_worker=1, coordinators=1)
    store = lc.store()
    try:
        leases = DeviceLeases(store, lc.keys)
        for s in ("s0", "s1"):  # every device held: no spare for either worker's slice
            leases.allocate("train", s, 1)
        before = snapshot(lc)
        worker = sorted(before.workers)[0]
        r = rp("drain", worker, *cluster_args(lc), check=False)
        assert r.returncode == 1
        assert f"cannot drain worker {worker}: slice 'train/s" in r.stderr, r.stderr
        assert "no live, uncordoned worker" in r.stderr and "Nothing was changed" in r.stderr
        r = rp("drain", "nope", *cluster_args(lc), check=False)
        assert r.returncode == 1 and "no worker 'nope' is registered" in r.stderr, r.stderr
        r = rp("drain", worker, "--deadline-s", "0", *cluster_args(lc), check=False)
        assert r.returncode == 2 and "--deadline-s" in r.stderr, r.stderr
        after = snapshot(lc)
        assert after.cordoned == before.cordoned == frozenset()
        assert {w: s.holders for w, s in after.workers.items()} == {w: s.holders for w, s in before.workers.items()}
        assert store.get_prefix(lc.keys.drains)[0] == []
    finally:
        store.close()


# `rallypoint drain WORKER ARGS...` with the worker's name read from stdin: the command starts (its imports take
# seconds) before the worker is known, and drains the moment it is told which.
DRAIN_WHEN_TOLD = """
import sys
from rallypoint.cli import main
import rallypoint.client.commands.drains  # what the command imports when it runs
worker = sys.stdin.readline().strip()
sys.argv = ["rallypoint", "drain", worker, *sys.argv[1:]]
main()
"""


def test_rallypoint_drain_moves_the_slices_reports_the_pause_and_leaves_the_worker_cordoned(
    local_cluster: Callable[..., LocalCluster],
) -> None:
    # Long enough that the leader's poll of the request lands well inside the run.
    compiled = compile_program(example("pipeline_mlp").build(steps=80))
    reference = ReferenceExecutor(compiled).run().state_digest
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1)
    command = subprocess.Popen([sys.executable, "-c", DRAIN_WHEN_TOLD, "--json", *cluster_args(lc)], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    placed: list[str] = []  # stage1's worker
    told: list[str] = []  # the worker the command drains

    def on_event(ev: pb.JobEvent) -> None:
        if ev.event == "job.placed":
            placed.append(json.loads(ev.detail)["stage1"]["worker"])
        if ev.event == "step.done" and ev.step == 2 and not told:  # a few steps in
            told.append(placed[0])
            assert command.stdin is not None
            command.stdin.write(placed[0] + "\n")
            command.stdin.flush()

    try:
        result, _ = run(lc, compiled, [], on_event=on_event)
        stdout, stderr = command.communicate(timeout=120)
    finally:
        command.kill()
        command.wait()
    (worker,) = told
    assert command.returncode == 0, stderr
    out = json.loads(stdout)
    assert out["state"] == "done" and out["held"] == {}
    job = out["jobs"][compiled.program.name]
    assert job["state"] == "done" and job["slices"] == ["stage1"] and job["paused_s"] > 0
    assert result.state_digest == reference
    assert_no_replay(result)
    w = snapshot(lc).workers[worker]
    assert w.cordoned and not w.holders


def test_sigterm_with_time_to_drain_moves_the_slices_first_and_the_worker_leaves(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1, preempt_deadline_s=60)
    result, injector = run(lc, compiled, [Fault("stage2", "stage2", 7, "preempt")])
    (fired,) = injector.fired
    assert fired["signal"] == "SIGTERM"
    assert result.state_digest == reference
    d = assert_no_replay(result)
    assert d["reason"] == "preempted" and d["worker"] == fired["worker"]
    rec = lc.process(fired["worker"])
    wait_until(lambda: not is_running(rec), 15, "a preempted worker to leave once it holds nothing")
    assert fired["worker"] not in snapshot(lc).workers
    assert_settled(lc)


def test_sigterm_without_time_to_drain_falls_back_on_the_loss_path_and_still_ends_bitwise_equal(
    local_cluster: Callable[..., LocalCluster], pipeline: tuple[CompiledProgram, str],
) -> None:
    compiled, reference = pipeline
    # Every commit waits 0.5 s, so the drain's save cannot commit before the worker's 0.02 s are up (without
    # it a drain can take under 0.1 s here and finish before the worker has gone).
    lc = local_cluster(workers=4, spares=1, devices_per_worker=1, coordinators=1, preempt_deadline_s=0.02,
                       worker_faults=WorkerFaults(commit_delay_s=0.5))
    result, injector = run(lc, compiled, [Fault("stage2", "stage2", 7, "preempt")])
    (fired,) = injector.fired
    assert result.state_digest == reference
    rec = result.recovery
    assert [f["worker"] for f in rec["failures"]] == [fired["worker"]]
    (r,) = rec["recoveries"]
    assert set(r["moved"]) == {"stage2"}
    assert all(d["state"] != "done" for d in rec["drains"]), rec["drains"]
    assert_settled(lc)

"""The worker runtime over real gRPC: in-process workers run the examples bitwise like the reference.

Two ``WorkerRuntimeService`` servers in this process (4 CPU devices each) load a job
the way the coordinator will: ``load_requests`` per worker, ``JobEvents`` opened,
steps granted with ``RunSteps``, then ``FetchState``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import jax
import numpy as np
import pytest

from rallypoint.client.compile import CompiledProgram
from rallypoint.client.reference import state_digest
from rallypoint.etcd.commits import CheckpointCommit
from rallypoint.recovery.load_plan import instances_per_step
from rallypoint.proto import codec
from rallypoint.proto import rallypoint_pb2 as pb
from tests.conftest import wait_until
from rallypoint.workers.runtime.outlog import OutputLog
from rallypoint.workers.runtime.control import JobControl
from rallypoint.workers.runtime.inputs import Inputs
from rallypoint.workers.runtime.load import LoadedNode
from rallypoint.workers.runtime.routes import Router
from rallypoint.workers.errors import DeliveryError, LoadError
from rallypoint.workers.runtime.state import NodeProgress, StateVersions
from tests.fakes import FakeOutbox
from tests.helpers.runtime import Events, PLACEMENTS, Worker, compiled_and_reference, load, started_workers

def metrics_by_step(compiled: CompiledProgram, done: list[pb.InstanceDone], steps: int) -> list[dict[str, float]]:
    """Per step, each metric as the reference reports it: the mean over microbatches (float64, in order)."""
    out: list[dict[str, float]] = []
    for step in range(steps):
        evs = sorted((ev for ev in done if ev.step == step), key=lambda ev: (ev.node, ev.microbatch))
        values: dict[str, list[float]] = {}
        for ev in evs:
            for k, v in ev.metrics.items():
                values.setdefault(k, []).append(v)
        out.append({k: float(np.mean(np.asarray(v, dtype=np.float64))) for k, v in values.items()})
    return out


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_examples_end_in_bitwise_the_reference_state_with_its_metrics(name: str, workers: dict[str, Worker]) -> None:
    _, ref = compiled_and_reference(name)
    job = load(name, workers)
    job.grant(job.spec.steps)
    job.wait_instances(job.spec.steps)
    states = job.fetch_states()
    assert sorted(states) == sorted(ref.states)
    assert state_digest(states) == ref.state_digest
    assert metrics_by_step(job.compiled, job.done(), job.spec.steps) == ref.metrics
    assert all(ev.compute_s > 0 for ev in job.done())
    # The loop's bookkeeping around each call, for the straggler watch; no checkpoints here, so no save time.
    assert all(0 < ev.busy_s < 5 and ev.saving_s == 0 for ev in job.done())
    job.unload()


def test_the_first_instance_after_a_checkpoint_save_reports_the_saves_blocking_time(tmp_path: Path) -> None:
    # The straggler watch counts a slice's save as its work: each slice saves step 2 (every 2 of 4 steps) before it
    # runs any instance of step 2, and the first instance it runs then carries the save's blocking time.
    commits: list[CheckpointCommit] = []
    with started_workers(commit_factory=lambda: commits.append) as ws:
        job = load("pipeline_mlp", ws, checkpoint_every=2, checkpoint_dir=str(tmp_path))
        job.grant(job.spec.steps)
        want = sum(instances_per_step(job.spec, s) for s in range(job.spec.steps))
        wait_until(lambda: len([ev for ev in job.done() if ev.node]) >= want and len(commits) == 4, 60,
                   "every instance and four commits")
        slice_of = {n.name: n.slice for n in job.spec.nodes}
        saved = sorted((slice_of[ev.node], ev.step) for ev in job.done() if ev.saving_s > 0)
        assert saved == [(s, 2) for s in sorted(PLACEMENTS["pipeline_mlp"])], saved
        assert sorted((c.slice_name, c.step) for c in commits) == saved
        assert all(ev.saving_s < 30 for ev in job.done())
        job.unload()


def _zeros_like_output(compiled: CompiledProgram, node: str, output: str) -> list[np.ndarray]:
    avals = jax.tree_util.tree_leaves(compiled.nodes[node].out_avals[output])
    return [np.zeros(a.shape, a.dtype) for a in avals]


def test_a_window_of_granted_steps_and_a_duplicate_push_leave_the_result_unchanged(workers: dict[str, Worker]) -> None:
    _, ref = compiled_and_reference("pipeline_mlp")
    job = load("pipeline_mlp", workers)
    job.grant(1)
    job.wait_instances(1)
    job.wait_idle()
    assert {ev.step for ev in job.done()} == {0}  # nothing of step 1 ran before it was granted
    # A duplicate of a value already consumed at step 0, with different bytes: dropped.
    route = next(r for r in job.requests["wA"].routes if r.node and r.worker_id == "wB")
    producer = next(n for n in job.spec.nodes if n.name == route.node)
    header = pb.TransferHeader(job=job.spec.job, node=route.node, output=route.output, step=0,
                               microbatch=0 if producer.per_microbatch else -1, consumer_node=route.consumer_node,
                               arg=route.arg, to=workers["wB"].to(), from_worker="wA", from_incarnation=100)
    leaves = _zeros_like_output(job.compiled, route.node, route.output)
    assert workers["wB"].stub.Push(codec.chunks(header, leaves), timeout=10).duplicate
    job.grant(0)  # a lower grant changes nothing
    job.grant(2)
    job.wait_instances(2)
    assert max(ev.step for ev in job.done()) == 1
    job.grant(job.spec.steps)
    job.wait_instances(job.spec.steps)
    assert state_digest(job.fetch_states()) == ref.state_digest
    job.unload()


def test_stale_incarnations_unknown_jobs_and_double_loads_are_refused(workers: dict[str, Worker]) -> None:
    compiled, _ = compiled_and_reference("rl_loop")
    w = workers["wA"]
    with pytest.raises(grpc.RpcError) as err:
        w.stub.RunSteps(pb.RunStepsRequest(to=w.to(), job="nope", until_step=1), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    job = load("rl_loop", workers)
    with pytest.raises(grpc.RpcError) as err:
        w.stub.LoadJob(job.requests["wA"], timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "unload it first" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        w.stub.RunSteps(pb.RunStepsRequest(to=w.to(incarnation=7), job=job.spec.job, until_step=1), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "incarnation 7" in err.value.details()
    header = pb.TransferHeader(job=job.spec.job, state="policy", step=0, microbatch=-1, consumer_node="sync",
                               arg="policy", to=w.to(incarnation=7), from_worker="wB", from_incarnation=101)
    leaves = jax.tree_util.tree_leaves(job.compiled.states["policy"].aval)
    with pytest.raises(grpc.RpcError) as err:
        w.stub.Push(codec.chunks(header, [np.zeros(a.shape, a.dtype) for a in leaves]), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        w.stub.LoadJob(pb.LoadJobRequest(to=w.to(incarnation=7), job="other"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    job.unload()


def test_unload_ends_the_event_streams_and_is_idempotent(workers: dict[str, Worker]) -> None:
    job = load("data_parallel", workers)
    w = workers["wB"]
    late = Events(w.stub.JobEvents(pb.JobEventsRequest(to=w.to(), job=job.spec.job)))
    job.grant(1)
    job.wait_instances(1)
    job.unload()
    assert job.events["wB"].ended.wait(5) and late.ended.wait(5)
    job.unload()  # again: fine
    with pytest.raises(grpc.RpcError) as err:
        list(w.stub.FetchState(pb.FetchStateRequest(to=w.to(), job=job.spec.job), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    load("data_parallel", workers).unload()  # and it can be loaded again


def test_state_versions_follow_the_producer_and_are_dropped_once_spent() -> None:
    # produced every 3 steps, read by one per-step node every step, pushed to one consumer per step
    sv = StateVersions("p", producer_every=3, steps=7, readers=[(1, 1)], push_everies=[1])
    assert [sv.key(s) for s in range(8)] == [0, 1, 1, 1, 4, 4, 4, 7]
    sv.add(0, ["init"])
    sv.add(1, ["v1"])  # the producer ran at step 0 before step 0's readers: the init stays
    assert sv.at(0) == ["init"] and sv.at(3) == ["v1"] and sv.at(4) is None
    sv.use(0)
    sv.use(0)
    assert len(sv) == 1 and sv.at(0) is None  # read and pushed: gone
    frozen = StateVersions("f", producer_every=0, steps=7, readers=[(1, 4)], push_everies=[])
    frozen.add(0, ["w"])
    for s in range(7):
        assert frozen.use(s) == ["w"]
    assert frozen.at(7) == ["w"]


def test_node_progress_keeps_a_watermark() -> None:
    p = NodeProgress(every=2, microbatches=(0, 1), steps=6)
    p.mark_started(2, 0)
    p.mark_started(0, 1)
    assert p.low == 0 and p.is_started(0, 1) and not p.is_started(0, 0)
    p.mark_started(0, 0)
    assert p.low == 2 and p.is_started(0, 0)
    p.mark_started(2, 1)
    p.mark_started(4, 0)
    p.mark_started(4, 1)
    assert p.all_started


def test_the_router_hands_values_over_here_or_to_the_outbox_and_keeps_state_push_progress() -> None:
    # fwd.y goes to loss.x on this worker and to a consumer on worker "far"; state w is pushed to far's
    # sync, which runs every 2 steps. No devices: the pieces of the runtime alone.
    control = JobControl("j", cluster="c", worker_id="here", admit=lambda to: None, incarnation=lambda: 3,
                         outlog=OutputLog(1 << 20))
    ref = pb.InputBinding(arg="x", kind=pb.InputBinding.REF, node="fwd", output="y", leaves=1)
    loss = pb.NodeProgram(name="loss", slice="s", every=1, inputs=[ref])
    nodes = {"fwd": LoadedNode(pb.NodeProgram(name="fwd", slice="s", every=1), None, (-1,),  # type: ignore[arg-type]
                               NodeProgress(1, (-1,), 4)),
             "loss": LoadedNode(loss, None, (-1,), NodeProgress(1, (-1,), 4))}  # type: ignore[arg-type]
    states = {"w": StateVersions("w", producer_every=0, steps=4, readers=[], push_everies=[2])}
    states["w"].add(0, [np.zeros(2)])
    inputs = Inputs(control, nodes, states, steps=4, microbatches=1)
    outbox = FakeOutbox()
    router = Router(control, nodes, {"w"}, states, inputs, outbox, steps=4, start_step=0)  # type: ignore[arg-type]
    routes = [pb.Route(node="fwd", output="y", consumer_node="loss", arg="x", worker_id="here", incarnation=3),
              pb.Route(node="fwd", output="y", consumer_node="head", arg="x", worker_id="far", incarnation=9),
              pb.Route(state="w", consumer_node="sync", arg="w", worker_id="far", incarnation=9, consumer_every=2)]
    router.set_routes(routes)
    assert outbox.targets == {("here", 3), ("far", 9)} and router.push_everies("w") == [2]

    with control.cv:
        router.send_output("fwd", "y", 0, -1, [np.ones(1)])
    assert inputs.ready(nodes["loss"], 0, -1) and not inputs.ready(nodes["loss"], 1, -1)
    [pushed] = outbox.sent
    assert (pushed.to.worker_id, pushed.consumer_node, pushed.from_worker, pushed.from_incarnation) == (
        "far", "head", "here", 3)
    local = pb.TransferHeader(job="j", consumer_node="loss", arg="x", step=0, microbatch=-1)
    assert inputs.deliver(local, [np.ones(1)])  # already held: a duplicate
    with pytest.raises(DeliveryError):
        inputs.deliver(pb.TransferHeader(job="j", consumer_node="loss", arg="x", step=1, microbatch=-1), [])

    outbox.sent.clear()
    control.until = 4
    router.pump_state_pushes()  # the steps sync runs at, once granted
    assert [(h.state, h.step) for h in outbox.sent] == [("w", 0), ("w", 2)]
    router.set_routes(routes)  # a rewire keeps what was pushed already
    router.pump_state_pushes()
    assert len(outbox.sent) == 2
    with pytest.raises(LoadError):
        router.set_routes([pb.Route(node="gone", output="y", consumer_node="loss", arg="x", worker_id="here")])

    router.set_routes(routes)
    outbox.sent.clear()
    control.stopped = True
    router.send_output("fwd", "y", 1, -1, [np.ones(1)])
    assert outbox.sent == []  # an unloaded job pushes nothing


def test_an_instance_that_raises_is_reported_and_stops_the_job(workers: dict[str, Worker]) -> None:
    job = load("data_parallel", workers)
    rt = workers["wB"].service.loaded(job.spec.job)
    assert rt is not None

    def broken(*args: Any) -> Any:
        raise FloatingPointError("boom")

    rt.nodes["train"].call = broken
    job.grant(job.spec.steps)
    events = job.events["wB"]
    wait_until(lambda: any(ev.error for ev in list(events.items)), 30, "the failed instance")
    failed = [ev for ev in events.items if ev.error]
    assert [(ev.node, ev.step, ev.microbatch) for ev in failed] == [("train", 0, -1)]
    assert "FloatingPointError: boom" in failed[0].error
    rt.scheduler.join(10)  # the job failed: its device threads end, and nothing runs after the failure
    assert not rt.scheduler.alive()
    assert rt.scheduler.completed == 1  # the batch of step 0; the failed instance is not complete
    assert {(ev.node, ev.step) for ev in events.items} == {("batch", 0), ("train", 0)}
    w = workers["wB"]
    with pytest.raises(grpc.RpcError) as err:
        list(w.stub.FetchState(pb.FetchStateRequest(to=w.to(), job=job.spec.job), timeout=10))
    assert err.value.code() == grpc.StatusCode.ABORTED and "boom" in err.value.details()
    job.unload()


def test_a_fenced_worker_neither_runs_nor_pushes_until_its_fence_lifts(workers: dict[str, Worker]) -> None:
    _, ref = compiled_and_reference("rl_loop")
    job = load("rl_loop", workers)
    wA, wB = workers["wA"], workers["wB"]
    wA.fence.set()
    with pytest.raises(grpc.RpcError) as err:
        wA.stub.RunSteps(pb.RunStepsRequest(to=wA.to(), job=job.spec.job, until_step=1), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fenced" in err.value.details()
    wA.service.loaded(job.spec.job).grant(job.spec.steps)  # granted before the fence, say
    wB.stub.RunSteps(pb.RunStepsRequest(to=wB.to(), job=job.spec.job, until_step=job.spec.steps), timeout=10)
    job.wait_idle()
    assert job.done() == []  # wA runs nothing, so the trainer on wB has no inputs either
    wA.fence.clear()
    job.wait_instances(job.spec.steps)
    assert state_digest(job.fetch_states()) == ref.state_digest
    job.unload()

"""What each worker loads, from a job spec and a placement: pure, no processes."""

from __future__ import annotations

import itertools

import pytest

from rallypoint.client.compile import compile_program
from rallypoint.client.jobspec import job_spec
from rallypoint.recovery.load_plan import SlicePlace, instances_per_step, load_requests
from rallypoint.proto import rallypoint_pb2 as pb
from tests.examples import example


@pytest.fixture(scope="module")
def rl_spec() -> pb.JobSpec:
    return job_spec(compile_program(example("rl_loop").build(steps=4)))


@pytest.fixture(scope="module")
def pipeline_spec() -> pb.JobSpec:
    return job_spec(compile_program(example("pipeline_mlp").build(steps=2)))


def place(spec: pb.JobSpec, workers: list[str]) -> dict[str, SlicePlace]:
    cycle = itertools.cycle(workers)
    out = {}
    for s in spec.slices:
        w = next(cycle)
        out[s.slice] = SlicePlace(w, f"addr-{w}", 10 + int(w[1:]), (0,))
    return out


def test_every_cross_slice_input_has_exactly_one_route_on_its_producers_worker(pipeline_spec: pb.JobSpec) -> None:
    placement = place(pipeline_spec, ["w0", "w1"])
    reqs = load_requests(pipeline_spec, placement, cluster="c", term=7)
    node_slice = {n.name: n.slice for n in pipeline_spec.nodes}
    routes = [(w, r) for w, req in reqs.items() for r in req.routes]
    for node in pipeline_spec.nodes:
        for b in node.inputs:
            if b.kind not in (pb.InputBinding.REF, pb.InputBinding.GATHER):
                continue
            found = [(w, r) for w, r in routes if r.consumer_node == node.name and r.arg == b.arg]
            assert len(found) == 1, (node.name, b.arg)
            w, r = found[0]
            assert w == placement[node_slice[b.node]].worker and (r.node, r.output) == (b.node, b.output)
            consumer = placement[node.slice]
            assert (r.worker_id, r.address, r.incarnation) == (consumer.worker, consumer.address, consumer.incarnation)
    for w, req in reqs.items():
        assert req.to.worker_id == w and req.to.term == 7 and req.to.incarnation == 10 + int(w[1:])
        assert {n.slice for n in req.nodes} == {s.slice for s in req.slices}
        assert [n.name for n in req.nodes] == [n.name for n in pipeline_spec.nodes if n.slice in {s.slice for s in req.slices}]


def test_a_state_read_from_another_slice_is_routed_and_one_on_its_own_slice_is_not(rl_spec: pb.JobSpec) -> None:
    placement = {"sampler": SlicePlace("w0", "a0", 1, (0,)), "reward": SlicePlace("w1", "a1", 2, (0,)),
                 "trainer": SlicePlace("w0", "a0", 1, (1,))}
    reqs = load_requests(rl_spec, placement, cluster="c", term=1)
    state_routes = [r for req in reqs.values() for r in req.routes if r.state]
    # sync (on the sampler slice) reads the trainer's policy; sample reads its own slice's copy.
    assert [(r.state, r.consumer_node, r.arg, r.worker_id) for r in state_routes] == [("policy", "sync", "policy", "w0")]
    assert sorted(s.name for s in reqs["w1"].states) == ["reward_model"]
    assert [(s.slice, list(s.devices)) for s in reqs["w0"].slices] == [("sampler", [0]), ("trainer", [1])]


def test_instances_per_step_counts_microbatches_and_every(rl_spec: pb.JobSpec, pipeline_spec: pb.JobSpec) -> None:
    # rl: prompts, sample, score, train each step; sync every 3 steps.
    assert [instances_per_step(rl_spec, s) for s in range(4)] == [5, 4, 4, 5]
    # pipeline: 4 microbatches x (batch, 3 fwd, loss, 3 bwd) + 4 updates.
    assert instances_per_step(pipeline_spec, 0) == 4 * 8 + 4


def test_a_slice_without_a_placement_is_refused(rl_spec: pb.JobSpec) -> None:
    with pytest.raises(ValueError, match="without a placement"):
        load_requests(rl_spec, {"sampler": SlicePlace("w0", "a", 1, (0,))}, cluster="c", term=1)

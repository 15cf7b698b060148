"""The replay planner (recovery/replay.py): hand cases on the pipeline shape, and
hypothesis properties over random graphs, failures, logs and progress checked
against a brute-force oracle that walks every replayed instance."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.replay import (
    CutRead, Edge, Graph, Node, PullIn, Resend, State, instances, plan_replay, restart_all_plan,
)

B = pb.InputBinding


# --- the brute-force oracle ------------------------------------------------------------------


def missing_inputs(g: Graph, replay: set[str] | frozenset[str], c: int, log_from: Mapping[str, int],
                   done: Mapping[str, int]) -> list[tuple[str, str, int]]:
    """(consumer, producer, step) of every input a replaying instance would wait for forever.

    Walks each replayed instance step by step: a value edge reads the producer's step
    s, a state edge the producer's last instance before s (found by counting down);
    before c it is the cut (or the init). A producer that replays remakes steps >= c;
    one that does not gives steps >= its log_from (from its log, or it has not made
    them yet).
    """
    out = []
    for n in sorted(replay):
        node = g.node(n)
        for s in range(c, max(c, done[n])):
            if s % node.every:
                continue
            for e in g.inputs(n):
                p = g.node(e.producer)
                if e.kind == "value":
                    t: int | None = s
                else:
                    t = next((u for u in range(s - 1, -1, -1) if u % p.every == 0), None)
                    if t is None or t < c:
                        continue
                if e.producer in replay:
                    continue
                if t >= min(log_from.get(e.producer, done[e.producer]), done[e.producer]):
                    continue
                out.append((n, e.producer, t))
    return out


# --- random scenarios ------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn, max_nodes: int = 7, consistent: bool = True, path: bool = False) -> dict:
    """A random graph, failure and progress. ``path``: n0 -> n1 -> ... always, the last node's slice lost
    (long chains of producers to pull in); ``consistent``: no node ahead of what its producers made."""
    n = draw(st.integers(2, max_nodes))
    n_slices = draw(st.integers(2, 4))
    every = [draw(st.sampled_from([1, 1, 2, 3]))]
    for _ in range(n - 1):
        every.append(every[-1] * draw(st.sampled_from([1, 1, 1, 2])) if path else draw(st.sampled_from([1, 1, 2, 3])))
    nodes = [Node(f"n{i}", f"s{draw(st.integers(0, n_slices - 1))}", draw(st.booleans()), every[i]) for i in range(n)]
    edges = [Edge(nodes[i].name, nodes[j].name) for j in range(n) for i in range(j)
             if nodes[j].every % nodes[i].every == 0 and ((path and i == j - 1) or draw(st.integers(0, 2)) > 0)]
    states = []
    for k, p in enumerate(draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))):
        states.append(State(f"st{k}", nodes[p].slice, nodes[p].name))
        for r in draw(st.lists(st.integers(0, n - 1), unique=True, max_size=3)):
            edges.append(Edge(nodes[p].name, nodes[r].name, "state", f"st{k}"))
    for k in range(draw(st.integers(0, 2))):  # constant states, maybe on a slice of their own
        states.append(State(f"const{k}", f"s{draw(st.integers(0, n_slices))}"))
    graph = Graph(tuple(nodes), tuple(edges), tuple(states))
    c = draw(st.integers(0, 6))
    front = c + draw(st.integers(1, 6))  # the step the job had reached; nodes lag it by a little
    done = {nd.name: max(c, front - draw(st.integers(0, 2))) for nd in nodes}
    while consistent:  # a consumer is never ahead of what its producers made
        changed = False
        for e in edges:
            bound = done[e.producer] + (1 if e.kind == "state" else 0)
            if done[e.consumer] > bound:
                done[e.consumer], changed = bound, True
        if not changed:
            break
    slices = sorted(graph.slices)
    lost = draw(st.one_of(st.sets(st.sampled_from(slices), min_size=1, max_size=max(1, len(slices) - 1)),
                          st.sets(st.sampled_from(slices))))
    if path:
        lost = {nodes[-1].slice} | (lost if draw(st.booleans()) else set())
    log_from = {}
    every_log_empty = draw(st.integers(0, 3 - 2 * path)) == 0  # the most pulling in: chains of producers
    for nd in nodes:  # absent: holds nothing; else anywhere from step 0 to what it made
        v = None if every_log_empty else draw(
            st.one_of(st.none(), st.integers(0, done[nd.name]), st.integers(c, done[nd.name])))
        if v is not None:
            log_from[nd.name] = v
    return {"graph": graph, "c": c, "done": done, "lost": lost, "log_from": log_from,
            "microbatches": draw(st.integers(1, 4))}


ANY = st.one_of(scenarios(), scenarios(path=True), scenarios(consistent=False))


def _plan(sc: dict):
    return plan_replay(sc["graph"], lost_slices=sc["lost"], checkpoint_step=sc["c"], log_from=sc["log_from"],
                       done_through=sc["done"])


PROPS = settings(max_examples=150, deadline=None)


@PROPS
@given(scenarios())
def test_every_node_of_a_lost_slice_replays_from_the_checkpoint(sc: dict) -> None:
    plan = _plan(sc)
    for n in sc["graph"].nodes:
        if n.slice in sc["lost"]:
            r = plan.nodes[n.name]
            assert (r.from_step, r.to_step) == (sc["c"], max(sc["c"], sc["done"][n.name]))
    assert plan.lost_slices == frozenset(sc["lost"]) <= plan.restore_slices


@PROPS
@given(ANY)
def test_every_replayed_instance_finds_its_inputs(sc: dict) -> None:
    plan = _plan(sc)
    assert missing_inputs(sc["graph"], plan.replay_set, sc["c"], sc["log_from"], sc["done"]) == []


@PROPS
@given(ANY)
def test_the_set_is_minimal_each_pulled_in_node_is_needed(sc: dict) -> None:
    plan = _plan(sc)
    g, c = sc["graph"], sc["c"]
    lost_nodes = {n.name for n in g.nodes if n.slice in sc["lost"]}
    assert set(plan.pulled_in) == plan.replay_set - lost_nodes
    for m in plan.replay_set - lost_nodes:
        broken = missing_inputs(g, plan.replay_set - {m}, c, sc["log_from"], sc["done"])
        assert any(p == m for _, p, _ in broken), m
        why = plan.pulled_in[m]
        assert why.consumer in plan.replay_set and why.step < why.log_from


@settings(max_examples=150, deadline=None)
@given(st.one_of(scenarios(max_nodes=6), scenarios(max_nodes=6, path=True)))
def test_the_set_is_the_least_valid_one_against_every_subset(sc: dict) -> None:
    plan = _plan(sc)
    g = sc["graph"]
    lost_nodes = {n.name for n in g.nodes if n.slice in sc["lost"]}
    survivors = sorted({n.name for n in g.nodes} - lost_nodes)
    for k in range(len(survivors) + 1):
        for extra in itertools.combinations(survivors, k):
            candidate = lost_nodes | set(extra)
            if not missing_inputs(g, candidate, sc["c"], sc["log_from"], sc["done"]):
                assert plan.replay_set <= candidate


@PROPS
@given(scenarios())
def test_no_loss_no_plan(sc: dict) -> None:
    plan = plan_replay(sc["graph"], lost_slices=(), checkpoint_step=sc["c"], log_from=sc["log_from"],
                       done_through=sc["done"])
    assert plan.empty and plan.replay_set == frozenset() and plan.resend == () and plan.cut_reads == ()
    assert plan.restore_states == frozenset() and plan.total_instances(sc["microbatches"]) == 0


@PROPS
@given(scenarios())
def test_restart_all_re_runs_at_least_as_much(sc: dict) -> None:
    plan = _plan(sc)
    everything = restart_all_plan(sc["graph"], sc["c"], sc["done"], lost_slices=sc["lost"])
    mb = sc["microbatches"]
    assert everything.replay_set == {n.name for n in sc["graph"].nodes}
    assert everything.restore_slices == sc["graph"].slices and everything.resend == ()
    partial, full = instances(plan, mb), instances(everything, mb)
    assert all(partial[n] <= full[n] for n in partial)
    assert plan.total_instances(mb) <= everything.total_instances(mb)


@PROPS
@given(scenarios())
def test_survivors_keep_their_progress_and_resend_what_replayers_read(sc: dict) -> None:
    plan = _plan(sc)
    g, c, done, log_from = sc["graph"], sc["c"], sc["done"], sc["log_from"]
    sent = {(r.producer, r.consumer, r.kind, r.state): set(r.steps) for r in plan.resend}
    assert len(sent) == len(plan.resend)
    for r in plan.resend:
        assert r.producer not in plan.replay_set and r.consumer in plan.replay_set
        assert all(min(log_from.get(r.producer, done[r.producer]), done[r.producer]) <= t < done[r.producer]
                   for t in r.steps)
        assert all(t >= c for t in r.steps) and list(r.steps) == sorted(set(r.steps))
    for n in sorted(plan.replay_set):  # every step read from a survivor that it had made is re-sent
        node = g.node(n)
        for e in g.inputs(n):
            if e.producer in plan.replay_set:
                continue
            p = g.node(e.producer)
            for s in node.steps(c, done[n]):
                t = s if e.kind == "value" else p.last_before(s)
                if t is None or t < c:
                    assert e.kind == "state" and CutRead(e.state, p.slice, n) in plan.cut_reads
                elif t < done[e.producer]:
                    assert t in sent[(e.producer, n, e.kind, e.state)]
    for r in plan.cut_reads:
        assert r.consumer in plan.replay_set and r.slice in plan.restore_slices


@PROPS
@given(scenarios())
def test_restored_states_and_slices(sc: dict) -> None:
    plan = _plan(sc)
    g, lost = sc["graph"], sc["lost"]
    assert plan.restore_states == {s.name for s in g.states if s.slice in lost or s.producer in plan.replay_set}
    replaying_slices = {g.node(n).slice for n in plan.replay_set}
    assert set(lost) <= plan.restore_slices <= set(lost) | replaying_slices | {r.slice for r in plan.cut_reads}


@PROPS
@given(scenarios(), st.randoms(use_true_random=False))
def test_the_plan_does_not_depend_on_declaration_order(sc: dict, rnd: random.Random) -> None:
    g = sc["graph"]
    shuffled = Graph(*(tuple(rnd.sample(xs, len(xs))) for xs in (g.nodes, g.edges, g.states)))
    assert _plan(sc) == _plan(sc | {"graph": shuffled, "lost": list(sc["lost"])[::-1]})


# --- the 4-stage pipeline, built as the JobSpec the coordinator receives ---------------------


def pipeline_spec(stages: int = 4, microbatches: int = 4) -> pb.JobSpec:
    """src (stage0) -> fwd_i -> ... -> fwd_last; bwd_last <- ... bwd_i -> upd_i (gather); params_i states."""
    spec = pb.JobSpec(job="pipe", steps=100, microbatches=microbatches, window=2)

    def ref(arg: str, node: str, output: str, kind: int = B.REF) -> pb.InputBinding:
        return pb.InputBinding(arg=arg, kind=kind, node=node, output=output, leaves=1)

    def params(i: int) -> pb.InputBinding:
        return pb.InputBinding(arg="params", kind=B.STATE, state=f"params{i}", leaves=1)

    spec.nodes.append(pb.NodeProgram(name="src", slice="stage0", per_microbatch=True, every=1, inputs=[
        pb.InputBinding(arg="step", kind=B.STEP), pb.InputBinding(arg="microbatch", kind=B.MICROBATCH)]))
    for i in range(stages):
        spec.slices.append(pb.SliceAssignment(slice=f"stage{i}", mesh_shape=[1], mesh_axes=["d"]))
        spec.states.append(pb.StateProgram(name=f"params{i}", slice=f"stage{i}", producer_node=f"upd{i}",
                                           producer_every=1))
        x = ref("x", "src", "x") if i == 0 else ref("x", f"fwd{i - 1}", "act")
        spec.nodes.append(pb.NodeProgram(name=f"fwd{i}", slice=f"stage{i}", per_microbatch=True, every=1,
                                         inputs=[params(i), x]))
    for i in reversed(range(stages)):
        x = ref("x", "src", "x") if i == 0 else ref("x", f"fwd{i - 1}", "act")
        g = ref("y", "src", "y") if i == stages - 1 else ref("g", f"bwd{i + 1}", "gin")
        extra = [ref("loss", f"fwd{i}", "act")] if i == stages - 1 else []
        spec.nodes.append(pb.NodeProgram(name=f"bwd{i}", slice=f"stage{i}", per_microbatch=True, every=1,
                                         inputs=[params(i), x, g, *extra]))
    for i in range(stages):
        spec.nodes.append(pb.NodeProgram(name=f"upd{i}", slice=f"stage{i}", every=1, inputs=[
            params(i), ref("grads", f"bwd{i}", "grads", B.GATHER)]))
    return spec


PIPE = Graph.from_spec(pipeline_spec())
C = 10  # checkpoint step
DONE = {n.name: 14 for n in PIPE.nodes}  # every node has run steps 10..13 since the checkpoint
FULL_LOGS = {n.name: C for n in PIPE.nodes}


def stage(*stages: int) -> set[str]:
    return {n.name for n in PIPE.nodes if int(n.slice.removeprefix("stage")) in stages}


def test_from_spec_builds_value_and_state_edges() -> None:
    assert {(e.producer, e.kind) for e in PIPE.inputs("bwd2")} == {("bwd3", "value"), ("fwd1", "value"),
                                                                  ("upd2", "state")}
    assert {e.producer for e in PIPE.inputs("bwd3")} == {"fwd2", "src", "fwd3", "upd3"}
    assert PIPE.inputs("src") == ()
    assert PIPE.inputs("upd1") == (Edge("bwd1", "upd1"), Edge("upd1", "upd1", "state", "params1"))
    assert PIPE.slices == {"stage0", "stage1", "stage2", "stage3"}
    assert PIPE.node("fwd1") == Node("fwd1", "stage1", True, 1)


def test_losing_stage2_with_full_logs_replays_only_stage2() -> None:
    plan = plan_replay(PIPE, lost_slices={"stage2"}, checkpoint_step=C, log_from=FULL_LOGS, done_through=DONE)
    assert plan.replay_set == stage(2) == {"fwd2", "bwd2", "upd2"}
    assert plan.pulled_in == {}
    assert plan.resend == (
        Resend("bwd3", "bwd2", "value", "", (10, 11, 12, 13)),
        Resend("fwd1", "bwd2", "value", "", (10, 11, 12, 13)),
        Resend("fwd1", "fwd2", "value", "", (10, 11, 12, 13)),
    )
    assert plan.cut_reads == () and plan.restore_states == {"params2"} and plan.restore_slices == {"stage2"}
    assert plan.instances(4) == {"bwd2": 16, "fwd2": 16, "upd2": 4}
    everything = restart_all_plan(PIPE, C, DONE, lost_slices={"stage2"})
    assert everything.total_instances(4) == 4 * (16 + 16 + 4) + 16  # + the source
    assert plan.total_instances(4) * 4 < everything.total_instances(4)


def test_stage1_log_truncated_pulls_in_all_of_stage1() -> None:
    logs = FULL_LOGS | {n: 12 for n in stage(1)}  # stage 1 holds steps 12.. only
    plan = plan_replay(PIPE, lost_slices={"stage2"}, checkpoint_step=C, log_from=logs, done_through=DONE)
    assert plan.replay_set == stage(1, 2)
    assert plan.pulled_in == {
        "fwd1": PullIn("fwd1", "bwd2", "value", 10, 12),  # bwd2 reads fwd1's activations of step 10
        "upd1": PullIn("upd1", "fwd1", "state", 10, 12),  # fwd1 at step 11 reads params1 made at step 10
        "bwd1": PullIn("bwd1", "upd1", "value", 10, 12),  # upd1 gathers bwd1's gradients of step 10
    }
    assert plan.restore_states == {"params1", "params2"} and plan.restore_slices == {"stage1", "stage2"}
    assert {(r.producer, r.consumer) for r in plan.resend} == {("bwd3", "bwd2"), ("fwd0", "fwd1"), ("fwd0", "bwd1")}
    assert plan.cut_reads == ()


def test_truncation_recurses_through_stage0_to_the_source() -> None:
    logs = FULL_LOGS | {n: 14 for n in stage(0, 1)}  # stages 0 and 1 hold nothing
    plan = plan_replay(PIPE, lost_slices={"stage2"}, checkpoint_step=C, log_from=logs, done_through=DONE)
    assert plan.replay_set == stage(0, 1, 2)
    assert "src" in plan.pulled_in and plan.pulled_in["src"].consumer in {"fwd0", "bwd0"}
    assert not stage(3) & plan.replay_set
    assert plan.restore_slices == {"stage0", "stage1", "stage2"}
    assert plan.resend == (Resend("bwd3", "bwd2", "value", "", (10, 11, 12, 13)),)


def test_only_the_forward_log_truncated_pulls_in_only_the_forward() -> None:
    # upd1 still holds its params (e.g. it pushes them to a remote reader): fwd1 re-runs alone,
    # reading params1 as of step 10 from the checkpoint and the later values from upd1's log.
    logs = FULL_LOGS | {"fwd1": 14}
    plan = plan_replay(PIPE, lost_slices={"stage2"}, checkpoint_step=C, log_from=logs, done_through=DONE)
    assert plan.replay_set == stage(2) | {"fwd1"}
    assert Resend("upd1", "fwd1", "state", "params1", (10, 11, 12)) in plan.resend
    assert plan.cut_reads == (CutRead("params1", "stage1", "fwd1"),)
    assert plan.restore_states == {"params2"} and plan.restore_slices == {"stage1", "stage2"}


def test_losing_stage0_replays_the_source_and_stage0_only() -> None:
    plan = plan_replay(PIPE, lost_slices={"stage0"}, checkpoint_step=C, log_from=FULL_LOGS, done_through=DONE)
    assert plan.replay_set == stage(0) == {"src", "fwd0", "bwd0", "upd0"}
    assert plan.resend == (Resend("bwd1", "bwd0", "value", "", (10, 11, 12, 13)),)


def test_two_lost_stages_and_lagging_progress() -> None:
    done = DONE | {n: 12 for n in stage(3)} | {"bwd2": 12, "upd2": 12}  # the backward wave is behind
    plan = plan_replay(PIPE, lost_slices={"stage1", "stage3"}, checkpoint_step=C, log_from=FULL_LOGS,
                       done_through=done)
    assert plan.replay_set == stage(1, 3)
    assert plan.nodes["bwd3"].steps == range(10, 12) and plan.nodes["fwd1"].steps == range(10, 14)
    # bwd1 replays 10..13 but bwd2 made only 10 and 11: 12 and 13 arrive when bwd2 makes them
    assert Resend("bwd2", "bwd1", "value", "", (10, 11)) in plan.resend


def test_every_and_microbatches_count_instances() -> None:
    g = Graph(
        (Node("src", "t", True), Node("train", "t"), Node("sample", "s", every=3), Node("eval", "s", True, 3)),
        (Edge("src", "train"), Edge("train", "sample", "state", "params"), Edge("train", "train", "state", "params"),
         Edge("sample", "eval")),
        (State("params", "t", "train"),),
    )
    done = {"src": 20, "train": 20, "sample": 19, "eval": 19}
    plan = plan_replay(g, lost_slices={"s"}, checkpoint_step=10, log_from={"train": 17}, done_through=done)
    # sample runs at 12, 15, 18 and reads params made at 11, 14, 17: train's log starts at 17, so train re-runs;
    # train re-reads src's batches of steps 10..19 and src holds none, so src re-runs too
    assert plan.nodes["sample"].steps == range(12, 19, 3)
    assert plan.pulled_in["train"] == PullIn("train", "sample", "state", 11, 17)
    assert plan.pulled_in["src"] == PullIn("src", "train", "value", 10, 20)
    assert plan.instances(5) == {"eval": 15, "sample": 3, "src": 50, "train": 10}
    keep = plan_replay(g, lost_slices={"s"}, checkpoint_step=10, log_from={"train": 11}, done_through=done)
    assert keep.replay_set == {"sample", "eval"}
    assert keep.resend == (Resend("train", "sample", "state", "params", (11, 14, 17)),)
    assert keep.cut_reads == ()


def test_a_state_read_at_the_checkpoint_comes_from_the_cut() -> None:
    g = Graph((Node("w", "a", every=4), Node("r", "b")), (Edge("w", "r", "state", "p"),), (State("p", "a", "w"),))
    plan = plan_replay(g, lost_slices={"b"}, checkpoint_step=6, log_from={}, done_through={"w": 9, "r": 9})
    # r at 6, 7, 8 reads w's value of step 4: the state as at step 6, in the cut; w's empty log does not matter
    assert plan.replay_set == {"r"} and plan.cut_reads == (CutRead("p", "a", "r"),)
    assert plan.restore_slices == {"a", "b"} and plan.restore_states == frozenset()
    at_zero = plan_replay(g, lost_slices={"b"}, checkpoint_step=0, log_from={"w": 1}, done_through={"w": 9, "r": 1})
    assert at_zero.replay_set == {"r"} and at_zero.cut_reads == (CutRead("p", "a", "r"),)  # step 0 reads the init
    at_one = plan_replay(g, lost_slices={"b"}, checkpoint_step=0, log_from={"w": 1}, done_through={"w": 9, "r": 2})
    assert at_one.pulled_in == {"w": PullIn("w", "r", "state", 0, 1)}  # r at step 1 reads w's value of step 0


def test_a_lost_slice_with_only_a_constant_state_restores_it() -> None:
    g = Graph((Node("a", "x"),), (), (State("table", "y"),))
    plan = plan_replay(g, lost_slices={"y"}, checkpoint_step=3, log_from={}, done_through={"a": 5})
    assert plan.replay_set == frozenset() and plan.restore_states == {"table"} and plan.restore_slices == {"y"}
    assert not plan.empty


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lost_slices": {"nope"}}, "lost slices ['nope'] are not in the graph"),
    ({"done_through": {"a": 5}}, "done_through lacks nodes ['b']"),
    ({"done_through": {"a": 5, "b": 5, "z": 1}}, "done_through names unknown nodes ['z']"),
    ({"log_from": {"a": -1}}, "log_from of nodes ['a'] must be non-negative"),
    ({"checkpoint_step": -2}, "checkpoint step must be a non-negative integer"),
    ({"done_through": {"a": 5, "b": 2}}, "node 'b' has not run its instance of step 2 but the checkpoint at step 3"),
])
def test_inconsistent_inputs_are_refused(kwargs: dict, message: str) -> None:
    g = Graph((Node("a", "x"), Node("b", "y")), (Edge("a", "b"),))
    args = {"lost_slices": {"y"}, "checkpoint_step": 3, "log_from": {}, "done_through": {"a": 5, "b": 5}} | kwargs
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_replay(g, **args)


def test_a_node_that_runs_every_k_steps_has_passed_the_cut_between_its_instances() -> None:
    g = Graph((Node("a", "x", every=5),))
    plan = plan_replay(g, lost_slices={"x"}, checkpoint_step=8, log_from={}, done_through={"a": 6})
    assert plan.nodes["a"].from_step == plan.nodes["a"].to_step == 8 and plan.instances(1) == {"a": 0}


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Graph((Node("a", "x"), Node("a", "y"))), "node 'a' is declared twice"),
    (lambda: Graph((Node("a", "x"),), (Edge("a", "b"),)), "names unknown node 'b'"),
    (lambda: Graph((Node("a", "x", every=2), Node("b", "x", every=3)), (Edge("a", "b"),)), "runs every 3 steps"),
    (lambda: Graph((Node("a", "x"),), (), (State("p", "y", "a"),)), "lives on slice 'y' but its producer"),
    (lambda: Graph((Node("a", "x"), Node("b", "x")), (Edge("a", "b", "state", "p"),)), "state 'p' is not declared"),
    (lambda: Graph((Node("a", "x", every=0),)), "every must be a positive integer"),
    (lambda: Graph((Node("a", "x"),), (Edge("a", "a", "loop"),)), "unknown kind 'loop'"),  # type: ignore[arg-type]
])
def test_malformed_graphs_are_refused(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        build()


def test_from_spec_refuses_an_unknown_state() -> None:
    spec = pb.JobSpec(job="j", nodes=[pb.NodeProgram(name="a", slice="x", inputs=[
        pb.InputBinding(arg="p", kind=B.STATE, state="ghost")])])
    with pytest.raises(ValueError, match="input 'p' of node 'a' reads unknown state 'ghost'"):
        Graph.from_spec(spec)


def test_from_spec_treats_every_zero_as_one_and_skips_constant_states() -> None:
    spec = pb.JobSpec(job="j", nodes=[pb.NodeProgram(name="a", slice="x", inputs=[
        pb.InputBinding(arg="p", kind=B.STATE, state="k")])], states=[pb.StateProgram(name="k", slice="x")])
    g = Graph.from_spec(spec)
    assert g.node("a").every == 1 and g.inputs("a") == () and g.states == (State("k", "x", ""),)

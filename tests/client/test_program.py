"""The Program API's validation: every failure is a ProgramError naming what is at fault.

Declaration-time checks (as the graph is built), whole-graph checks in
``Program.validate()``, tracing checks in ``compile_program()``, cluster-shape checks
in ``Program.validate_for_cluster()``, and loading job files. Compiled programs here
are tiny (slices of one device, arrays of a few elements) so the module runs fast.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

from rallypoint.client.compile import compile_program, ensure_host_devices
from rallypoint.client.jobfile import load_program
from rallypoint.client.program import Gathered, NodeHandle, Program, ProgramError, Ref, StateRef, gather
from tests.examples import example as _example

# tests/conftest.py gives this process 8 CPU devices; this is a no-op then, and makes
# the module self-sufficient otherwise (it must run before any JAX operation).
ensure_host_devices(4)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _m(text: str) -> str:
    """A regex matching ``text`` literally (messages hold brackets, dots and parens)."""
    return re.escape(text)


def identity(x: Any) -> Any:
    return x


def one_slice(**kw: Any) -> tuple[Program, str]:
    prog = Program("p", steps=2, **kw)
    return prog, prog.slice("s", devices=1)


def ones3(step: Any, microbatch: Any) -> Any:
    return jnp.ones((3,), jnp.float32) + 0 * step  # a source's batch depends on its step (compile refuses it else)


# ---------------------------------------------------------------------------
# Declaration time: Program


@pytest.mark.parametrize("attr", ["steps", "microbatches", "checkpoint_every"])
def test_program_counts_must_be_positive(attr: str) -> None:
    kw: dict[str, Any] = {"steps": 3, attr: 0}
    with pytest.raises(ProgramError, match=_m(f"Program 'p': {attr} must be a positive integer, got 0")):
        Program("p", **kw)


def test_program_invalid_name_is_a_program_error() -> None:
    with pytest.raises(ProgramError, match=_m("invalid job name 'bad name'")):
        Program("bad name", steps=1)


# ---------------------------------------------------------------------------
# Declaration time: names


def test_state_name_clashing_with_slice() -> None:
    prog, s = one_slice()
    with pytest.raises(ProgramError, match=_m("state name 's' is already used in program 'p'")):
        prog.state("s", slice=s, init=lambda: jnp.zeros(()))


def test_node_name_clashing_with_state() -> None:
    prog, s = one_slice()
    prog.state("w", slice=s, init=lambda: jnp.zeros(()))
    with pytest.raises(ProgramError, match=_m("node name 'w' is already used in program 'p'")):
        prog.source("w", ones3, slice=s)


def test_slice_name_clashing_with_node() -> None:
    prog, s = one_slice()
    prog.source("data", ones3, slice=s)
    with pytest.raises(ProgramError, match=_m("slice name 'data' is already used in program 'p'")):
        prog.slice("data")


def test_node_name_clashing_with_node() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    prog.node("n", identity, slice=s, inputs={"x": src})
    with pytest.raises(ProgramError, match=_m("node name 'n' is already used in program 'p'")):
        prog.node("n", identity, slice=s, inputs={"x": src})


@pytest.mark.parametrize("kind,name", [("slice", "bad name"), ("state", "-lead"), ("node", "a/b"), ("node", "")])
def test_invalid_names(kind: str, name: str) -> None:
    prog, s = one_slice()
    declare: dict[str, Callable[[], Any]] = {
        "slice": lambda: prog.slice(name),
        "state": lambda: prog.state(name, slice=s, init=lambda: jnp.zeros(())),
        "node": lambda: prog.source(name, ones3, slice=s),
    }
    with pytest.raises(ProgramError, match=_m(f"invalid {kind} name {name!r}")):
        declare[kind]()
    assert name not in prog.slices and name not in prog.states and name not in prog.nodes


# ---------------------------------------------------------------------------
# Declaration time: slices


def test_unknown_slice_for_node() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    with pytest.raises(ProgramError, match=_m("node 'n' is placed on unknown slice 'nowhere'; declared slices: ['s']")):
        prog.node("n", identity, slice="nowhere", inputs={"x": src})


def test_unknown_slice_for_state() -> None:
    prog, _ = one_slice()
    with pytest.raises(ProgramError, match=_m("state 'w' is placed on unknown slice 'nowhere'")):
        prog.state("w", slice="nowhere", init=lambda: jnp.zeros(()))


def test_unknown_slice_for_source() -> None:
    prog, _ = one_slice()
    with pytest.raises(ProgramError, match=_m("node 'data' is placed on unknown slice 'nowhere'")):
        prog.source("data", ones3, slice="nowhere")
    assert "data" not in prog.nodes


@pytest.mark.parametrize("devices", [0, -2])
def test_slice_devices_must_be_positive(devices: int) -> None:
    prog = Program("p", steps=1)
    with pytest.raises(ProgramError, match=_m(f"slice 'z': devices must be a positive integer, got {devices}")):
        prog.slice("z", devices=devices)
    assert "z" not in prog.slices


def test_slice_mesh_shape_not_matching_devices() -> None:
    prog = Program("p", steps=1)
    with pytest.raises(ProgramError, match=_m("slice 'm': mesh_shape (2, 3) holds 6 devices, not 4")):
        prog.slice("m", devices=4, mesh_axes=("a", "b"), mesh_shape=(2, 3))


def test_slice_mesh_shape_not_matching_axes() -> None:
    prog = Program("p", steps=1)
    with pytest.raises(ProgramError, match=_m("slice 'm': mesh_shape (4,) does not match mesh_axes ('a', 'b')")):
        prog.slice("m", devices=4, mesh_axes=("a", "b"), mesh_shape=(4,))


def test_slice_default_mesh_shape() -> None:
    prog = Program("p", steps=1)
    prog.slice("m", devices=4, mesh_axes=("data", "model"))
    assert prog.slices["m"].mesh_shape == (4, 1)


# ---------------------------------------------------------------------------
# Declaration time: nodes


def test_per_must_be_step_or_microbatch() -> None:
    prog, s = one_slice()
    with pytest.raises(ProgramError, match=_m("node 'data': per must be 'step' or 'microbatch', got 'epoch'")):
        prog.source("data", ones3, slice=s, per="epoch")  # type: ignore[arg-type]


@pytest.mark.parametrize("every", [0, -1])
def test_every_must_be_positive(every: int) -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    with pytest.raises(ProgramError, match=_m(f"node 'n': every must be a positive integer, got {every}")):
        prog.node("n", identity, slice=s, inputs={"x": src}, every=every)


def test_duplicate_outputs() -> None:
    prog, s = one_slice()
    with pytest.raises(ProgramError, match=_m("node 'data': outputs must be distinct names, got ['x', 'x']")):
        prog.source("data", ones3, slice=s, outputs=("x", "x"))


def test_no_outputs() -> None:
    prog, s = one_slice()
    with pytest.raises(ProgramError, match=_m("node 'data': outputs must be distinct names, got []")):
        prog.source("data", ones3, slice=s, outputs=())


def test_updates_naming_a_missing_output() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((3,)))
    with pytest.raises(ProgramError, match=_m("node 'n': updates names output 'w', which it does not have")):
        prog.node("n", identity, slice=s, inputs={"x": w}, outputs=("out",), updates={"w": w})
    assert "n" not in prog.nodes


def test_updates_value_not_a_state() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((3,)))
    with pytest.raises(ProgramError, match=_m("node 'n': updates['out'] must be a state, got 'w'")):
        prog.node("n", identity, slice=s, inputs={"x": w}, updates={"out": "w"})  # type: ignore[dict-item]


def test_node_handle_unknown_output() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, outputs=("x", "y"))
    assert src["x"] == Ref("data", "x")
    with pytest.raises(ProgramError, match=_m("node 'data' has no output 'z'; its outputs are ['x', 'y']")):
        src["z"]


def test_ref_on_multi_output_node() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, outputs=("x", "y"))
    with pytest.raises(ProgramError, match=_m("node 'data' has outputs ['x', 'y']: pick one with node[\"name\"]")):
        src.ref


def test_multi_output_handle_as_input_is_rejected() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step", outputs=("x", "y"))
    with pytest.raises(ProgramError, match=_m("node 'data' has outputs ['x', 'y']")):
        prog.node("n", identity, slice=s, inputs={"x": src})


def test_gather_of_something_else() -> None:
    with pytest.raises(ProgramError, match="expected a node output"):
        gather("data.x")  # type: ignore[arg-type]


def test_single_output_handle_resolves_to_its_ref() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    assert isinstance(src, NodeHandle)
    n = prog.node("n", identity, slice=s, inputs={"x": src})
    assert prog.nodes["n"].inputs == {"x": Ref("data", "out")}
    assert gather(n) == Gathered(Ref("n", "out"))


# ---------------------------------------------------------------------------
# Program.validate()


def test_validate_no_nodes() -> None:
    prog, _ = one_slice()
    with pytest.raises(ProgramError, match=_m("program 'p' has no nodes")):
        prog.validate()


def test_validate_input_no_node_produces() -> None:
    prog, s = one_slice()
    prog.node("n", identity, slice=s, inputs={"x": Ref("ghost", "out")})
    with pytest.raises(ProgramError, match=_m("input 'x' of node 'n' reads ghost.out, which no node produces")):
        prog.validate()


def test_validate_input_reads_missing_output_of_existing_node() -> None:
    prog, s = one_slice()
    prog.source("data", ones3, slice=s, per="step")
    prog.node("n", identity, slice=s, inputs={"x": Ref("data", "nope")})
    with pytest.raises(ProgramError, match=_m("input 'x' of node 'n' reads data.nope, which no node produces")):
        prog.validate()


def test_validate_input_of_wrong_kind() -> None:
    prog, s = one_slice()
    prog.node("n", identity, slice=s, inputs={"x": 3.0})  # type: ignore[dict-item]
    with pytest.raises(ProgramError, match=_m("input 'x' of node 'n' must be a node output, a state or gather(...)")):
        prog.validate()


def test_validate_unknown_state() -> None:
    prog, s = one_slice()
    prog.node("n", identity, slice=s, inputs={"x": StateRef("ghost", s)})
    with pytest.raises(ProgramError, match=_m("input 'x' of node 'n' reads unknown state 'ghost'")):
        prog.validate()


def test_validate_gather_of_per_step_output() -> None:
    prog, s = one_slice(microbatches=2)
    src = prog.source("data", ones3, slice=s, per="step")
    prog.node("n", identity, slice=s, inputs={"x": gather(src)})
    with pytest.raises(ProgramError, match=_m(
        "input 'x' of node 'n': gather(data.out) needs a per-microbatch output, 'data' runs per step"
    )):
        prog.validate()


def test_validate_gather_feeding_per_microbatch_node() -> None:
    prog, s = one_slice(microbatches=2)
    src = prog.source("data", ones3, slice=s, per="microbatch")
    prog.node("n", identity, slice=s, per="microbatch", inputs={"x": gather(src)})
    with pytest.raises(ProgramError, match=_m(
        "input 'x' of node 'n': gather(...) feeds per-step nodes only; 'n' runs per microbatch"
    )):
        prog.validate()


def test_validate_per_step_reading_per_microbatch_without_gather() -> None:
    prog, s = one_slice(microbatches=2)
    src = prog.source("data", ones3, slice=s, per="microbatch")
    prog.node("n", identity, slice=s, per="step", inputs={"x": src})
    with pytest.raises(ProgramError, match=_m(
        "input 'x' of node 'n' reads per-microbatch data.out in a per-step node: use gather(data.out)"
    )):
        prog.validate()


def test_validate_per_microbatch_reading_per_step_is_fine() -> None:
    prog, s = one_slice(microbatches=2)
    src = prog.source("data", ones3, slice=s, per="step")
    prog.node("n", identity, slice=s, per="microbatch", inputs={"x": src})
    prog.validate()


def test_validate_reading_every_k_output_with_different_every() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    slow = prog.node("slow", identity, slice=s, inputs={"x": src}, every=3)
    prog.node("fast", identity, slice=s, inputs={"x": slow})
    with pytest.raises(ProgramError, match=_m(
        "input 'x' of node 'fast' reads slow.out from a node that runs every 3 steps"
    )):
        prog.validate()


def test_validate_reading_every_k_output_with_same_every_is_fine() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    slow = prog.node("slow", identity, slice=s, inputs={"x": src}, every=3)
    prog.node("also_slow", identity, slice=s, inputs={"x": slow}, every=3)
    prog.validate()


def test_validate_two_nodes_updating_one_state() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((3,)))
    prog.node("a", identity, slice=s, inputs={"x": w}, updates={"out": w})
    prog.node("b", identity, slice=s, inputs={"x": w}, updates={"out": w})
    with pytest.raises(ProgramError, match=_m(
        "state 'w' is produced by 2 nodes [('a', 'out'), ('b', 'out')]; exactly one may"
    )):
        prog.validate()


def test_validate_per_microbatch_node_updating_state() -> None:
    prog, s = one_slice(microbatches=2)
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((3,)))
    prog.node("mb", identity, slice=s, per="microbatch", inputs={"x": w}, updates={"out": w})
    with pytest.raises(ProgramError, match=_m("node 'mb' updates state 'w' but runs per microbatch")):
        prog.validate()


def test_validate_state_updated_from_another_slice() -> None:
    prog = Program("p", steps=2)
    s0, s1 = prog.slice("s0"), prog.slice("s1")
    w = prog.state("w", slice=s1, init=lambda: jnp.zeros((3,)))
    prog.node("n", identity, slice=s0, inputs={"x": w}, updates={"out": w})
    with pytest.raises(ProgramError, match=_m(
        "node 'n' on slice 's0' updates state 'w', which lives on slice 's1'"
    )):
        prog.validate()


def test_validate_reading_state_of_another_slice_is_fine() -> None:
    prog = Program("p", steps=2)
    s0, s1 = prog.slice("s0"), prog.slice("s1")
    w = prog.state("w", slice=s1, init=lambda: jnp.zeros((3,)))
    prog.node("n", identity, slice=s0, inputs={"x": w})
    prog.validate()


def test_validate_metric_reading_unknown_output() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    prog.metric("loss", Ref("data", "loss"))
    prog.metric("ok", src)
    with pytest.raises(ProgramError, match=_m("metric 'loss' reads data.loss, which no node produces")):
        prog.validate()


def test_validate_metric_reading_unknown_node() -> None:
    prog, s = one_slice()
    prog.source("data", ones3, slice=s, per="step")
    prog.metric("loss", Ref("ghost", "out"))
    with pytest.raises(ProgramError, match=_m("metric 'loss' reads ghost.out, which no node produces")):
        prog.validate()


def test_validate_cycle_within_a_step() -> None:
    prog, s = one_slice()
    prog.node("a", identity, slice=s, inputs={"x": Ref("b", "out")})
    prog.node("b", identity, slice=s, inputs={"x": Ref("a", "out")})
    with pytest.raises(ProgramError, match=_m("cycle within a step: a -> b -> a")) as info:
        prog.validate()
    assert "state" in str(info.value) and "updates=" in str(info.value)


def test_validate_cycle_path_excludes_the_tail_leading_into_it() -> None:
    prog, s = one_slice()
    prog.node("head", identity, slice=s, inputs={"x": Ref("a", "out")})
    prog.node("a", identity, slice=s, inputs={"x": Ref("c", "out")})
    prog.node("b", identity, slice=s, inputs={"x": Ref("a", "out")})
    prog.node("c", identity, slice=s, inputs={"x": Ref("b", "out")})
    with pytest.raises(ProgramError, match=_m("cycle within a step: a -> c -> b -> a;")):
        prog.validate()


def test_validate_self_loop() -> None:
    prog, s = one_slice()
    prog.node("a", identity, slice=s, inputs={"x": Ref("a", "out")})
    with pytest.raises(ProgramError, match=_m("cycle within a step: a -> a")):
        prog.validate()


def test_validate_cycle_through_gather() -> None:
    prog, s = one_slice(microbatches=2)
    prog.node("step", identity, slice=s, inputs={"x": gather(Ref("mb", "out"))})
    prog.node("mb", identity, slice=s, per="microbatch", inputs={"x": Ref("step", "out")})
    with pytest.raises(ProgramError, match=_m("cycle within a step: step -> mb -> step")):
        prog.validate()


def test_state_carries_a_value_around_a_loop_without_a_cycle() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((3,)))
    a = prog.node("a", lambda x: x + 1.0, slice=s, inputs={"x": w})
    prog.node("b", identity, slice=s, inputs={"x": a}, updates={"out": w})
    prog.validate()
    assert prog.topo_order() == ["a", "b"]
    assert prog.producer_of("w") == ("b", "out")


# ---------------------------------------------------------------------------
# compile_program(): tracing


def test_compile_shape_mismatch_names_consumer_and_input_shapes() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=lambda: jnp.ones((4, 5), jnp.float32))
    x = prog.source("data", lambda step, mb: jnp.ones((2, 3), jnp.float32) * step, slice=s, per="step")
    prog.node("matmul", lambda x, w: x @ w, slice=s, inputs={"x": x, "w": w})
    with pytest.raises(ProgramError, match=_m(
        "node 'matmul' failed to trace with inputs (x=float32[2, 3], w=float32[4, 5]): TypeError"
    )):
        compile_program(prog)


def test_compile_shape_mismatch_shows_pytree_inputs() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=lambda: {"k": jnp.ones((4, 5), jnp.float32)})
    x = prog.source("data", lambda step, mb: jnp.ones((2, 3), jnp.float32) * step, slice=s, per="step")
    prog.node("matmul", lambda x, w: x @ w["k"], slice=s, inputs={"x": x, "w": w})
    with pytest.raises(ProgramError, match=_m("node 'matmul' failed to trace with inputs (x=float32[2, 3], w=")) as info:
        compile_program(prog)
    assert "float32[4, 5]" in str(info.value)


def test_compile_gathered_input_has_microbatch_axis() -> None:
    prog, s = one_slice(microbatches=3)
    src = prog.source("data", ones3, slice=s, per="microbatch")
    # Expects (3,) but gets (3 microbatches, 3): the message shows the stacked shape.
    prog.node("n", lambda x: jnp.ones((2,)) @ x, slice=s, inputs={"x": gather(src)})
    with pytest.raises(ProgramError, match=_m("node 'n' failed to trace with inputs (x=float32[3, 3])")):
        compile_program(prog)


def test_compile_state_dtype_changed_by_updater() -> None:
    prog, s = one_slice()
    count = prog.state("count", slice=s, init=lambda: jnp.zeros((), jnp.int32))
    prog.node("inc", lambda c: c + 0.5, slice=s, inputs={"c": count}, updates={"out": count})
    with pytest.raises(ProgramError, match=_m(
        "node 'inc' produces state 'count' as float32[], but its init is int32[]"
    )):
        compile_program(prog)


def test_compile_state_shape_changed_by_updater() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=lambda: {"v": jnp.zeros((3,), jnp.float32)})
    prog.node("grow", lambda w: {"v": jnp.concatenate([w["v"], w["v"]])}, slice=s,
              inputs={"w": w}, updates={"out": w})
    with pytest.raises(ProgramError, match=_m("node 'grow' produces state 'w' as {'v': 'float32[6]'}")) as info:
        compile_program(prog)
    assert "{'v': 'float32[3]'}" in str(info.value)


def test_compile_dict_with_wrong_keys() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    prog.node("split", lambda x: {"a": x, "c": x}, slice=s, inputs={"x": src}, outputs=("a", "b"))
    with pytest.raises(ProgramError, match=_m("node 'split' returned outputs ['a', 'c'], but declares ['a', 'b']")):
        compile_program(prog)


def test_compile_multi_output_node_returning_a_bare_array() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    prog.node("split", identity, slice=s, inputs={"x": src}, outputs=("a", "b"))
    with pytest.raises(ProgramError, match=_m("node 'split' must return a dict with keys ['a', 'b']")):
        compile_program(prog)


def test_compile_source_with_wrong_keys() -> None:
    prog, s = one_slice()
    prog.source("data", lambda step, mb: {"x": jnp.ones(3) * step}, slice=s, outputs=("x", "y"))
    with pytest.raises(ProgramError, match=_m("node 'data' returned outputs ['x'], but declares ['x', 'y']")):
        compile_program(prog)


def test_compile_metric_not_a_scalar() -> None:
    prog, s = one_slice()
    src = prog.source("data", ones3, slice=s, per="step")
    prog.metric("loss", src)
    with pytest.raises(ProgramError, match=_m(
        "metric 'loss' reads data.out, which is float32[3]; a metric must be a scalar"
    )):
        compile_program(prog)


def test_compile_metric_pytree_not_a_scalar() -> None:
    prog, s = one_slice()
    src = prog.source("data", lambda step, mb: {"v": jnp.zeros(()) + step}, slice=s, per="step")
    prog.metric("loss", src)
    with pytest.raises(ProgramError, match=_m("metric 'loss' reads data.out, which is {'v': 'float32[]'}")):
        compile_program(prog)


def _failing_init() -> Any:
    raise ValueError("no weights found")


def test_compile_state_init_that_raises() -> None:
    prog, s = one_slice()
    w = prog.state("w", slice=s, init=_failing_init)
    prog.node("n", identity, slice=s, inputs={"x": w})
    with pytest.raises(ProgramError, match=_m("init of state 'w' failed to trace: ValueError: no weights found")):
        compile_program(prog)


def test_compile_runs_structural_validation_first() -> None:
    prog, s = one_slice()
    prog.node("n", identity, slice=s, inputs={"x": Ref("ghost", "out")})
    with pytest.raises(ProgramError, match=_m("input 'x' of node 'n' reads ghost.out, which no node produces")):
        compile_program(prog)


def test_compile_small_program_interface() -> None:
    prog, s = one_slice(microbatches=2)
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((3,), jnp.float32))
    src = prog.source("data", ones3, slice=s, per="microbatch")
    g = prog.node("grad", lambda w, x: {"g": x - w, "loss": jnp.sum(x)}, slice=s, per="microbatch",
                  inputs={"w": w, "x": src}, outputs=("g", "loss"))
    prog.node("upd", lambda w, g: w + jnp.mean(g, axis=0), slice=s,
              inputs={"w": w, "g": gather(g["g"])}, outputs=("w",), updates={"w": w})
    prog.metric("loss", g["loss"])
    compiled = compile_program(prog)
    assert compiled.order == ("data", "grad", "upd")
    assert compiled.nodes["data"].input_names == ("step", "microbatch")
    assert compiled.nodes["upd"].input_names == ("w", "g")
    assert compiled.nodes["upd"].out_avals["w"].shape == (3,)
    assert compiled.states["w"].producer == ("upd", "w")
    assert all(isinstance(n.exported, bytes) and n.exported for n in compiled.nodes.values())


# ---------------------------------------------------------------------------
# Program.validate_for_cluster()


def test_cluster_slice_larger_than_any_worker() -> None:
    # A slice that may shrink onto one worker is placed on one: too large a one is refused.
    prog = Program("p", steps=1)
    prog.slice("small", devices=1)
    prog.slice("big", devices=(2, 4))
    with pytest.raises(ProgramError, match=_m(
        "slice 'big' needs 4 devices but a worker has 2; use --devices-per-worker"
    )):
        prog.validate_for_cluster(workers=8, devices_per_worker=2)


def test_cluster_fixed_slice_larger_than_any_worker_is_a_gang_of_equal_shares() -> None:
    prog = Program("p", steps=1)
    prog.slice("small", devices=1)
    prog.slice("big", devices=4)
    prog.validate_for_cluster(workers=3, devices_per_worker=2)  # big on two workers, small on the third
    with pytest.raises(ProgramError, match=r"slice 'small' \(1 devices\) finds no worker with room"):
        prog.validate_for_cluster(workers=2, devices_per_worker=2)
    odd = Program("q", steps=1)
    odd.slice("odd", devices=5)  # no two workers of 2 share 5 equally: five members of one device
    odd.validate_for_cluster(workers=5, devices_per_worker=2)
    with pytest.raises(ProgramError, match=r"slice 'odd' \(5 devices\) finds no worker with room"):
        odd.validate_for_cluster(workers=4, devices_per_worker=2)


def test_cluster_job_larger_than_cluster() -> None:
    prog = Program("p", steps=1)
    for name in ("a", "b", "c"):
        prog.slice(name, devices=1)
    with pytest.raises(ProgramError, match=r"does not fit the cluster: slice 'c' \(1 devices\).*--workers") as info:
        prog.validate_for_cluster(workers=1, devices_per_worker=2)
    assert "3 devices in all, 1 workers x 2" in str(info.value)


def test_cluster_job_larger_than_cluster_by_fragmentation() -> None:
    # 6 devices on 2 workers x 3: enough in total, but a slice cannot span workers.
    prog = Program("p", steps=1)
    for name in ("a", "b", "c"):
        prog.slice(name, devices=2)
    with pytest.raises(ProgramError, match=r"slice '\w' \(2 devices\) finds no worker with room.*--workers"):
        prog.validate_for_cluster(workers=2, devices_per_worker=3)


def test_cluster_two_slices_packed_onto_one_worker() -> None:
    prog = Program("p", steps=1)
    prog.slice("a", devices=1)
    prog.slice("b", devices=1)
    prog.validate_for_cluster(workers=1, devices_per_worker=2)


def test_cluster_first_fit_largest_first() -> None:
    prog = Program("p", steps=1)
    prog.slice("one", devices=1)
    prog.slice("two", devices=2)
    prog.slice("other", devices=1)
    prog.validate_for_cluster(workers=2, devices_per_worker=2)


# ---------------------------------------------------------------------------
# The examples


@pytest.mark.parametrize("name", ["pipeline_mlp", "rl_loop", "data_parallel"])
def test_examples_validate_and_compile(name: str) -> None:
    prog = _example(name).build(steps=2)
    assert prog.steps == 2
    prog.validate()
    compiled = compile_program(prog)
    assert set(compiled.order) == set(prog.nodes)
    assert set(compiled.states) == set(prog.states)
    biggest = max(s.devices for s in prog.slices.values())
    prog.validate_for_cluster(workers=len(prog.slices), devices_per_worker=biggest)


# ---------------------------------------------------------------------------
# Job files


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.py"
    with pytest.raises(ProgramError, match=_m(f"job file {str(path)!r} not found")):
        load_program(path)


def test_load_file_raising_on_import(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('the data bucket is gone')\n")
    with pytest.raises(ProgramError, match=_m(
        f"job file {str(path)!r} failed to import: RuntimeError: the data bucket is gone"
    )):
        load_program(path)


def test_load_file_with_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "syntax.py"
    path.write_text("def build(:\n")
    with pytest.raises(ProgramError, match=_m(f"job file {str(path)!r} failed to import: SyntaxError")):
        load_program(path)


def test_load_file_raising_program_error_at_declaration(tmp_path: Path) -> None:
    path = tmp_path / "bad_slice.py"
    path.write_text("from rallypoint.client import Program\nprogram = Program('j', steps=1)\nprogram.slice('s', devices=0)\n")
    with pytest.raises(ProgramError, match=_m("failed to import: ProgramError: slice 's': devices must be")):
        load_program(path)


@pytest.mark.parametrize("body", ["x = 1\n", "program = 3\n", "build = 5\n"])
def test_load_file_without_program(tmp_path: Path, body: str) -> None:
    path = tmp_path / "empty.py"
    path.write_text(body)
    with pytest.raises(ProgramError, match=_m(f"job file {str(path)!r} defines no Program: assign one to `program`")):
        load_program(path)


JOB = """\
import jax.numpy as jnp
from rallypoint.client import Program


def build(steps=7):
    prog = Program("job-from-file", steps=steps)
    s = prog.slice("s")
    prog.source("data", lambda step, mb: jnp.ones(3), slice=s, per="step")
    return prog
"""


def test_load_build_fallback(tmp_path: Path) -> None:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    prog = load_program(path)
    assert isinstance(prog, Program)
    assert prog.name == "job-from-file" and prog.steps == 7
    prog.validate()


def test_load_module_level_program_wins_over_build(tmp_path: Path) -> None:
    path = tmp_path / "job-two.py"
    path.write_text(JOB + "\nprogram = build(steps=4)\n")
    assert load_program(path).steps == 4


def test_load_steps_override(tmp_path: Path) -> None:
    path = tmp_path / "job.py"
    path.write_text(JOB + "\nprogram = build()\n")
    prog = load_program(path, steps=3)
    assert prog.steps == 3


@pytest.mark.parametrize("steps", [0, -1])
def test_load_steps_must_be_positive(tmp_path: Path, steps: int) -> None:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    with pytest.raises(ProgramError, match=_m(f"--steps must be a positive integer, got {steps}")):
        load_program(path, steps=steps)


def test_load_example_file() -> None:
    prog = load_program(EXAMPLES / "rl_loop.py", steps=2)
    assert prog.name == "rl-loop" and prog.steps == 2


def test_shardings_naming_nothing_and_boolean_counts_are_refused() -> None:
    from jax.sharding import PartitionSpec

    prog = Program("p", steps=1)
    s = prog.slice("s")
    with pytest.raises(ProgramError, match="shardings names 'typo'"):
        prog.source("src", lambda step, mb: step, slice=s, shardings={"typo": PartitionSpec()})
    with pytest.raises(ProgramError, match="steps must be a positive integer"):
        Program("q", steps=True)
    prog.metric("m", prog.source("src2", lambda step, mb: step, slice=s).ref)
    with pytest.raises(ProgramError, match="metric 'm' is already declared"):
        prog.metric("m", Ref("src2", "out"))

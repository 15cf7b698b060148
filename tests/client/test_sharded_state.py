"""Sharded state at compile: a state's layout resolved per leaf, kept by its init and by the nodes that read and
update it, and a layout the slice cannot keep refused at submit naming the state, the leaf, the axis and the count.

On this process's CPU devices (tests/conftest.py gives it 8), an init exported with a sharded layout makes each
device hold only its shards: a state of N bytes sharded over 4 devices takes about N/4 per device.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rallypoint.client.compile import compile_program, ensure_host_devices, slice_mesh
from rallypoint.client.program import Program, ProgramError
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.workers.programs import load_exported
from tests.examples import example
from tests.helpers.sharding import per_device_bytes

ensure_host_devices(4)
fsdp = example("fsdp")



def _one_state(sharding: Any = None, *, init: Any = None, devices: Any = 4, axes: tuple[str, ...] = ("data",),
               shape: tuple[int, ...] | None = None, axis_rules: Any = None) -> Program:
    prog = Program("p", steps=2)
    s = prog.slice("s", devices=devices, mesh_axes=axes, mesh_shape=shape)
    st = prog.state("w", slice=s, init=init or (lambda: {"a": jnp.ones((8, 12)), "b": jnp.zeros((12,))}),
                    sharding=sharding, axis_rules=axis_rules)
    prog.node("u", lambda w: jax.tree_util.tree_map(lambda x: x * 2 + 1, w), slice=s, inputs={"w": st},
              outputs=("w",), updates={"w": st})
    return prog


def _specs(prog: Program) -> tuple[Any, ...]:
    return compile_program(prog).states["w"].specs


def test_a_declared_layout_is_kept_by_the_init_and_by_the_node_that_reads_and_updates_the_state() -> None:
    compiled = compile_program(fsdp.build())
    assert compiled.states["params"].specs == (P(None, "data"), P("data"))
    assert compiled.states["params"].sharded and compiled.states["opt_state"].sharded
    node = jax.export.deserialize(bytearray(compiled.nodes["train"].exported))
    mesh = slice_mesh(compiled.program, "dp")
    ins = [s.spec for s in node.in_shardings_jax(mesh)]
    outs = [s.spec for s in node.out_shardings_jax(mesh)]
    assert ins[:2] == [P(None, "data"), P("data")] and outs[:2] == [P(None, "data"), P("data")]
    replicated = compile_program(fsdp.build(sharded=False))
    assert not replicated.states["params"].sharded


def test_a_sharded_init_holds_a_quarter_of_the_state_per_device_where_a_replicated_one_holds_all_of_it() -> None:
    sharded, replicated = compile_program(fsdp.build()), compile_program(fsdp.build(sharded=False))
    mesh = slice_mesh(sharded.program, "dp")
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(sharded.states["params"].aval))
    split = per_device_bytes(load_exported(sharded.states["params"].exported_init, mesh)())
    whole = per_device_bytes(load_exported(replicated.states["params"].exported_init, mesh)())
    assert len(split) == len(whole) == 4
    assert set(split.values()) == {total // 4} and set(whole.values()) == {total}
    # XLA's own account of the init's output per device (its tuple of buffers adds a few bytes of pointers)
    analysis = []
    for compiled in (sharded, replicated):
        init = jax.export.deserialize(bytearray(compiled.states["params"].exported_init))
        analysis.append(jax.jit(init.call, out_shardings=init.out_shardings_jax(mesh)).lower().compile()
                        .memory_analysis())
    if analysis[0] is not None:  # memory_analysis is not given on every backend
        split_out, whole_out = (a.output_size_in_bytes for a in analysis)
        assert total // 4 <= split_out < total // 4 + 64 and total <= whole_out < total + 64


def test_a_sharded_run_in_process_matches_the_replicated_one_to_the_tolerance_of_another_reduction_order() -> None:
    a = ReferenceExecutor(compile_program(fsdp.build(steps=4))).run()
    b = ReferenceExecutor(compile_program(fsdp.build(steps=4, sharded=False))).run()
    for x, y in zip(jax.tree_util.tree_leaves(a.states), jax.tree_util.tree_leaves(b.states), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_the_layout_is_declared_as_one_spec_a_tree_a_prefix_or_a_function_of_the_abstract_state() -> None:
    assert _specs(_one_state(P("data"))) == (P("data"), P("data"))
    assert _specs(_one_state({"a": P(None, "data"), "b": None})) == (P(None, "data"), P())
    assert _specs(_one_state(lambda abstract: {k: P("data") for k in abstract})) == (P("data"), P("data"))
    nested = lambda: {"m": {"a": jnp.ones((8, 4)), "b": jnp.ones((4,))}, "n": jnp.ones((4,))}  # noqa: E731
    assert _specs(_one_state({"m": P("data"), "n": P()}, init=nested)) == (P("data"), P("data"), P())
    rules = [("embed", "data"), ("mlp", None)]
    assert _specs(_one_state({"a": P("mlp", "embed"), "b": P("embed")}, axis_rules=rules)) == (P(None, "data"),
                                                                                                P("data"))


def test_without_a_declaration_the_layout_is_the_one_init_gives_its_result_and_the_slices_mesh_is_set_for_it() -> None:
    def constrained() -> Any:  # bare PartitionSpecs name the slice's mesh, set while init is traced
        return {"a": jax.lax.with_sharding_constraint(jnp.ones((8, 12)), P("data")), "b": jnp.zeros((12,))}

    assert _specs(_one_state(init=constrained)) == (P("data"), P())
    assert _specs(_one_state()) == (P(), P())


def test_flax_nnx_variables_with_sharding_annotations_keep_them_as_in_plain_flax() -> None:
    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.up = nnx.Linear(8, 16, kernel_init=init, use_bias=False, rngs=rngs)

    def init() -> Any:
        return nnx.to_pure_dict(nnx.state(Model(nnx.Rngs(0)), nnx.Param))

    prog = _one_state(init=init, devices=8, axes=("data", "model"), shape=(2, 4))
    compiled = compile_program(prog)
    assert compiled.states["w"].specs == (P(None, "model"),)
    mesh = slice_mesh(prog, "s")
    with jax.set_mesh(mesh):  # plain Flax, the same model under jit on the same mesh
        plain = jax.jit(init)()
    ours = load_exported(compiled.states["w"].exported_init, mesh)()
    assert per_device_bytes(ours) == per_device_bytes(plain) and set(per_device_bytes(ours).values()) == {8 * 16}
    assert isinstance(plain["up"]["kernel"].sharding, NamedSharding)


@pytest.mark.parametrize(("sharding", "devices", "message"), [
    (P("model"), 4, "state 'w', leaf ['a'] float32[8, 12]: its spec P('model',) names axis 'model', "
                    "which the slice's mesh lacks (its axes: ('data',))"),
    ({"a": P("data")}, 4, "state 'w': its sharding tree has no spec for leaf ['b']"),
    ({"a": P("data"), "b": P(), "c": P()}, 4, "state 'w': its sharding tree names ['c'], which is no leaf or subtree"),
    ({"a": P(None, None, "data"), "b": P()}, 4, "its spec P(None, None, 'data') has 3 entries but the "
                                                "leaf has 2 dimensions"),
    ({"a": P("data", "data"), "b": P()}, 4, "uses axis 'data' twice"),
    ({"a": P(None, "data"), "b": P()}, 8, "state 'w', leaf ['a'] float32[8, 12]: dimension 1 (12) does not "
                                          "divide over axis 'data' (8 ways) on 8 devices (mesh (8,)); make it a "
                                          "multiple of 8"),
    ({"a": P("data"), "b": P()}, (2, 4), None),  # 8 divides over 4 and 2: accepted
    ({"a": P("data"), "b": P()}, (3, 6), "leaf ['a'] float32[8, 12]: dimension 0 (8) does not divide over axis "
                                         "'data' (6 ways) on 6 devices (mesh (6,))"),
    ({"a": "data", "b": P()}, 4, "sharding must hold PartitionSpecs (or None), but ['a'] is str"),
])
def test_a_layout_the_slice_cannot_keep_is_refused_at_submit_naming_the_state_the_leaf_and_what_to_change(
    sharding: Any, devices: Any, message: str | None,
) -> None:
    prog = _one_state(sharding, devices=devices)
    if message is None:
        compile_program(prog)
        return
    with pytest.raises(ProgramError, match=re.escape(message)):
        compile_program(prog)


def test_a_node_on_another_slice_reading_a_sharded_state_must_declare_how_it_lies_there() -> None:
    def build(shardings: Any) -> Program:
        prog = Program("p", steps=2)
        a, b = prog.slice("a", devices=4, mesh_axes=("data",)), prog.slice("b", devices=2, mesh_axes=("data",))
        st = prog.state("w", slice=a, init=lambda: jnp.ones((8,)), sharding=P("data"))
        prog.node("u", lambda w: w + 1, slice=a, inputs={"w": st}, outputs=("w",), updates={"w": st})
        prog.node("eval", lambda w: jnp.sum(w), slice=b, inputs={"w": st}, outputs=("s",), shardings=shardings)
        return prog

    with pytest.raises(ProgramError, match=re.escape("node 'eval' on slice 'b' reads state 'w', which is sharded "
                                                     "over slice 'a': declare how it lies on 'b'")):
        compile_program(build(None))
    compiled = compile_program(build({"w": P("data")}))
    assert compiled.nodes["eval"].name == "eval"


def test_a_sharding_function_that_fails_is_reported_against_the_state() -> None:
    def broken(abstract: Any) -> Any:
        raise KeyError("params")

    with pytest.raises(ProgramError, match=re.escape("state 'w': its sharding function failed on the abstract "
                                                     "state: KeyError: 'params'")):
        compile_program(_one_state(broken))


def test_logical_axis_names_on_nnx_variables_are_laid_out_by_the_jobs_axis_rules_alone() -> None:
    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (8, 16)), out_sharding=("embed", "mlp"))
            self.b = nnx.Param(jnp.zeros((16,)), out_sharding=("mlp",))

    def init() -> Any:  # Flax's eager sharding maps the names with the rules the job gives (no mesh, no rules here)
        return nnx.to_pure_dict(nnx.state(Model(nnx.Rngs(0)), nnx.Param))

    def train_step(state: Any, batch: Any) -> Any:
        return jax.tree_util.tree_map(lambda p: p - 0.1 * jnp.mean(batch["x"]), state), {}

    rules = (("embed", None), ("mlp", "model"))
    prog = Program.from_step("nnx-rules", init=init, train_step=train_step, steps=2, devices=8,
                             mesh_axes=("data", "model"), mesh_shape=(2, 4), host_source=False,
                             source=lambda step, mb: {"x": jnp.ones((8, 8)) * step}, axis_rules=rules)
    assert compile_program(prog).states["state"].specs == (P("model"), P(None, "model"))


@pytest.mark.parametrize("rules", ["embed", [("embed",)], [("embed", 3)], {"embed": "data"}])
def test_axis_rules_that_are_not_name_pairs_are_refused_before_anything_is_traced(rules: Any) -> None:
    traced: list[int] = []

    def init() -> Any:
        traced.append(1)
        return jnp.ones((8,))

    with pytest.raises(ProgramError, match=re.escape("state 'w': axis_rules must be a sequence of (logical name, "
                                                     "mesh axis or None) pairs")):
        compile_program(_one_state(P("data"), init=init, axis_rules=rules))
    assert not traced


def test_a_final_state_comes_back_laid_out_as_it_was_and_a_bad_final_state_option_is_refused_before_submitting(
) -> None:
    from rallypoint.client.submission import _laid_out, submit

    compiled = compile_program(fsdp.build(steps=2))
    host = {name: jax.tree_util.tree_map(np.asarray, ReferenceExecutor(compiled).initial_state()[name])
            for name in compiled.states}
    laid = _laid_out(compiled, host)
    assert laid["params"]["w1"].sharding.spec == P(None, "data")
    assert set(per_device_bytes(laid["params"]).values()) == {(16 * 64 + 64) * 4 // 4}
    np.testing.assert_array_equal(np.asarray(laid["params"]["w1"]), host["params"]["w1"])
    replicated = compile_program(fsdp.build(steps=2, sharded=False))
    assert _laid_out(replicated, host)["params"] is host["params"]  # a replicated state stays host arrays
    with pytest.raises(ValueError, match="final_state must be 'sharded' or 'host', got 'gathered'"):
        submit(compiled, endpoints=["127.0.0.1:1"], cluster="c", final_state="gathered")

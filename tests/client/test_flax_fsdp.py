"""examples/flax_fsdp.py: an NNX model with logical sharding annotations, sharded by from_step as plain Flax shards it.

On the slice's 8 CPU devices (a ``(2, 4)`` mesh over ``("data", "model")``) the exported init must
lay every leaf out as plain Flax does for the same model under ``jax.jit`` on the same mesh with
the same logical axis rules (each device holding the same bytes), and the exported step must take
and return the state with those shardings. Layouts the slice cannot keep are refused at submit,
by ``compile_program`` and by ``rallypoint run``, naming the state, the leaf and the axis or count.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from click.testing import CliRunner
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rallypoint.client import Program, ProgramError
from rallypoint.client.commands.main import main
from rallypoint.client.compile import compile_program, slice_mesh
from rallypoint.client.reference import run_reference, state_digest, to_host
from rallypoint.workers.programs import load_exported
from tests.examples import EXAMPLES, example
from tests.helpers.sharding import per_device_bytes

ex = example("flax_fsdp")
make_batch = ex.make_batch  # the host source, found by its module-level name in the file that builds the program


def plain_flax(mesh: Any) -> list[Any]:
    """The same model's parameters and Adam state as plain Flax makes them, jitted under the mesh and the logical
    axis rules: each variable sharded as it is made, Adam's moments by ``nnx.Optimizer`` after the parameters'
    annotations (as Flax's own examples/nnx_toy_examples/10_fsdp_and_optimizer.py does); in the state's leaf order."""

    @jax.jit
    def create() -> Any:
        model = ex.MLP(nnx.Rngs(ex.SEED))
        opt = nnx.Optimizer(model, ex.optimizer, wrt=nnx.Param)
        return {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                "opt_state": nnx.to_pure_dict(nnx.state(opt))["opt_state"]}  # not its own step counter

    with jax.set_mesh(mesh), nnx.logical_axis_rules(ex.AXIS_RULES):
        return jax.tree_util.tree_leaves(create())


def init_sharding_itself() -> Any:
    """init laying its result out itself: Flax's rules set inside it (each variable sharded as it is made) and
    Adam's moments constrained like the parameters (XLA leaves them replicated on their own)."""
    with nnx.logical_axis_rules(ex.AXIS_RULES):
        model = ex.MLP(nnx.Rngs(ex.SEED))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))  # mesh axes: rules applied
    opt_state = optax.tree_map_params(ex.optimizer, jax.lax.with_sharding_constraint, ex.optimizer.init(params), specs)
    return {"params": params, "opt_state": opt_state}


@pytest.mark.parametrize("declared", ["state_sharding", "init"])
def test_the_state_is_born_and_stepped_sharded_as_plain_flax_shards_it(declared: str) -> None:
    if declared == "state_sharding":  # the example: its annotations and axis_rules given to from_step
        prog = ex.build(steps=2)
    else:  # no layout declared: init's own, as XLA lays out its outputs
        prog = Program.from_step("flax-fsdp-own", init=init_sharding_itself, train_step=ex.train_step,
                                 source=make_batch, steps=2, devices=8, mesh_axes=ex.MESH_AXES,
                                 mesh_shape=ex.MESH_SHAPE)
    compiled = compile_program(prog)
    mesh = slice_mesh(prog, "main")
    born = list(load_exported(compiled.states["state"].exported_init, mesh)())
    plain = plain_flax(mesh)

    assert [(a.shape, a.dtype) for a in born] == [(a.shape, a.dtype) for a in plain]
    total = sum(leaf.nbytes for leaf in plain)
    assert per_device_bytes(born) == per_device_bytes(plain)
    assert set(per_device_bytes(born).values()) == {(total - 4) // 4 + 4}  # a quarter of each array, and Adam's count
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(compiled.states["state"].aval)[0]]
    for path, got, want in zip(paths, born, plain, strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (path, got.sharding, want.sharding)

    step = jax.export.deserialize(compiled.nodes["step"].exported)
    n = len(born)  # the step's first input and first output are the state's leaves, in leaf order
    for which, shardings in (("in", step.in_shardings_jax(mesh)), ("out", step.out_shardings_jax(mesh))):
        for path, got, want in zip(paths, shardings[:n], plain, strict=True):
            assert got.is_equivalent_to(want.sharding, want.ndim), (which, path, got, want.sharding)
    for name in ("w1", "b1", "w2"):  # the parameters split four ways over "model", in and out
        i = paths.index(f"['params']['{name}']")
        assert not step.in_shardings_jax(mesh)[i].is_fully_replicated
        assert not step.out_shardings_jax(mesh)[i].is_fully_replicated


def params_only(state: Any) -> Any:
    """A spec tree for the parameters alone, as if it were the whole train state's."""
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(ex.abstract, nnx.Param)))


BAD = {
    "an axis the mesh lacks (axis_rules left out)": (
        {"axis_rules": None},
        ["state 'state'", "leaf ['opt_state'][0].mu['b1'] float32[64]", "names axis 'mlp'",
         "its axes: ('data', 'model')", "axis_rules"]),
    "a spec tree unlike the state's": (
        {"sharding": params_only},
        ["state 'state'", "no spec for leaf ['opt_state'][0].count", "the whole state"]),
    "a dimension that does not divide": (
        {"axis_rules": (("embed", "model"), ("mlp", None))},
        ["state 'state'", "leaf ['opt_state'][0].mu['w2'] float32[64, 1]", "dimension 1 (1)",
         "axis 'model' (4 ways) on 8 devices (mesh (2, 4))"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_layout_the_slice_cannot_keep_is_refused_at_compile_naming_the_state_the_leaf_and_the_axis(
        case: str) -> None:
    options, parts = BAD[case]
    with pytest.raises(ProgramError) as err:
        compile_program(ex.build(steps=2, **options))
    for part in parts:
        assert part in str(err.value), (part, str(err.value))


JOB_TAIL = """

def params_only(state):  # the parameters' specs alone, as if they were the whole train state's
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract, nnx.Param)))


program = build({args})
"""
"""The example's job file made bad: what `rallypoint run` is given."""


@pytest.mark.parametrize("case", list(BAD))
def test_rallypoint_run_refuses_such_a_job_file_with_the_message_and_writes_nothing(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options, parts = BAD[case]
    job = tmp_path / "job" / "flax_fsdp_bad.py"
    job.parent.mkdir()
    args = ", ".join(f"{k}={v.__name__ if callable(v) else repr(v)}" for k, v in options.items())
    job.write_text((EXAMPLES / "flax_fsdp.py").read_text() + JOB_TAIL.format(args=args))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where an embedded cluster would keep its state
    r = CliRunner().invoke(main, ["run", str(job)])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    for part in parts:
        assert part in r.output, (part, r.output)
    assert list(scratch.iterdir()) == [] and sorted(p.name for p in job.parent.iterdir()) == [job.name]


def test_the_reference_ends_bitwise_where_the_plain_sharded_flax_loop_ends() -> None:
    prog = ex.build(steps=12)
    result = run_reference(prog)
    mesh = slice_mesh(prog, "main")  # the plain loop of `python examples/flax_fsdp.py`, on the same devices
    layout = nn.logical_to_mesh_sharding(ex.state_sharding(jax.eval_shape(ex.init)), mesh, ex.AXIS_RULES)
    state, losses = jax.jit(ex.init, out_shardings=layout)(), []
    for step in range(prog.steps):
        batch = jax.device_put(make_batch(step, 0), NamedSharding(mesh, PartitionSpec("data")))
        state, metrics = ex.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert per_device_bytes(jax.tree_util.tree_leaves(state)) == per_device_bytes(list(load_exported(
        compile_program(prog).states["state"].exported_init, mesh)()))  # still laid out as born
    assert [m["loss"] for m in result.metrics] == losses and losses[-1] < losses[0] / 2
    assert result.state_digest == state_digest({"state": to_host(state)})
    for got, want in zip(jax.tree_util.tree_leaves(result.states["state"]), jax.tree_util.tree_leaves(state),
                         strict=True):
        assert np.array_equal(got, np.asarray(want))

"""``init_from=PATH``: a state starts from a plain Orbax checkpoint (pretrained weights) instead of its init.

At submit (the client's compile, no cluster) the checkpoint is found (a StandardCheckpointer directory, a
CheckpointManager step directory or the manager's newest step), matched to init's abstract value leaf by leaf
and refused in one line naming each leaf at fault; the reference starts from its bytes; a worker's load reads
the same bytes onto the state's sharded layout and refuses others. The cluster run through a kill before the
first cut is tests/integration/test_init_from.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from click.testing import CliRunner
from jax.sharding import PartitionSpec as P

from rallypoint.client.commands.main import main
from rallypoint.client.compile import compile_program, ensure_host_devices
from rallypoint.client.jobspec import job_spec
from rallypoint.client.program import Program, ProgramError
from rallypoint.client.reference import ReferenceExecutor
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.runtime.load import ProgramFailed, load_states, slice_meshes
from tests.helpers.pretrained import FEATURES, HIDDEN, init, loss_of, pretrained, regression

ensure_host_devices(4)


def _save(path: Path, tree: Any) -> Path:
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
    return path


def test_the_reference_starts_from_the_checkpoint_and_its_first_loss_is_the_pretrained_weights_loss(
        tmp_path: Path) -> None:
    weights = pretrained()
    ckpt = _save(tmp_path / "pretrained", weights)
    compiled = compile_program(regression(steps=3, init_from=ckpt))
    assert compiled.states["state"].init_from is not None and compiled.states["state"].init_from.path == str(ckpt)
    ref = ReferenceExecutor(compiled)
    first = ref.initial_state()["state"]
    for got, want in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(weights), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, np.asarray(want))  # not init's zeros: init never ran
    result = ref.run()
    assert result.metrics[0]["loss"] == float(loss_of(weights, 0))


def test_an_nnx_model_and_an_optax_state_saved_by_a_checkpoint_manager_match_and_its_newest_step_is_taken(
        tmp_path: Path) -> None:
    """A Flax NNX model's pure dict and optax's NamedTuples (saved by Orbax as dicts and lists) match the state's
    tree; a manager's directory gives its newest step, a step directory that step."""
    opt = optax.adam(1e-2)

    def make(seed: int) -> dict[str, Any]:
        params = nnx.to_pure_dict(nnx.state(nnx.Linear(3, 4, rngs=nnx.Rngs(seed))))
        return {"params": params, "opt": opt.init(params)}

    with ocp.CheckpointManager(tmp_path / "mgr") as mgr:
        for step in (1, 5):
            mgr.save(step, args=ocp.args.StandardSave(make(step)))
        mgr.wait_until_finished()
    for given, step in ((tmp_path / "mgr", 5), (tmp_path / "mgr" / "1", 1)):
        prog = Program("nnx", steps=1)
        s = prog.slice("s")
        st = prog.state("st", slice=s, init=lambda: make(0), init_from=given)
        prog.node("keep", lambda st: st, slice=s, inputs={"st": st}, outputs=("st",), updates={"st": st})
        compiled = compile_program(prog)
        assert compiled.states["st"].init_from.path == str(tmp_path / "mgr" / str(step) / "default")
        got = ReferenceExecutor(compiled).initial_state()["st"]
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(make(0))
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                        jax.tree_util.tree_leaves(make(step)), strict=True))


def test_a_path_or_tree_that_does_not_fit_is_refused_at_submit_in_one_line_naming_each_leaf(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    for path, said in ((tmp_path / "none", "does not exist"), (tmp_path / "a-file", "is a file"),
                       (tmp_path / "empty", "is not an Orbax checkpoint")):
        with pytest.raises(ProgramError) as e:
            compile_program(regression(steps=1, init_from=path))
        msg = str(e.value)
        assert "\n" not in msg and f"state 'state': init_from {str(path)!r} {said}" in msg and "give" in msg, msg
    w = pretrained()["params"]
    other = {"params": {"w1": w["w1"][:, :8], "w2": w["w2"].astype(jnp.bfloat16), "extra": jnp.ones(2)}}
    with pytest.raises(ProgramError) as e:
        compile_program(regression(steps=1, init_from=_save(tmp_path / "other", other)))
    msg = str(e.value)
    assert "\n" not in msg and "does not match the state's init()" in msg, msg
    assert f"params/w1 is float32[{FEATURES}, 8] in the checkpoint, init() gives float32[{FEATURES}, {HIDDEN}]" in msg
    assert f"params/w2 is bfloat16[{HIDDEN}] in the checkpoint, init() gives float32[{HIDDEN}]" in msg
    assert "params/b is missing from the checkpoint" in msg and "params/extra is in the checkpoint but not" in msg
    with pytest.raises(ProgramError, match="init_from must be the path of an Orbax checkpoint"):
        Program("p", steps=1).state("s", slice="x", init=init, init_from=3)
    job = tmp_path / "job.py"
    job.write_text("from tests.helpers.pretrained import regression\n"
                   f"program = regression(steps=1, init_from={str(tmp_path / 'other')!r})\n")
    r = CliRunner().invoke(main, ["run", "--reference", str(job)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith("error: state 'state': init_from") and "params/b is missing" in line, line


def _request(compiled: Any, devices: int) -> pb.LoadJobRequest:
    spec = job_spec(compiled)
    (sa,) = spec.slices
    return pb.LoadJobRequest(job=spec.job, steps=spec.steps, microbatches=1, states=list(spec.states),
                             slices=[pb.SliceAssignment(slice=sa.slice, devices=list(range(devices)),
                                                        mesh_shape=sa.mesh_shape, mesh_axes=sa.mesh_axes)])


def test_a_worker_loads_the_checkpoint_onto_the_sharded_layout_and_refuses_bytes_changed_since_submit(
        tmp_path: Path) -> None:
    """The worker's own load (workers/runtime/load.py, at step 0 as after a loss before the first cut): the
    pretrained leaves land split over the slice's 4 devices as the state's layout says, and a checkpoint whose
    bytes are not those checksummed at submit fails the load as the program's fault."""
    weights = pretrained()
    ckpt = _save(tmp_path / "pretrained", weights)
    compiled = compile_program(regression(steps=2, devices=4, init_from=ckpt,
                                          sharding={"params": {"w1": P(None, "data"), "w2": P("data"), "b": P()}}))
    assert compiled.states["state"].sharded
    req = _request(compiled, 4)
    mesh_of = slice_meshes(req, jax.devices(), "w0")
    (st,) = load_states(req, mesh_of, {}, lambda s: [], {}, "w0").values()
    leaves = st.at(0)
    w1, w2 = leaves[1], leaves[2]  # leaf order: params/b, params/w1, params/w2
    assert w1.sharding.spec == P(None, "data") and {s.data.shape for s in w1.addressable_shards} == {
        (FEATURES, HIDDEN // 4)}
    assert w2.sharding.spec == P("data") and np.array_equal(np.asarray(w2), np.asarray(weights["params"]["w2"]))
    _save(tmp_path / "changed", jax.tree_util.tree_map(lambda a: a + 1, weights))
    req.states[0].init_from.path = str(tmp_path / "changed")
    with pytest.raises(ProgramFailed, match="holds other bytes than at submit"):
        load_states(req, slice_meshes(req, jax.devices(), "w0"), {}, lambda s: [], {}, "w0")

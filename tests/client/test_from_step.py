"""Program.from_step: the user's own train_step, unchanged, as a one-slice program.

The reference run of the program it builds must end in bitwise the state a plain Python loop
reaches calling the same step on the same batches (a host source and a JAX source), and the
Flax example's step must train under it as it does on its own.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from rallypoint.client import Program, ProgramError
from rallypoint.client.compile import compile_program
from rallypoint.client.program import Ref, StateRef
from rallypoint.client.reference import run_reference, state_digest, to_host
from tests.examples import example

FEATURES, BATCH = 4, 8
optimizer = optax.adam(0.05)
TRUE_W = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)


def init() -> dict[str, Any]:
    params = {"w": jnp.zeros((FEATURES,)), "b": jnp.zeros(())}
    return {"params": params, "opt_state": optimizer.init(params)}


def train_step(state: dict[str, Any], batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    def loss_fn(p: dict[str, Any]) -> jax.Array:
        return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state},
            {"loss": loss, "train/grad_norm": optax.tree.norm(grads)})


def host_batch(step: int, microbatch: int) -> dict[str, np.ndarray]:  # a host source: module-level, NumPy
    x = np.random.default_rng([7, step]).normal(size=(BATCH, FEATURES)).astype(np.float32)
    return {"x": x, "y": x @ TRUE_W + np.float32(0.5)}


def jax_batch(step: jax.Array, microbatch: jax.Array) -> dict[str, jax.Array]:
    x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(7), step), (BATCH, FEATURES))
    return {"x": x, "y": x @ TRUE_W + 0.5}


def build(source: Any = host_batch, **options: Any) -> Program:
    kwargs = {"init": init, "train_step": train_step, "source": source, "steps": 6, **options}
    return Program.from_step("from-step", **kwargs)


def _m(text: str) -> str:
    return re.escape(text)


def test_from_step_builds_one_slice_one_state_the_source_one_node_and_metrics_by_name() -> None:
    prog = build(devices=(1, 2), checkpoint_every=3)
    assert (prog.name, prog.steps, prog.microbatches, prog.checkpoint_every) == ("from-step", 6, 1, 3)
    (sl,) = prog.slices.values()
    assert (sl.name, sl.devices, sl.min_devices, sl.mesh_axes) == ("main", 2, 1, ("data",))
    (st,) = prog.states.values()
    assert (st.name, st.slice, st.init) == ("state", "main", init)
    assert list(prog.nodes) == ["batch", "step"]
    src, step = prog.nodes["batch"], prog.nodes["step"]
    assert (src.is_source, src.host, src.fn, src.per, src.outputs) == (True, True, host_batch, "step", ("x", "y"))
    assert src.shardings == {"x": P("data"), "y": P("data")}
    assert step.per == "step" and not step.is_source
    assert step.inputs == {"state": StateRef("state", "main"), "batch.x": Ref("batch", "x"), "batch.y": Ref("batch", "y")}
    assert step.outputs == ("state", "loss", "train_grad_norm")  # a metric's name made a valid output name
    assert step.updates == {"state": "state"}
    assert step.shardings == {"batch.x": P("data"), "batch.y": P("data")}
    assert prog.metrics == {"loss": Ref("step", "loss"), "train/grad_norm": Ref("step", "train_grad_norm")}
    prog.validate()


def test_batch_sharding_one_spec_for_all_keys_or_per_key() -> None:
    assert build(batch_sharding=P()).nodes["batch"].shardings == {"x": P(), "y": P()}
    per_key = build(batch_sharding={"y": P()}).nodes["step"].shardings
    assert per_key == {"batch.x": P("data"), "batch.y": P()}


@pytest.mark.parametrize("kind", ["host", "jax"])
def test_the_reference_ends_bitwise_where_a_plain_loop_over_the_same_step_ends(kind: str) -> None:
    source = host_batch if kind == "host" else jax_batch
    result = run_reference(build(source, host_source=kind == "host"))
    state, make = jax.jit(init)(), (host_batch if kind == "host" else jax.jit(jax_batch))
    step_fn, losses = jax.jit(train_step), []
    for step in range(6):  # what the team ran before: the same step on the same batches
        state, metrics = step_fn(state, make(np.int32(step), np.int32(0)))
        losses.append(float(metrics["loss"]))
    assert result.state_digest == state_digest({"state": to_host(state)})
    for got, want in zip(jax.tree_util.tree_leaves(result.states["state"]), jax.tree_util.tree_leaves(state),
                         strict=True):
        assert np.array_equal(got, np.asarray(want))
    assert [m["loss"] for m in result.metrics] == losses
    assert losses[-1] < losses[0]


def test_a_host_source_is_found_by_its_name_in_the_file_that_called_from_step() -> None:
    compiled = compile_program(build())
    assert compiled.nodes["batch"].host == (__file__, "host_batch")


def test_a_host_source_not_at_the_top_level_of_the_job_file_is_refused_naming_it() -> None:
    def local_batch(step: int, microbatch: int) -> dict[str, np.ndarray]:
        return host_batch(step, microbatch)

    with pytest.raises(ProgramError, match=_m("host source 'batch': its function must be reachable by a "
                                              "module-level name of the job file")):
        compile_program(build(local_batch))


def _metrics_scalar(state: Any, batch: Any) -> Any:
    return train_step(state, batch)[0], train_step(state, batch)[1]["loss"]


def _metrics_vector(state: Any, batch: Any) -> Any:
    new, _ = train_step(state, batch)
    return new, {"loss": jnp.mean(batch["y"]), "per_example": batch["y"]}


def _three(state: Any, batch: Any) -> Any:
    return (*train_step(state, batch), 1)


def _dict_only(state: Any, batch: Any) -> Any:
    return train_step(state, batch)[0]


def _new_shape(state: Any, batch: Any) -> Any:
    new, metrics = train_step(state, batch)
    return {**new, "params": {**new["params"], "w": jnp.zeros((FEATURES + 1,))}}, metrics


def _raises(state: Any, batch: Any) -> Any:
    raise ValueError("boom")


def _bad_key_batch(step: int, microbatch: int) -> dict[str, np.ndarray]:
    return {"x y": np.zeros((2,), np.float32)}


def _failing_batch(step: int, microbatch: int) -> dict[str, np.ndarray]:
    raise OSError("no such file: data.bin")


@pytest.mark.parametrize("options,message", [
    ({"train_step": 3}, "Program.from_step 'from-step': train_step must be callable, got 3"),
    ({"init": None}, "Program.from_step 'from-step': init must be callable, got None"),
    ({"source": "data.bin"}, "Program.from_step 'from-step': source must be callable, got 'data.bin'"),
    ({"train_step": _dict_only}, "train_step must return a pair (new_state, metrics), got dict"),
    ({"train_step": _three}, "train_step must return a pair (new_state, metrics), got a tuple of 3"),
    ({"train_step": _metrics_scalar}, "train_step's metrics must be a dict of scalars (name -> value), got float32[]"),
    ({"train_step": _metrics_vector}, "metric 'per_example' of train_step is float32[8]; a metric must be a scalar"),
    ({"train_step": _new_shape}, "train_step returns a new state unlike init()'s: ['params']['w'] is float32[5], "
                                 "init gives float32[4]"),
    ({"train_step": _raises}, "train_step(state, batch) failed to trace with"),
    ({"source": _failing_batch}, "source(0, 0) failed: OSError: no such file: data.bin"),
    ({"source": _bad_key_batch}, "invalid batch key name 'x y'"),
    ({"devices": 0}, "slice 'main': devices must be a positive integer, got 0"),
    ({"devices": (3, 2)}, "slice 'main': devices=(min, max) needs integers 1 <= min <= max, got (3, 2)"),
    ({"mesh_axes": "data"}, "mesh_axes must be a sequence of axis names such as ('data',), got 'data'"),
    ({"host_source": "yes"}, "host_source must be True or False, got 'yes'"),
    ({"source": jax_batch, "host_source": False, "prefetch": 2}, "prefetch reads a host source ahead"),
    ({"batch_sharding": {"z": P()}}, "batch_sharding names 'z', which is not a key of the batch ['x', 'y']"),
    ({"batch_sharding": "data"}, "batch_sharding must be a PartitionSpec or a dict batch key -> PartitionSpec"),
    ({"steps": 0}, "Program 'from-step': steps must be a positive integer, got 0"),
])
def test_bad_inputs_are_refused_naming_what_is_wrong(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ProgramError, match=_m(message)):
        build(**options)


def test_the_flax_examples_own_step_trains_unchanged_under_from_step() -> None:
    mod = example("flax_step")
    prog = mod.build(steps=15)
    assert prog.nodes["step"].fn.__name__ == "train_step" and prog.nodes["batch"].fn is mod.make_batch
    assert set(prog.metrics) == {"loss", "accuracy", "eval_loss", "eval_accuracy"}
    result = run_reference(prog)
    losses = [m["loss"] for m in result.metrics]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    assert [s for s, m in enumerate(result.metrics) if "eval_loss" in m] == [0, 5, 10]
    state = mod.init()  # the same function in a plain loop: the same losses (here on one device, there on two)
    for step in range(15):
        if step % mod.EVAL_EVERY == 0:
            held = mod.eval_step(state, mod.held_out(step, 0))
            assert result.metrics[step]["eval_loss"] == pytest.approx(float(held["loss"]), rel=1e-4)
        rng = jax.random.fold_in(jax.random.key(mod.SEED), step)
        state, metrics = mod.train_step(state, mod.make_batch(step, 0), rng=rng)
        assert metrics["loss"] == pytest.approx(losses[step], rel=1e-4)

"""Flax's own styles through Program.from_step: a stateful NNX step (Program.from_nnx) and a
flax.training TrainState as the state, each run by the reference runner against a plain loop."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

from rallypoint.client import Program
from rallypoint.client.compile import compile_program
from rallypoint.client.program import ProgramError
from rallypoint.client.reference import ReferenceExecutor, run_reference

STEPS = 4


class MLP(nnx.Module):  # as Flax's toy examples write one, with dropout: its nnx.Rngs is in the state
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(3, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.out(self.drop(nnx.relu(self.hidden(x))))


def create() -> Any:
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: Any, y: Any) -> Any:
    def loss_fn(model: MLP) -> Any:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_step(model: MLP, optimizer: nnx.Optimizer, batch: Any) -> Any:
    model.eval()  # dropout off: a change to the objects that is dropped
    return {"mse": jnp.mean((model(batch["x"]) - batch["y"]) ** 2)}


def data(step: Any, microbatch: Any) -> dict[str, Any]:
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (16, 3))
    return {"x": x, "y": jnp.sum(x, axis=1, keepdims=True)}


def test_a_stateful_nnx_step_runs_unchanged_and_ends_where_a_plain_loop_ends() -> None:
    prog = Program.from_nnx("nnx", create=create, train_step=train_step, source=data, host_source=False, steps=STEPS,
                            eval_step=eval_step, eval_source=data, eval_every=2)
    ex = ReferenceExecutor(compile_program(prog))
    got = ex.run()
    model, optimizer = create()  # the same step in a plain loop
    losses = [float(train_step(model, optimizer, data(s, 0)["x"], data(s, 0)["y"])) for s in range(STEPS)]
    assert [m["loss"] for m in got.metrics] == pytest.approx(losses, rel=1e-5)
    assert [s for s, m in enumerate(got.metrics) if "eval_mse" in m] == [0, 2]
    assert isinstance(got.states["state"], nnx.State)  # the user's own tree: NNX's state of (model, optimizer)
    np.testing.assert_allclose(got.states["state"][0]["out"]["kernel"][...], model.out.kernel[...], rtol=1e-5,
                               atol=1e-6)
    half = ex.run(2)  # replay from a cut, dropout keys and all: the same bits
    assert ex.run(state=half.states, start_step=2).state_digest == got.state_digest


def test_a_flax_train_state_is_a_state_of_from_step() -> None:
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def apply_fn(p: Any, x: Any) -> Any:
        return nnx.merge(graphdef, p)(x)

    def init() -> Any:
        return train_state.TrainState.create(apply_fn=apply_fn, params=nnx.state(nnx.Linear(3, 1, rngs=nnx.Rngs(0))),
                                             tx=optax.sgd(0.1))

    @jax.jit
    def step(state: train_state.TrainState, batch: Any) -> Any:  # Flax's 03_train_state style
        def loss_fn(p: Any) -> Any:
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    prog = Program.from_step("ts", init=init, train_step=step, source=data, host_source=False, steps=STEPS)
    got = run_reference(prog)
    ts = init()
    for s in range(STEPS):
        ts, _ = step(ts, data(s, 0))
    assert int(got.states["state"].step) == STEPS
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: np.allclose(a, b, rtol=1e-6),
                                                         got.states["state"].params, ts.params))
    assert run_reference(prog).state_digest == got.state_digest


def test_an_nnx_step_whose_parameters_do_not_match_the_batch_is_refused_naming_them() -> None:
    @nnx.jit
    def odd(model: MLP, optimizer: nnx.Optimizer, inputs: Any, targets: Any) -> Any:
        return None

    with pytest.raises(ProgramError) as info:
        Program.from_nnx("odd", create=create, train_step=odd, source=data, host_source=False, steps=2)
    assert "takes the batch as ['inputs', 'targets'], but the batch's keys are ['x', 'y']" in str(info.value)

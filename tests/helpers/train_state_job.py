"""A job whose state is a Flax ``TrainState``: static ``apply_fn`` and an Optax ``tx`` in its pytree.

``python -m tests.helpers.train_state_job`` prints the digest of its in-process reference run, so a
test can compare digests made in separate processes (tests/integration/test_state_digest.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from rallypoint.client import Program

STEPS = 4


def apply(params: dict[str, Any], x: jax.Array) -> jax.Array:
    return x @ params["w"] + params["b"]


def init() -> train_state.TrainState:
    params = {"w": jnp.zeros((4,)), "b": jnp.zeros(())}
    return train_state.TrainState.create(apply_fn=apply, params=params,
                                         tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05)))


def train_step(state: train_state.TrainState, batch: dict[str, Any]) -> tuple[train_state.TrainState, dict[str, Any]]:
    def loss_fn(p: dict[str, Any]) -> jax.Array:
        return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batch(step: int, microbatch: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng([7, step]).normal(size=(8, 4)).astype(np.float32)
    return {"x": x, "y": x @ np.linspace(-1.0, 1.0, 4, dtype=np.float32)}


def build(steps: int = STEPS) -> Program:
    # checkpoint_every=2: commits at 0 and 2 (the final cut at 4 too, once every job commits one), for the export
    return Program.from_step("train-state", init=init, train_step=train_step, source=batch, steps=steps,
                             checkpoint_every=2)


if __name__ == "__main__":
    from rallypoint.client.reference import run_reference

    print(run_reference(build()).state_digest)

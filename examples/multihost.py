"""A multi-host slice: one slice of 4 devices, data parallel, on workers of 2 devices each (docs/multihost.md).

No worker holds the slice, so it runs as a gang of two workers: one member process per worker,
joined by ``jax.distributed`` (gloo on CPU), the batch sharded over all 4 devices and the
gradient all-reduced across both. Losing either member loses the slice, which a recovery
places on a new gang::

    .venv/bin/rallypoint run examples/multihost.py --devices-per-worker 2 --workers 2 --spares 2 \\
        --fail kill:dp@12
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from rallypoint.client import Program

DEVICES = 4
FEATURES, HIDDEN, BATCH = 16, 32, 64
optimizer = optax.adam(1e-2)


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.25, "w2": jax.random.normal(k2, (HIDDEN,)) * 0.25}


def make_batch(step, microbatch):
    x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(3), step), (BATCH, FEATURES))
    return {"x": x, "y": jnp.sin(x @ jnp.linspace(-1.0, 1.0, FEATURES))}


def train_step(params, opt_state, x, y):
    def loss_fn(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def build(steps: int = 30) -> Program:
    prog = Program("multihost", steps=steps, checkpoint_every=5)
    dp = prog.slice("dp", devices=DEVICES, mesh_axes=("data",))
    params = prog.state("params", slice=dp, init=init_params)
    opt_state = prog.state("opt_state", slice=dp, init=lambda: optimizer.init(init_params()))
    batch = prog.source("batch", make_batch, slice=dp, per="step", outputs=("x", "y"),
                        shardings={"x": P("data"), "y": P("data")})
    step = prog.node("train", train_step, slice=dp,
                     inputs={"params": params, "opt_state": opt_state, "x": batch["x"], "y": batch["y"]},
                     outputs=("params", "opt_state", "loss"), updates={"params": params, "opt_state": opt_state},
                     shardings={"x": P("data"), "y": P("data")})
    prog.metric("loss", step["loss"])
    return prog


program = build()

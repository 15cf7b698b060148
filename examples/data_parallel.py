"""Data parallelism on one slice: a batch sharded over the slice's devices.

One virtual slice of DEVICES devices with a "data" mesh axis (it may run on 2 after a loss
with on_no_spare="shrink", and grows back to DEVICES). The source produces a
global batch sharded along that axis; the update computes the loss and gradients on
the sharded batch (XLA inserts the cross-device reduction) and applies Adam to the
replicated parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from rallypoint.client import Program

DEVICES = 4
FEATURES, BATCH = 16, 128
optimizer = optax.adam(1e-2)


def init_params():
    return {"w": jnp.zeros((FEATURES,)), "b": jnp.zeros(())}


def make_batch(step, microbatch):
    key = jax.random.fold_in(jax.random.PRNGKey(5), step)
    x = jax.random.normal(key, (BATCH, FEATURES))
    true_w = jnp.linspace(-1.0, 1.0, FEATURES)
    return {"x": x, "y": x @ true_w + 0.5}


def train_step(params, opt_state, x, y):
    def loss_fn(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "loss": loss}


def build(steps: int = 30, devices: int | tuple[int, int] = (2, DEVICES)) -> Program:
    """``devices``: the slice's (min, max), or a fixed count (4 on workers of 2: a multi-host slice, docs/multihost.md)."""
    prog = Program("data-parallel", steps=steps, checkpoint_every=10)
    dp = prog.slice("dp", devices=devices, mesh_axes=("data",))  # may shrink to 2 devices, grows back
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

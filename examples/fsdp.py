"""FSDP on one slice: the weights and Adam's moments split over the slice's devices, not copied to each.

One slice of 4 devices with a "data" mesh axis (it may run on 2 after a loss with
``on_no_spare="shrink"`` and grows back). The batch is split over "data" as in
examples/data_parallel.py, and so is the state: ``prog.state(..., sharding=...)`` gives each
weight's layout (``w1``'s columns and ``w2`` over "data"), and Adam's moments get theirs from a
function of the abstract state (each leaf whose last dimension is the hidden width is split there;
Adam's step count stays replicated). Each device holds a quarter of the state; XLA gathers the
weights for the forward pass and reduce-scatters the gradients. A run that loses its worker is
restored shard by shard onto a spare and ends bitwise equal to the run without the loss; one that
shrinks onto 2 devices restores each leaf split over the 2-device mesh (docs/program-api.md,
"Sharded state")::

    .venv/bin/rallypoint run examples/fsdp.py --devices-per-worker 4 --fail kill:dp@12

``build(sharded=False)`` is the same job with the state replicated, for comparison.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from rallypoint.client import Program

FEATURES, HIDDEN, BATCH = 16, 64, 32
optimizer = optax.adam(1e-2)


def init_params() -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.25, "w2": jax.random.normal(k2, (HIDDEN,)) * 0.25}


PARAM_SPECS = {"w1": P(None, "data"), "w2": P("data")}


def fsdp(abstract: Any) -> Any:
    """Each leaf whose last dimension is HIDDEN split over ``data`` there; the rest (Adam's count) replicated."""
    return jax.tree_util.tree_map(
        lambda a: P(*([None] * (a.ndim - 1)), "data") if a.ndim and a.shape[-1] == HIDDEN else P(), abstract)


def make_batch(step: Any, microbatch: Any) -> dict[str, Any]:
    x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(3), step), (BATCH, FEATURES))
    return {"x": x, "y": jnp.sin(x @ jnp.linspace(-1.0, 1.0, FEATURES))}


def train_step(params: Any, opt_state: Any, x: Any, y: Any) -> dict[str, Any]:
    def loss_fn(p: Any) -> Any:
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "loss": loss}


def build(steps: int = 30, devices: int | tuple[int, int] = (2, 4), *, sharded: bool = True,
          checkpoint_every: int = 5) -> Program:
    prog = Program("fsdp" if sharded else "fsdp-replicated", steps=steps, checkpoint_every=checkpoint_every)
    dp = prog.slice("dp", devices=devices, mesh_axes=("data",))
    params = prog.state("params", slice=dp, init=init_params, sharding=PARAM_SPECS if sharded else None)
    opt_state = prog.state("opt_state", slice=dp, init=lambda: optimizer.init(init_params()),
                           sharding=fsdp if sharded else None)
    batch = prog.source("batch", make_batch, slice=dp, per="step", outputs=("x", "y"),
                        shardings={"x": P("data"), "y": P("data")})
    step = prog.node("train", train_step, slice=dp,
                     inputs={"params": params, "opt_state": opt_state, "x": batch["x"], "y": batch["y"]},
                     outputs=("params", "opt_state", "loss"), updates={"params": params, "opt_state": opt_state},
                     shardings={"x": P("data"), "y": P("data")})
    prog.metric("loss", step["loss"])
    return prog


program = build()

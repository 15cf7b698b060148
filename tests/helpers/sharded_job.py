"""A small job whose state is sharded over its slice (FSDP over the ``data`` axis), for the sharded-state tests.

Two layers of weights and Adam's moments, each leaf split over ``data`` along a dimension every device count
of the slice divides; the batch is split the same way. ``sharded=False`` is the same job with the state
replicated (the layout every state had before states could be sharded).
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


def build(steps: int = 20, devices: int | tuple[int, int] = (2, 4), *, sharded: bool = True,
          checkpoint_every: int = 5) -> Program:
    prog = Program("sharded" if sharded else "replicated", steps=steps, checkpoint_every=checkpoint_every)
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


def per_device_bytes(leaves: Any) -> dict[Any, int]:
    """Bytes each device holds of ``leaves`` (jax.Arrays), from their addressable shards."""
    held: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(leaves):
        for s in x.addressable_shards:
            held[s.device] = held.get(s.device, 0) + int(s.data.nbytes)
    return held

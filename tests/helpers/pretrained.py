"""A small regression job through ``Program.from_step`` and pretrained weights for it (``init_from``): its init
gives zeros, the pretrained weights are random, so a run that starts from them is told apart from one that ran
init; :func:`loss_of` is the loss of given weights on a step's batch, computed directly (no Rallypoint)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rallypoint.client import Program

FEATURES, HIDDEN, BATCH = 8, 16, 16
LR = 0.05


def init() -> dict[str, Any]:
    return {"params": {"w1": jnp.zeros((FEATURES, HIDDEN)), "w2": jnp.zeros((HIDDEN,)), "b": jnp.zeros(())}}


def pretrained(seed: int = 7) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"params": {"w1": jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.3,
                       "w2": jax.random.normal(k2, (HIDDEN,)) * 0.3, "b": jnp.asarray(0.5)}}


def batch(step: Any, microbatch: Any) -> dict[str, Any]:
    x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(3), step), (BATCH, FEATURES))
    return {"x": x, "y": jnp.sin(x @ jnp.linspace(-1.0, 1.0, FEATURES))}


def loss(params: Any, x: Any, y: Any) -> Any:
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b"] - y) ** 2)


def train_step(state: Any, b: Any) -> tuple[Any, dict[str, Any]]:
    value, grads = jax.value_and_grad(loss)(state["params"], b["x"], b["y"])
    params = jax.tree_util.tree_map(lambda p, g: p - LR * g, state["params"], grads)
    return {"params": params}, {"loss": value}


def loss_of(weights: Any, step: int, *, devices: int = 1, specs: Any = None) -> Any:
    """The loss of ``weights`` on step ``step``'s batch, computed directly: on one device, or (``specs``) as the
    job lays them out over ``devices`` devices along ``data``, the batch split there too (the same reduction
    order as the job's, so the same bits)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    b = batch(jnp.int32(step), jnp.int32(0))
    params, x, y = weights["params"], b["x"], b["y"]
    if specs is not None:
        mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
        params = jax.tree_util.tree_map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params,
                                        specs["params"])
        x, y = (jax.device_put(a, NamedSharding(mesh, PartitionSpec("data"))) for a in (x, y))
    return jax.jit(loss)(params, x, y)


def regression(*, steps: int, devices: int = 1, init_from: Any = None, sharding: Any = None,
               name: str = "pretrained") -> Program:
    """The job (its one slice ``main``, ``devices`` devices over ``data``): the batch split over ``data``, the
    state laid out as ``sharding`` says (default replicated), started from ``init_from`` if given."""
    return Program.from_step(name, init=init, train_step=train_step, source=batch, steps=steps, devices=devices,
                             host_source=False, checkpoint_every=10, state_sharding=sharding, init_from=init_from)

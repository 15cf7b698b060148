"""A 4-stage MLP pipeline, GPipe style: microbatched forward and backward, Adam per stage.

Each stage lives on its own virtual slice with its parameters and optimizer state.
Per microbatch, activations flow forward stage to stage, the last stage computes the
loss and its gradients, and gradients flow back; per step, each stage gathers its
microbatch gradients and updates its own state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from rallypoint.client import Program, gather

STAGES = 4
WIDTH = 32
MICROBATCHES = 4
MICROBATCH_SIZE = 16
optimizer = optax.adam(1e-2)


def init_params(stage: int, width: int = WIDTH):
    def init():
        key = jax.random.PRNGKey(stage)
        return {"w": jax.random.normal(key, (width, width)) / jnp.sqrt(width), "b": jnp.zeros((width,))}
    return init


def init_opt(stage: int, width: int = WIDTH):
    return lambda: optimizer.init(init_params(stage, width)())


def apply_stage(params, x, last: bool):
    h = x @ params["w"] + params["b"]
    return h if last else jnp.tanh(h)


def batches(width: int = WIDTH, microbatch_size: int = MICROBATCH_SIZE):
    def make_batch(step, microbatch):
        """Deterministic data: a function of (step, microbatch) only."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(1234), step), microbatch)
        x = jax.random.normal(key, (microbatch_size, width))
        return {"x": x, "y": jnp.sin(2.0 * x)}
    return make_batch


def forward(params, x):
    return apply_stage(params, x, last=False)


def backward(params, x, grad_out):
    _, vjp = jax.vjp(lambda p, a: apply_stage(p, a, last=False), params, x)
    grads, grad_in = vjp(grad_out)
    return {"grads": grads, "grad_in": grad_in}


def loss_and_backward(params, x, y):
    def loss_fn(p, a):
        return jnp.mean((apply_stage(p, a, last=True) - y) ** 2)

    loss, (grads, grad_in) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, x)
    return {"loss": loss, "grads": grads, "grad_in": grad_in}


def update(params, opt_state, grads):
    mean_grads = jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), grads)
    updates, opt_state = optimizer.update(mean_grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}


def build(steps: int = 30, *, width: int = WIDTH, microbatch_size: int = MICROBATCH_SIZE,
          microbatches: int = MICROBATCHES) -> Program:
    """The pipeline; ``width`` and ``microbatch_size`` set how much work each instance does."""
    prog = Program("pipeline-mlp", steps=steps, microbatches=microbatches, checkpoint_every=10)
    slices = [prog.slice(f"stage{i}", devices=1) for i in range(STAGES)]
    params = [prog.state(f"params{i}", slice=slices[i], init=init_params(i, width)) for i in range(STAGES)]
    opts = [prog.state(f"opt{i}", slice=slices[i], init=init_opt(i, width)) for i in range(STAGES)]
    batch = prog.source("batch", batches(width, microbatch_size), slice=slices[0], outputs=("x", "y"))

    acts = [batch["x"]]  # input of each stage
    for i in range(STAGES - 1):
        fwd = prog.node(f"fwd{i}", forward, slice=slices[i], per="microbatch",
                        inputs={"params": params[i], "x": acts[i]})
        acts.append(fwd.ref)
    last = prog.node(f"loss{STAGES - 1}", loss_and_backward, slice=slices[-1], per="microbatch",
                     inputs={"params": params[-1], "x": acts[-1], "y": batch["y"]},
                     outputs=("loss", "grads", "grad_in"))
    prog.metric("loss", last["loss"])
    grads = {STAGES - 1: last["grads"]}
    grad_out = last["grad_in"]
    for i in reversed(range(STAGES - 1)):
        bwd = prog.node(f"bwd{i}", backward, slice=slices[i], per="microbatch",
                        inputs={"params": params[i], "x": acts[i], "grad_out": grad_out},
                        outputs=("grads", "grad_in"))
        grads[i] = bwd["grads"]
        grad_out = bwd["grad_in"]
    for i in range(STAGES):
        prog.node(f"update{i}", update, slice=slices[i],
                  inputs={"params": params[i], "opt_state": opts[i], "grads": gather(grads[i])},
                  outputs=("params", "opt_state"), updates={"params": params[i], "opt_state": opts[i]})
    return prog


program = build()

"""Your own train step, unchanged: a Flax NNX model and an Optax optimizer on Rallypoint.

``train_step(state, batch) -> (state, metrics)`` below is written the way a team writes it for
a plain JAX training loop: functional, its state a plain pytree of the model's parameters
(``nnx.to_pure_dict``) and the optimizer's state, the model rebuilt inside the step with
``nnx.merge``. ``Program.from_step`` runs that same function with checkpoints, replay after a
loss, drains and shrink/grow (the slice is ``devices=(1, 2)``: it may run on one device after
a loss with ``on_no_spare="shrink"``, and grows back); ``python examples/flax_step.py`` runs it
in a plain loop instead. Nothing in the step knows about Rallypoint.

The step asks for ``rng`` (a keyword parameter): ``from_step`` gives it a key of the job's seed and
the step, so its input noise is drawn again bit for bit when a step is replayed after a loss. Every
EVAL_EVERY steps ``eval_step`` reads the state on held-out batches (a JAX source) and reports
``eval_loss`` and ``eval_accuracy`` beside the training metrics; it changes nothing.

The data is a host source: plain NumPy run on the worker, a synthetic classification set
made from a seed and the step number (a fixed random "teacher" labels Gaussian inputs), so
any step's batch can be made again exactly and the example runs anywhere in seconds.

    rallypoint run examples/flax_step.py [--steps N]
    rallypoint run --reference examples/flax_step.py      # in this process
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rallypoint.client import Program

FEATURES, HIDDEN, CLASSES, BATCH = 16, 32, 4, 64
SEED, NOISE, EVAL_EVERY = 0, 0.05, 5


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


graphdef, _ = nnx.split(nnx.eval_shape(lambda: MLP(nnx.Rngs(SEED))))  # the model's structure, no arrays
optimizer = optax.adam(1e-2)


def init():
    params = nnx.to_pure_dict(nnx.state(MLP(nnx.Rngs(SEED)), nnx.Param))
    return {"params": params, "opt_state": optimizer.init(params)}


def loss_and_logits(params, batch):
    logits = nnx.merge(graphdef, params)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), logits


@jax.jit
def train_step(state, batch, *, rng):
    noisy = {**batch, "x": batch["x"] + NOISE * jax.random.normal(rng, batch["x"].shape)}  # input noise
    (loss, logits), grads = jax.value_and_grad(loss_and_logits, has_aux=True)(state["params"], noisy)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == batch["label"])
    return {"params": params, "opt_state": opt_state}, {"loss": loss, "accuracy": accuracy}


@jax.jit
def eval_step(state, batch):
    loss, logits = loss_and_logits(state["params"], batch)
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == batch["label"])}


TEACHER = np.random.default_rng(SEED).normal(size=(FEATURES, CLASSES)).astype(np.float32)


def make_batch(step, microbatch):
    """Step ``step``'s batch: NumPy only, the same bytes every time it is asked for."""
    rng = np.random.default_rng([SEED, step])
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    return {"x": x, "label": np.argmax(x @ TEACHER, axis=1).astype(np.int32)}


def held_out(step, microbatch):
    """Held-out examples of the same teacher, as a JAX source (``eval_host_source=False``: a function of the
    step, exported like a node, so the workers start no second source process for it)."""
    x = jax.random.normal(jax.random.fold_in(jax.random.key(SEED + 1), step), (BATCH, FEATURES))
    return {"x": x, "label": jnp.argmax(x @ jnp.asarray(TEACHER), axis=1).astype(jnp.int32)}


def build(steps: int = 40) -> Program:
    return Program.from_step("flax-step", init=init, train_step=train_step, source=make_batch, steps=steps,
                             seed=SEED, eval_step=eval_step, eval_source=held_out, eval_every=EVAL_EVERY,
                             eval_host_source=False,
                             devices=(1, 2), checkpoint_every=10)


program = build()


if __name__ == "__main__":  # the same step in a plain loop, no Rallypoint
    state = init()
    for step in range(program.steps):
        if step % EVAL_EVERY == 0:  # on the state at the start of the step, as from_step's eval node
            held = eval_step(state, held_out(step, 0))
            print(f"step {step:3d}  eval_loss {float(held['loss']):.4f}  eval_accuracy {float(held['accuracy']):.3f}")
        rng = jax.random.fold_in(jax.random.key(SEED), step)  # the key from_step gives the step
        state, metrics = train_step(state, make_batch(step, 0), rng=rng)
        if step % 10 == 0 or step == program.steps - 1:
            print(f"step {step:3d}  loss {float(metrics['loss']):.4f}  accuracy {float(metrics['accuracy']):.3f}")

"""A linear regression whose data source serves a poisoned batch at one stream position (the spike and
verification tests: tests/integration/test_spikes.py, test_verify.py)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from rallypoint.client import Program

STEPS, EVERY, POISON = 16, 2, 9
TRUE_W = (1.0, -2.0, 3.0, 0.5)


def regression(name: str, *, lr: float = 0.05, poison: float = 30.0) -> Program:
    """One slice: weights ``w`` fitted by SGD to ``y = x . TRUE_W``; the batch at stream position ``POISON`` has its
    ``x`` multiplied by ``poison`` (nan: a batch of NaNs)."""
    prog = Program(name, steps=STEPS, checkpoint_every=EVERY)
    s = prog.slice("s", devices=1)
    w = prog.state("w", slice=s, init=lambda: jnp.zeros((4,), jnp.float32))

    def batch(step: Any, mb: Any) -> dict[str, Any]:  # step: the stream position the step reads
        x = 1.0 + 0.1 * jnp.sin(step.astype(jnp.float32) + jnp.arange(4, dtype=jnp.float32))
        x = jnp.where(step == POISON, x * poison, x)
        return {"x": x, "y": jnp.dot(x, jnp.array(TRUE_W, jnp.float32))}

    data = prog.source("data", batch, slice=s, outputs=("x", "y"), per="step")

    def train(w: Any, x: Any, y: Any) -> dict[str, Any]:
        err = jnp.dot(x, w) - y
        return {"w": w - lr * err * x, "loss": err * err}

    node = prog.node("train", train, slice=s, inputs={"w": w, "x": data["x"], "y": data["y"]}, outputs=("w", "loss"),
                     updates={"w": w})
    prog.metric("loss", node["loss"])
    return prog

"""A small two-slice job, for sharing a cluster with a larger one at a higher priority.

Slice "a" keeps a running sum of a deterministic source; slice "b" reads "a"'s sum
every step and keeps a decayed total of it. Run it beside the pipeline example with
``--priority 10`` on a full cluster: it takes the slices it needs from the lower-priority
job, which gets them back when this one ends (docs/elastic.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from rallypoint.client import Program

WIDTH = 8


def build(steps: int = 40) -> Program:
    prog = Program("urgent", steps=steps, checkpoint_every=10)
    a = prog.slice("a", devices=1)
    b = prog.slice("b", devices=1)
    total = prog.state("total", slice=a, init=lambda: jnp.zeros((WIDTH,)))
    decayed = prog.state("decayed", slice=b, init=lambda: jnp.zeros((WIDTH,)))
    x = prog.source("x", lambda step, mb: {"x": jnp.sin(jnp.arange(WIDTH) + step)}, slice=a, per="step",
                    outputs=("x",))
    add = prog.node("add", lambda total, x: {"total": total + x, "out": jnp.tanh(total + x)}, slice=a,
                    inputs={"total": total, "x": x["x"]}, outputs=("total", "out"), updates={"total": total})
    decay = prog.node("decay", lambda decayed, v: {"decayed": 0.9 * decayed + v, "norm": jnp.sum(v * v)}, slice=b,
                      inputs={"decayed": decayed, "v": add["out"]}, outputs=("decayed", "norm"),
                      updates={"decayed": decayed})
    prog.metric("norm", decay["norm"])
    return prog


program = build()

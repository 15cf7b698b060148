"""A multi-host slice's JAX distributed group driven as a slice would drive it: an exported train step over
a 4-device mesh, its batches and first weights, and a check that member processes ended
(tests/workers/test_slice_group.py, tests/integration/test_multihost_members.py)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rallypoint.workers.gang.group import SliceGroup
from tests.conftest import wait_until


BATCH, WIDTH = 16, 8


def train_step_bytes() -> bytes:
    """A step over a 4-device mesh: the batch sharded across devices, the weights replicated, so the
    gradient is an all-reduce across both members."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    data, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def step(w: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        def loss(w: jax.Array) -> jax.Array:
            return jnp.mean((jnp.tanh(x @ w) - y) ** 2)
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.5 * grad, value

    f = jax.jit(step, in_shardings=(rep, data, data), out_shardings=(rep, rep))
    avals = (jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32, sharding=rep),
             jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=data),
             jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=data))
    return bytes(jax.export.export(f)(*avals).serialize())


TEACHER = np.random.default_rng(7).standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.5


def batch_at(step: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(step).standard_normal((BATCH, WIDTH)).astype(np.float32)
    return x, np.tanh(x @ TEACHER).astype(np.float32)


W0 = np.random.default_rng(99).standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.3


def setup_group(group: SliceGroup, program: bytes) -> None:
    group.mesh("m", [4], ["d"])
    group.load("step", program, "m")


def run_steps(group: SliceGroup, start: int, stop: int, losses: list[float]) -> None:
    for s in range(start, stop):
        x, y = batch_at(s)
        group.put("x", x, "m", ["d"])
        group.put("y", y, "m", ["d"])
        group.call("step", ["w", "x", "y"], ["w", "loss"])
        losses.append(float(group.fetch("loss")))


def all_gone(pids: list[int], within_s: float) -> bool:
    """Whether every process of ``pids`` has ended within ``within_s`` (fails naming them otherwise)."""

    def ended(p: int) -> bool:
        try:
            os.kill(p, 0)
        except ProcessLookupError:
            return True
        return False

    return bool(wait_until(lambda: all(ended(p) for p in pids), within_s, f"processes {pids} to end"))

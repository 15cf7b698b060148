"""A sharded Flax NNX model through ``Program.from_step``: its parameters and Adam's moments split over a 2-D mesh.

The model annotates its parameters with *logical* axis names (``("embed", "mlp")``), as Flax
models do; :data:`AXIS_RULES` maps them onto the slice's mesh of 8 devices, ``(2, 4)`` over
``("data", "model")``: the hidden (``mlp``) dimension over ``model``; the batch is split over
``data`` (``from_step``'s default for a batch).
``Program.from_step(..., state_sharding=..., axis_rules=AXIS_RULES)`` lays the train state out
that way: each device holds a quarter of every weight matrix and of Adam's ``mu`` and ``nu``, as
a plain Flax loop on the same mesh holds them (``python examples/flax_fsdp.py`` runs that loop).
The step is the user's own, unchanged: it sees the state laid out as declared, and its result
keeps that layout.

How the mesh reaches the model: ``init`` and the step are traced under ``jax.jit`` with the
slice's mesh already set, so neither calls ``jax.set_mesh`` (refused under ``jit``). Flax's
eager sharding would constrain each new variable to its logical names, which name no mesh axis;
``init`` turns it off and the job's layout is applied to ``init``'s result instead. (An ``init``
may also lay its result out itself, Flax's rules set inside it: docs/program-api.md, "Sharded
state".)

The data is a host source: plain NumPy on the worker, a regression target made from a seed and
the step number, so any step's batch can be made again exactly.

    rallypoint run examples/flax_fsdp.py [--steps N]          # an embedded cluster: 1 worker of 8 devices
    rallypoint run examples/flax_fsdp.py --fail kill:main@12   # one kill, recovered bitwise
    rallypoint run --reference examples/flax_fsdp.py           # in this process
    python examples/flax_fsdp.py                               # the same step in a plain Flax loop
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from rallypoint.client import Program

MESH_AXES, MESH_SHAPE = ("data", "model"), (2, 4)
AXIS_RULES = (("embed", None), ("mlp", "model"))
"""Logical axis name -> mesh axis (None: not split), as Flax's logical axis rules."""
FEATURES, HIDDEN, BATCH = 8, 64, 32
SEED = 0


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (FEATURES, HIDDEN)), out_sharding=("embed", "mlp"))
        self.b1 = nnx.Param(jnp.zeros((HIDDEN,)), out_sharding=("mlp",))
        self.w2 = nnx.Param(init(rngs.params(), (HIDDEN, 1)), out_sharding=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


with nnx.use_eager_sharding(False):  # the model's structure and its annotations, no arrays and no mesh
    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(SEED)))
graphdef = nnx.graphdef(abstract)
optimizer = optax.adam(1e-2)


def init():
    with nnx.use_eager_sharding(False):  # laid out by the job (state_sharding below), not variable by variable
        params = nnx.to_pure_dict(nnx.state(MLP(nnx.Rngs(SEED)), nnx.Param))
    return {"params": params, "opt_state": optimizer.init(params)}


def state_sharding(state):
    """The model's own annotations (logical names) for its parameters, and the same for Adam's moments."""
    params = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract, nnx.Param)))
    return {"params": params,
            "opt_state": optax.tree_map_params(optimizer, lambda _, spec: spec, state["opt_state"], params,
                                               transform_non_params=lambda _: P())}


@jax.jit
def train_step(state, batch):
    def loss_fn(params):
        return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}


def make_batch(step, microbatch):
    """Step ``step``'s batch: NumPy only, the same bytes every time it is asked for."""
    x = np.random.default_rng([SEED, step]).uniform(-1, 1, size=(BATCH, FEATURES)).astype(np.float32)
    return {"x": x, "y": (0.8 * (x**2).sum(axis=1, keepdims=True) + 0.1).astype(np.float32)}


def build(steps: int = 40, sharding=state_sharding, axis_rules=AXIS_RULES) -> Program:
    return Program.from_step("flax-fsdp", init=init, train_step=train_step, source=make_batch, steps=steps,
                             devices=8, mesh_axes=MESH_AXES, mesh_shape=MESH_SHAPE,
                             state_sharding=sharding, axis_rules=axis_rules, checkpoint_every=10)


program = build()


if __name__ == "__main__":  # the same step in a plain Flax loop on 8 CPU devices, no Rallypoint
    import flax.linen as nn

    jax.config.update("jax_num_cpu_devices", 8)
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as a slice's
    layout = nn.logical_to_mesh_sharding(state_sharding(jax.eval_shape(init)), mesh, AXIS_RULES)
    state = jax.jit(init, out_shardings=layout)()
    w1 = state["params"]["w1"]
    print(f"w1 {w1.shape}: {w1.addressable_shards[0].data.shape} per device ({w1.sharding.spec})")
    for step in range(program.steps):
        batch = jax.device_put(make_batch(step, 0), jax.sharding.NamedSharding(mesh, P("data")))
        state, metrics = train_step(state, batch)
        if step % 10 == 0 or step == program.steps - 1:
            print(f"step {step:3d}  loss {float(metrics['loss']):.4f}")

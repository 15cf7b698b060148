"""Program.from_step as a whole training loop: a step that asks for its step number and a key, gradient
accumulation over microbatches, and evaluation every k steps. In the reference runner (the cluster runs
the same exported programs: tests/integration/test_host_sources.py runs examples/flax_step.py, a step
asking for rng with an evaluation, through a kill, bitwise)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rallypoint.client import Program
from rallypoint.client.commands.plot import draw, plot_data
from rallypoint.client.compile import compile_program
from rallypoint.client.program import ProgramError
from rallypoint.client.reference import ReferenceExecutor, run_reference
from rallypoint.orchestrator.job.metrics import parse_metrics

B, K, D = 4, 3, 5  # microbatch size, microbatches, features
W_TRUE = np.arange(1, D + 1, dtype=np.float32)


def full_batch(step: Any) -> dict[str, Any]:
    """The k*b rows of a step, as a JAX function of the step."""
    x = jax.random.normal(jax.random.fold_in(jax.random.key(7), step), (K * B, D))
    return {"x": x, "y": x @ jnp.asarray(W_TRUE)}


def microbatch(step: Any, mb: Any) -> dict[str, Any]:
    """Microbatch ``mb`` of the step: rows mb*b to (mb+1)*b of :func:`full_batch`."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, mb * B, B), full_batch(step))


def init() -> dict[str, Any]:
    return {"w": jnp.zeros((D,), jnp.float32)}


def loss_fn(w: Any, batch: Any) -> Any:
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def grad_step(state: Any, batch: Any) -> Any:
    loss, g = jax.value_and_grad(loss_fn)(state["w"], batch)
    return {"w": g}, {"loss": loss}


def apply_step(state: Any, grads: Any) -> Any:
    return {"w": state["w"] - 0.05 * grads["w"]}


def train_step(state: Any, batch: Any) -> Any:
    grads, metrics = grad_step(state, batch)
    return apply_step(state, grads), metrics


def test_k_microbatches_give_the_update_of_one_batch_of_k_times_b_and_replay_bitwise() -> None:
    acc = Program.from_step("acc", init=init, grad_step=grad_step, apply_step=apply_step, microbatches=K,
                            source=microbatch, host_source=False, steps=6)
    assert (acc.microbatches, acc.nodes["grad"].per, acc.nodes["batch"].per) == (K, "microbatch", "microbatch")
    one = Program.from_step("one", init=init, train_step=train_step, source=lambda s, mb: full_batch(s),
                            host_source=False, steps=6)
    ex = ReferenceExecutor(compile_program(acc))
    got, want = ex.run(), run_reference(one)
    np.testing.assert_allclose(got.states["state"]["w"], want.states["state"]["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([m["loss"] for m in got.metrics], [m["loss"] for m in want.metrics], rtol=1e-5)
    assert got.instances["grad"] == 6 * K and got.instances["step"] == 6
    assert ex.run().state_digest == got.state_digest
    half = ex.run(3)  # a replay from a cut at step 3 ends in the same bits
    assert ex.run(state=half.states, start_step=3).state_digest == got.state_digest


def test_a_step_asking_for_step_and_rng_gets_the_step_and_a_key_of_the_seed_and_the_step() -> None:
    def noisy(state: Any, batch: Any, *, step: Any, rng: Any) -> Any:
        return {"key": jax.random.key_data(rng), "at": step}, {"step": step.astype(jnp.float32)}

    def build(seed: int) -> Program:
        return Program.from_step("noisy", init=lambda: {"key": jnp.zeros((2,), jnp.uint32), "at": jnp.int32(-1)},
                                 train_step=jax.jit(noisy), source=lambda s, mb: full_batch(s), host_source=False,
                                 steps=4, seed=seed)

    got = run_reference(build(3))
    want = jax.random.key_data(jax.random.fold_in(jax.random.key(3), 3))  # the last step's key
    assert np.array_equal(got.states["state"]["key"], want) and int(got.states["state"]["at"]) == 3
    assert [m["step"] for m in got.metrics] == [0, 1, 2, 3]
    assert run_reference(build(3)).state_digest == got.state_digest != run_reference(build(4)).state_digest


def test_grad_step_keys_differ_per_microbatch() -> None:
    def noisy_grad(state: Any, batch: Any, rng: Any) -> Any:
        return {"w": jax.random.normal(rng, (D,))}, {}

    prog = Program.from_step("mbkeys", init=init, grad_step=noisy_grad, apply_step=lambda s, g: {"w": s["w"] + g["w"]},
                             microbatches=2, source=microbatch, host_source=False, steps=1, seed=5)
    key = jax.random.fold_in(jax.random.key(5), 0)
    want = np.mean([np.asarray(jax.random.normal(jax.random.fold_in(key, mb), (D,))) for mb in range(2)], axis=0)
    np.testing.assert_allclose(run_reference(prog).states["state"]["w"], want, rtol=1e-6)


def held_out(step: Any, microbatch: Any) -> dict[str, Any]:
    return full_batch(step + 1000)


def eval_step(state: Any, batch: Any) -> dict[str, Any]:
    return {"loss": loss_fn(state["w"], batch)}


def test_eval_runs_every_k_steps_on_the_state_at_the_start_of_the_step_and_changes_nothing(tmp_path: Path) -> None:
    common = dict(init=init, train_step=train_step, source=lambda s, mb: full_batch(s), host_source=False, steps=7)
    prog = Program.from_step("ev", eval_step=eval_step, eval_source=held_out, eval_every=3, **common)
    plain = run_reference(Program.from_step("ev", **common))
    ex = ReferenceExecutor(compile_program(prog))
    got = ex.run()
    assert got.state_digest == plain.state_digest  # evaluation updates nothing
    assert [s for s, m in enumerate(got.metrics) if "eval_loss" in m] == [0, 3, 6]
    assert got.instances["eval"] == got.instances["eval_batch"] == 3
    w3 = ex.run(3).states["state"]["w"]
    assert got.metrics[3]["eval_loss"] == pytest.approx(float(loss_fn(jnp.asarray(w3), held_out(3, 0))), rel=1e-6)
    data = parse_metrics(json.dumps({"step": s, "t": 0, "metrics": m}) for s, m in enumerate(got.metrics))
    pd = plot_data(data, job="ev", run="r1")  # `rallypoint plot`: the eval curve at its steps, beside the loss
    assert list(pd.curves) == ["loss", "eval_loss"] and pd.curves["eval_loss"][0] == [0, 3, 6]
    draw(pd, tmp_path / "ev.png", "ev")
    assert (tmp_path / "ev.png").read_bytes().startswith(b"\x89PNG")
    named = Program.from_step("ev2", eval_step=eval_step, eval_source=held_out, eval_every=3, eval_prefix="val/",
                              **common)
    assert set(named.metrics) == {"loss", "val/loss"}


@pytest.mark.parametrize("options, says", [
    ({"train_step": train_step, "microbatches": 2}, "microbatches=2 accumulates gradients: give grad_step and "
                                                    "apply_step instead of train_step"),
    ({"grad_step": grad_step}, "gradient accumulation needs both grad_step"),
    ({"train_step": train_step, "grad_step": grad_step, "apply_step": apply_step}, "not both"),
    ({"train_step": train_step, "eval_step": eval_step, "eval_every": 2}, "eval_source is missing"),
    ({"train_step": train_step, "eval_step": eval_step, "eval_source": held_out, "eval_every": 0},
     "eval_every must be a positive integer"),
    ({"train_step": train_step, "eval_step": eval_step, "eval_source": held_out, "eval_every": 2, "eval_prefix": ""},
     "eval metric 'loss' has the name of a training metric"),
    ({"train_step": lambda state, step, batch: (state, {})}, "parameter 'step' comes before the state"),
    ({"grad_step": lambda s, b: (s["w"], {}), "apply_step": lambda s, g: {"w": g[0]}},
     "apply_step returns a new state unlike init()'s"),
])
def test_bad_loop_options_are_refused_naming_what(options: dict[str, Any], says: str) -> None:
    with pytest.raises(ProgramError) as info:
        Program.from_step("bad", init=init, source=microbatch, host_source=False, steps=2, **options)
    assert says in str(info.value)

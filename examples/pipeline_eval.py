"""The 4-stage MLP pipeline with an evaluator beside it: a slice that holds no state of its own.

Slice ``eval`` has a per-step source of held-out inputs (``held``) and a node that runs every
EVAL_EVERY steps (``evaluate``): it reads two pipeline stages' parameters, as they stand at the
start of the step, and reports the held-out error of those two layers as the metric
``eval_err``, which exists only at those steps. The evaluator changes nothing the pipeline
computes: the job's states (and its state digest) are the pipeline's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

from rallypoint.client import Program, StateRef

EVAL_EVERY = 3
EVAL_STAGES = (1, 2)  # the stages whose parameters the evaluator reads


def _pipeline():
    """examples/pipeline_mlp.py, loaded by path (a job file is imported by path, not as a package)."""
    spec = importlib.util.spec_from_file_location("pipeline_mlp_for_eval", Path(__file__).with_name("pipeline_mlp.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pipeline_mlp = _pipeline()


def held_out(step, microbatch):
    """Held-out inputs of a step: a function of the step only (another key than the training data's)."""
    key = jax.random.fold_in(jax.random.PRNGKey(4321), step)
    x = jax.random.normal(key, (pipeline_mlp.MICROBATCH_SIZE, pipeline_mlp.WIDTH))
    return {"x": x, "y": jnp.sin(2.0 * x)}


def evaluate(first, second, x, y):
    h = pipeline_mlp.apply_stage(first, x, last=False)
    out = pipeline_mlp.apply_stage(second, h, last=True)
    return jnp.mean((out - y) ** 2)


def build(steps: int = 30, *, eval_every: int = EVAL_EVERY) -> Program:
    prog = pipeline_mlp.build(steps)
    prog.name = "pipeline-eval"
    ev = prog.slice("eval", devices=1)
    held = prog.source("held", held_out, slice=ev, per="step", outputs=("x", "y"))
    a, b = EVAL_STAGES
    err = prog.node("evaluate", evaluate, slice=ev, every=eval_every,
                    inputs={"first": StateRef(f"params{a}", f"stage{a}"), "second": StateRef(f"params{b}", f"stage{b}"),
                            "x": held["x"], "y": held["y"]},
                    outputs=("eval_err",))
    prog.metric("eval_err", err["eval_err"])
    return prog


program = build()

"""The LM example (examples/lm) at tiny sizes, as the tests build it: its job file and the ``LM_*`` settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "lm" / "train.py"
TINY = {"LM_D_MODEL": "32", "LM_HEADS": "2", "LM_CONTEXT": "16", "LM_BATCH": "8", "LM_LR": "0.01",
        "LM_CORPUS_BYTES": "65536", "LM_DEVICES": "2", "LM_EVAL_EVERY": "0"}
"""Sizes of a model that compiles and steps in well under a second on a CPU, without the eval node (one
program less to compile; tests/client/test_lm_example.py turns it on); a test's own settings go on top."""


def tiny_lm(monkeypatch: pytest.MonkeyPatch, data_dir: Path, **settings: str) -> None:
    """Set the example's ``LM_*`` variables: :data:`TINY`, the token file under ``data_dir``, then ``settings``
    (``variant="fsdp"`` sets ``LM_VARIANT``). A local cluster started afterwards passes them to its workers."""
    env = TINY | {"LM_DATA_DIR": str(data_dir)} | {f"LM_{k.upper()}": v for k, v in settings.items()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def is_key_bias(path: str) -> bool:
    """Whether a leaf (by ``jax.tree_util.keystr`` path, in the weights or in Adam's moments) is an attention
    key projection's bias. Its true gradient is zero (``q . b_k`` adds the same to every logit of a row, which
    the softmax ignores), so what it gets is rounding noise, and Adam scales noise up to steps of about the
    learning rate: on another device count (other reductions, other noise) it drifts by up to the rate per
    step, not by the last bits. The reshard tolerance is for the other leaves."""
    return "['attn']['key']['bias']" in path


def split_key_biases(states: Any) -> tuple[dict[str, list[np.ndarray]], list[np.ndarray]]:
    """``states`` (name -> pytree) as (name -> flat leaves but the key biases, the key biases)."""
    rest: dict[str, list[np.ndarray]] = {}
    biases: list[np.ndarray] = []
    for name, tree in states.items():
        rest[name] = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            (biases if is_key_bias(jax.tree_util.keystr(path)) else rest[name]).append(np.asarray(leaf))
    return rest, biases


def run_on(compiled: Any, count: int) -> dict[str, Any]:
    """The one-slice LM (a host source ``batch``, a ``train`` node) run in this process on ``count`` devices with
    the programs exported for that count (``variants``), from the inits to the last step: what a slice that
    shrank onto ``count`` devices before its first checkpoint computes. The final states, on the host."""
    from rallypoint.client.reference import to_host
    from rallypoint.workers.programs import load_exported, slice_mesh

    program = compiled.program
    (sl,) = program.slices.values()
    mesh = slice_mesh(jax.devices()[:count], sl.mesh_shape_for(count), sl.mesh_axes)
    states = {n: st.tree.unflatten(list(load_exported(st.variants[count], mesh)())) for n, st in compiled.states.items()}
    source, train = compiled.nodes["batch"], compiled.nodes["train"]
    layout, step = load_exported(source.variants[count], mesh), load_exported(train.variants[count], mesh)
    read = program.nodes["batch"].fn
    for s in range(program.steps):
        batch = read(s, 0)
        inputs, targets = layout(batch["inputs"], batch["targets"])
        args = [states["params"], states["opt_state"], inputs, targets]
        out = train.unflatten_outputs(step(*train.flatten_inputs(args)))
        states = {n: out[n] for n in states}
    return to_host(states)

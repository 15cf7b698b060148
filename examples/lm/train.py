"""A byte-level GPT on the Python standard library's source: the LM job file (examples/lm/README.md).

    rallypoint run --reference examples/lm/train.py --steps 40          # in process
    LM_VARIANT=pipeline rallypoint run --reference examples/lm/train.py

Two layouts of the same model (model.py), chosen by ``LM_VARIANT``:

- ``dp`` (default): one slice of ``LM_DEVICES`` devices (4; it may shrink to 2 and grows
  back) with a "data" mesh axis. A per-step host source reads the step's ``LM_BATCH``
  windows; the train node computes the loss and gradients on the sharded batch (XLA adds
  the cross-device reduction) and applies Adam to the replicated weights.
- ``pipeline``: two stages of two devices each, batch sharded on "data" inside each stage.
  Stage 0 holds the embeddings and the first half of the blocks, stage 1 the rest and the
  head. Per microbatch: forward on stage 0, loss and backward on stage 1, backward on
  stage 0 (recomputing its forward); per step each stage gathers its microbatch gradients
  and updates its weights, as in examples/pipeline_mlp.py.

Data: a host source (plain Python, on the worker) reads windows of ``LM_CONTEXT + 1``
bytes of the token file through Grain (rallypoint.client.data); the examples of a step
are a function of the step only, the same in both layouts and on any device count. The
token file is prepared on first use (prepare.py). Sizes and paths come from ``LM_*``
environment variables (:func:`config`), read when the program is built and when the
source first runs, so the workers of a run must see the same ones as the client.
"""

# No `from __future__ import annotations`: the job file is imported without a sys.modules entry, where
# dataclasses cannot resolve string annotations.
import os
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import model as lm
import prepare as corpus
from rallypoint.client import Program, ProgramError, gather
from rallypoint.client.data import GrainBatches, TokenWindows

DATA = P("data")  # the batch axis over the slice's "data" mesh axis


@dataclass(frozen=True)
class LMConfig:
    """The job's settings; each field ``x`` is read from ``LM_X`` (``LM_D_MODEL``, ``LM_STEPS``, ...)."""

    variant: str = "dp"  # dp | pipeline
    steps: int = 100
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    context: int = 64
    batch: int = 16  # sequences per step (all microbatches together)
    microbatches: int = 2  # pipeline: microbatches per step
    devices: int = 4  # dp: the slice's devices (it may shrink to 2); pipeline: each stage has 2
    lr: float = 3e-3
    seed: int = 0
    data_seed: int = 0
    corpus_bytes: int = corpus.DEFAULT_MAX_BYTES
    data_dir: str = ""  # "": prepare.default_data_dir()

    @property
    def model(self) -> lm.ModelConfig:
        return lm.ModelConfig(self.layers, self.d_model, self.heads, self.context, self.seed)

    @property
    def split(self) -> int:
        """The first block of stage 1 (pipeline)."""
        return max(1, self.layers // 2)

    def check(self) -> "LMConfig":
        if self.variant not in ("dp", "pipeline"):
            raise ProgramError(f"LM_VARIANT must be dp or pipeline, got {self.variant!r}")
        if self.variant == "pipeline" and self.layers < 2:
            raise ProgramError("the pipeline needs LM_LAYERS >= 2 (one block per stage at least)")
        per_mb = self.batch // self.microbatches if self.variant == "pipeline" else self.batch
        shards = 2 if self.variant == "pipeline" else self.devices
        if self.variant == "pipeline" and self.batch % self.microbatches or per_mb % shards:
            m = self.microbatches if self.variant == "pipeline" else 1
            raise ProgramError(f"LM_BATCH {self.batch} must split into {m} microbatches of a multiple of {shards} "
                               "sequences (the devices of a slice)")
        return self


def config() -> LMConfig:
    """The settings from the environment (``LM_<FIELD>``), defaults otherwise."""
    values: dict[str, Any] = {}
    for f in fields(LMConfig):
        raw = os.environ.get(f"LM_{f.name.upper()}")
        if raw is not None:
            values[f.name] = type(f.default)(raw)
    return LMConfig(**values).check()


# -- data: the host source -------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _batches(data_dir: str, corpus_bytes: int, context: int, batch: int, microbatches: int,
             seed: int) -> GrainBatches:
    def windows() -> TokenWindows:
        return TokenWindows(corpus.prepare(data_dir or None, corpus_bytes), context=context)
    return GrainBatches(windows, batch=batch, microbatches=microbatches, seed=seed)


def lm_batch(step: int, microbatch: int) -> dict[str, Any]:
    """The host source: ``inputs`` and ``targets`` (int32, [sequences, context]) of ``(step, microbatch)``."""
    cfg = config()
    m = cfg.microbatches if cfg.variant == "pipeline" else 1
    return _batches(cfg.data_dir, cfg.corpus_bytes, cfg.context, cfg.batch // m, m, cfg.data_seed)(step, microbatch)


# -- data parallelism: one slice ---------------------------------------------------------------------------


def build_dp(cfg: LMConfig) -> Program:
    mc, opt = cfg.model, lm.optimizer(cfg.lr)
    last = cfg.layers

    def init_params() -> Any:
        return lm.init(mc, 0, last)

    def train_step(params: Any, opt_state: Any, inputs: Any, targets: Any) -> dict[str, Any]:
        def loss_fn(p: Any) -> Any:
            return lm.cross_entropy(lm.apply(mc, 0, last, p, inputs), targets)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "loss": loss,
                "tokens": jnp.float32(targets.size)}

    prog = Program("lm-dp", steps=cfg.steps, checkpoint_every=10)
    devices = (2, cfg.devices) if cfg.devices > 2 else cfg.devices
    dp = prog.slice("dp", devices=devices, mesh_axes=("data",))
    params = prog.state("params", slice=dp, init=init_params)
    # Adam's moments are zeros of the weights' shapes: eval_shape makes no weights (one init less to compile)
    opt_state = prog.state("opt_state", slice=dp, init=lambda: opt.init(jax.eval_shape(init_params)))
    batch = prog.source("batch", lm_batch, slice=dp, per="step", outputs=("inputs", "targets"), host=True,
                        shardings={"inputs": DATA, "targets": DATA})
    step = prog.node("train", train_step, slice=dp,
                     inputs={"params": params, "opt_state": opt_state, "inputs": batch["inputs"],
                             "targets": batch["targets"]},
                     outputs=("params", "opt_state", "loss", "tokens"),
                     updates={"params": params, "opt_state": opt_state},
                     shardings={"inputs": DATA, "targets": DATA})
    prog.metric("loss", step["loss"])
    prog.metric("tokens", step["tokens"])
    return prog


# -- a two-stage pipeline, data parallel inside each stage -------------------------------------------------


def build_pipeline(cfg: LMConfig) -> Program:
    mc, opt, k, last = cfg.model, lm.optimizer(cfg.lr), cfg.split, cfg.layers

    def init0() -> Any:
        return lm.init(mc, 0, k)

    def init1() -> Any:
        return lm.init(mc, k, last)

    def forward0(params: Any, inputs: Any) -> Any:
        return lm.apply(mc, 0, k, params, inputs)

    def backward0(params: Any, inputs: Any, grad_out: Any) -> Any:
        _, vjp = jax.vjp(lambda p: lm.apply(mc, 0, k, p, inputs), params)
        return vjp(grad_out)[0]

    def loss1(params: Any, act: Any, targets: Any) -> dict[str, Any]:
        def loss_fn(p: Any, a: Any) -> Any:
            return lm.cross_entropy(lm.apply(mc, k, last, p, a), targets)

        loss, (grads, grad_in) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, act)
        return {"loss": loss, "tokens": jnp.float32(targets.size), "grads": grads, "grad_in": grad_in}

    def update(params: Any, opt_state: Any, grads: Any) -> dict[str, Any]:
        mean = jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), grads)  # microbatches of equal size
        updates, opt_state = opt.update(mean, opt_state, params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}

    def update_last(params: Any, opt_state: Any, grads: Any, tokens: Any) -> dict[str, Any]:
        return update(params, opt_state, grads) | {"tokens": jnp.sum(tokens)}

    prog = Program("lm-pipeline", steps=cfg.steps, microbatches=cfg.microbatches, checkpoint_every=10)
    s0 = prog.slice("stage0", devices=2, mesh_axes=("data",))
    s1 = prog.slice("stage1", devices=2, mesh_axes=("data",))
    p0 = prog.state("params0", slice=s0, init=init0)
    o0 = prog.state("opt0", slice=s0, init=lambda: opt.init(jax.eval_shape(init0)))
    p1 = prog.state("params1", slice=s1, init=init1)
    o1 = prog.state("opt1", slice=s1, init=lambda: opt.init(jax.eval_shape(init1)))
    batch = prog.source("batch", lm_batch, slice=s0, outputs=("inputs", "targets"), host=True,
                        shardings={"inputs": DATA, "targets": DATA})
    fwd = prog.node("fwd0", forward0, slice=s0, per="microbatch", inputs={"params": p0, "inputs": batch["inputs"]},
                    outputs=("act",), shardings={"inputs": DATA, "act": DATA})
    head = prog.node("loss1", loss1, slice=s1, per="microbatch",
                     inputs={"params": p1, "act": fwd["act"], "targets": batch["targets"]},
                     outputs=("loss", "tokens", "grads", "grad_in"),
                     shardings={"act": DATA, "targets": DATA, "grad_in": DATA})
    bwd = prog.node("bwd0", backward0, slice=s0, per="microbatch",
                    inputs={"params": p0, "inputs": batch["inputs"], "grad_out": head["grad_in"]},
                    outputs=("grads",), shardings={"inputs": DATA, "grad_out": DATA})
    prog.node("update0", update, slice=s0, inputs={"params": p0, "opt_state": o0, "grads": gather(bwd["grads"])},
              outputs=("params", "opt_state"), updates={"params": p0, "opt_state": o0})
    up1 = prog.node("update1", update_last, slice=s1,
                    inputs={"params": p1, "opt_state": o1, "grads": gather(head["grads"]),
                            "tokens": gather(head["tokens"])},
                    outputs=("params", "opt_state", "tokens"), updates={"params": p1, "opt_state": o1})
    prog.metric("loss", head["loss"])
    prog.metric("tokens", up1["tokens"])
    return prog


def build(cfg: LMConfig | None = None) -> Program:
    """The program of ``cfg`` (default: :func:`config`, from the environment)."""
    cfg = config() if cfg is None else cfg.check()
    return build_pipeline(cfg) if cfg.variant == "pipeline" else build_dp(cfg)


def data_path(cfg: LMConfig | None = None) -> Path:
    """The token file of ``cfg``, prepared if missing."""
    cfg = config() if cfg is None else cfg
    return corpus.prepare(cfg.data_dir or None, cfg.corpus_bytes)

"""A byte-level GPT on the Python standard library's source: the LM job file (examples/lm/README.md).

    rallypoint run --reference examples/lm/train.py --steps 40          # in process
    LM_VARIANT=pipeline rallypoint run --reference examples/lm/train.py

Four layouts of the same model (model.py), chosen by ``LM_VARIANT``:

- ``dp`` (default): one slice of ``LM_DEVICES`` devices (4; it may shrink to 2 and grows
  back) with a "data" mesh axis. A per-step host source reads the step's ``LM_BATCH``
  windows; the train node computes the loss and gradients on the sharded batch (XLA adds
  the cross-device reduction) and applies Adam to the replicated weights.
- ``fsdp``: the same slice and step, with the weights and Adam's state sharded over
  "data" (each leaf split along its largest dimension that ``LM_DEVICES`` divides; the
  scalars and the leaves nothing divides replicated): each device holds about a quarter.
- ``tp``: one slice of ``LM_DEVICES`` devices as a 2-D mesh ("data", "model") of shape
  ``(LM_DEVICES / LM_TENSOR, LM_TENSOR)`` ((2, 2); it may shrink to (1, 2)): the MLP and the
  attention heads split over "model" (Megatron style), every other leaf FSDP over "data"
  where it divides, the batch over "data".
- ``pipeline``: two stages of two devices each, batch sharded on "data" inside each stage.
  Stage 0 holds the embeddings and the first half of the blocks, stage 1 the rest and the
  head. Per microbatch: forward on stage 0, loss and backward on stage 1, backward on
  stage 0 (recomputing its forward); per step each stage gathers its microbatch gradients
  and updates its weights, as in examples/pipeline_mlp.py.

Data: a host source (plain Python, on the worker) reads windows of ``LM_CONTEXT + 1``
bytes of the token file through Grain (rallypoint.client.data); the examples of a step
are a function of the step only, the same in both layouts and on any device count. The
token file is prepared on first use (prepare.py). Sizes and paths are the job's settings
``LM_*`` (:func:`config`): ``rallypoint run --set LM_D_MODEL=128 ...``, or the client's
environment variables of those names; read with ``rallypoint.client.setting``, they are
shipped with the job's code, so the workers need not be started with them.
"""

# No `from __future__ import annotations`: the job file is imported without a sys.modules entry, where
# dataclasses cannot resolve string annotations.
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
from rallypoint.client import Program, ProgramError, gather, setting
from rallypoint.client.data import GrainBatches, TokenWindows

DATA = P("data")  # the batch axis over the slice's "data" mesh axis
VARIANTS = ("dp", "fsdp", "tp", "pipeline")


@dataclass(frozen=True)
class LMConfig:
    """The job's settings; each field ``x`` is read from ``LM_X`` (``LM_D_MODEL``, ``LM_STEPS``, ...)."""

    variant: str = "dp"  # dp | fsdp | tp | pipeline
    steps: int = 100
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    context: int = 64
    batch: int = 16  # sequences per step (all microbatches together)
    microbatches: int = 2  # pipeline: microbatches per step
    devices: int = 4  # dp, fsdp, tp: the slice's devices (it may shrink to 2); pipeline: each stage has 2
    tensor: int = 2  # tp: the size of the "model" mesh axis
    lr: float = 3e-3
    seed: int = 0
    data_seed: int = 0
    eval_every: int = 10  # dp, fsdp, tp: the eval node's period (0: no evaluation)
    corpus_bytes: int = corpus.DEFAULT_MAX_BYTES
    data_dir: str = ""  # "": prepare.default_data_dir()
    init_from: str = ""  # dp, fsdp, tp: start the weights from this plain Orbax checkpoint (`rallypoint export
    # lm-dp --state params --out DIR` of an earlier run); "": from the model's init

    @property
    def model(self) -> lm.ModelConfig:
        return lm.ModelConfig(self.layers, self.d_model, self.heads, self.context, self.seed)

    @property
    def split(self) -> int:
        """The first block of stage 1 (pipeline)."""
        return max(1, self.layers // 2)

    @property
    def data(self) -> int:
        """The size of the "data" mesh axis on the slice's most devices (the pipeline: each stage's)."""
        return {"pipeline": 2, "tp": self.devices // self.tensor}.get(self.variant, self.devices)

    def check(self) -> "LMConfig":
        if self.variant not in VARIANTS:
            raise ProgramError(f"LM_VARIANT must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if self.variant == "pipeline" and self.layers < 2:
            raise ProgramError("the pipeline needs LM_LAYERS >= 2 (one block per stage at least)")
        if self.variant == "tp" and (self.tensor < 1 or self.devices % self.tensor or self.heads % self.tensor):
            raise ProgramError(f"LM_TENSOR {self.tensor} must divide LM_DEVICES {self.devices} and LM_HEADS "
                               f"{self.heads} (the tp variant splits the heads over the \"model\" axis)")
        per_mb = self.batch // self.microbatches if self.variant == "pipeline" else self.batch
        shards = self.data
        if self.variant == "pipeline" and self.batch % self.microbatches or per_mb % shards:
            m = self.microbatches if self.variant == "pipeline" else 1
            raise ProgramError(f"LM_BATCH {self.batch} must split into {m} microbatches of a multiple of {shards} "
                               "sequences (the devices of a slice)")
        return self


def config() -> LMConfig:
    """The job's settings ``LM_<FIELD>`` (``--set``, else the client's environment; on a worker, the values shipped
    with the job's code), defaults otherwise."""
    values: dict[str, Any] = {}
    for f in fields(LMConfig):
        raw = setting(f"LM_{f.name.upper()}")
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


def lm_eval_batch(step: int, microbatch: int) -> dict[str, Any]:
    """The eval node's host source: one fixed batch of ``LM_BATCH`` windows, drawn with another seed than the
    training data's (``data_seed + 1``: another shuffle of the corpus, not a split of it), the same at every
    evaluation, so ``eval_loss`` is one batch's loss of the state as it stands at those steps."""
    cfg = config()
    return _batches(cfg.data_dir, cfg.corpus_bytes, cfg.context, cfg.batch, 1, cfg.data_seed + 1)(0, 0)


# -- one slice: data parallel, FSDP, tensor parallel ------------------------------------------------------

# tp: the leaves split over "model", by the end of their path (Megatron: the MLP's hidden units and the
# attention heads; each device computes its share of them, XLA adds the all-reduce after `down` and `out`).
TENSOR_PARALLEL = {
    ("up", "kernel"): P(None, "model"),  # (d, 4d)
    ("up", "bias"): P("model"),  # (4d,): the hidden units as the kernel splits them
    ("down", "kernel"): P("model", None),  # (4d, d)
    **{(qkv, "kernel"): P(None, "model", None) for qkv in ("query", "key", "value")},  # (d, heads, head_dim)
    **{(qkv, "bias"): P("model", None) for qkv in ("query", "key", "value")},  # (heads, head_dim)
    ("out", "kernel"): P("model", None, None),  # (heads, head_dim, d)
}


def _names(path: Any) -> tuple[Any, ...]:
    return tuple(getattr(e, "key", getattr(e, "name", getattr(e, "idx", e))) for e in path)


def leaf_spec(cfg: LMConfig, path: tuple[Any, ...], shape: tuple[int, ...]) -> P:
    """One leaf's layout: in ``tp``, a tensor-parallel leaf by its path's end; otherwise FSDP: split the largest
    dimension that the "data" axis divides (its size on the most devices: fewer devices divide it too) over
    "data"; a scalar, or a leaf no dimension of which divides, replicated. ``dp``: everything replicated."""
    if cfg.variant == "tp":
        for tail, spec in TENSOR_PARALLEL.items():
            if path[-len(tail):] == tail:
                return spec
    if cfg.variant == "dp" or cfg.data == 1:
        return P()
    for dim in sorted(range(len(shape)), key=lambda i: -shape[i]):  # the largest first (the first of equals)
        if shape[dim] % cfg.data == 0:
            return P(*(None,) * dim, "data")
    return P()


def state_sharding(cfg: LMConfig) -> Any:
    """The ``sharding=`` of the weights and of Adam's state: a function of the abstract state. A leaf's spec
    depends on its path's end and shape only, so Adam's moments (``mu``, ``nu``: the weights' tree under
    ``ScaleByAdamState``) lie as the weights they follow, and its step count is replicated."""
    if cfg.variant == "dp":
        return None

    def specs(aval: Any) -> Any:
        return jax.tree_util.tree_map_with_path(lambda path, leaf: leaf_spec(cfg, _names(path), leaf.shape), aval)

    return specs


def build_dp(cfg: LMConfig) -> Program:
    """The one-slice variants (``dp``, ``fsdp``, ``tp``): one train node, the state laid out as the variant says."""
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

    name = cfg.variant
    prog = Program(f"lm-{name}", steps=cfg.steps, checkpoint_every=10)
    low = cfg.tensor if name == "tp" else 2  # tp shrinks its "data" axis, down to (1, LM_TENSOR)
    devices = (low, cfg.devices) if cfg.devices > low else cfg.devices
    mesh = {"mesh_axes": ("data", "model"), "mesh_shape": (cfg.data, cfg.tensor)} if name == "tp" else \
        {"mesh_axes": ("data",)}
    dp = prog.slice(name, devices=devices, **mesh)
    layout = state_sharding(cfg)
    params = prog.state("params", slice=dp, init=init_params, sharding=layout, init_from=cfg.init_from or None)
    # Adam's moments are zeros of the weights' shapes: eval_shape makes no weights (one init less to compile)
    opt_state = prog.state("opt_state", slice=dp, init=lambda: opt.init(jax.eval_shape(init_params)),
                           sharding=layout)
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
    if cfg.eval_every:  # every k steps, the weights at the start of the step on the eval batch; updates nothing
        held = prog.source("eval_batch", lm_eval_batch, slice=dp, per="step", outputs=("inputs", "targets"),
                           host=True, shardings={"inputs": DATA, "targets": DATA}, every=cfg.eval_every)
        ev = prog.node("eval", lambda params, inputs, targets: lm.cross_entropy(lm.apply(mc, 0, last, params, inputs),
                                                                                targets),
                       slice=dp, every=cfg.eval_every, outputs=("eval_loss",),
                       inputs={"params": params, "inputs": held["inputs"], "targets": held["targets"]},
                       shardings={"inputs": DATA, "targets": DATA})
        prog.metric("eval_loss", ev["eval_loss"])
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

"""A small GPT-style decoder-only transformer in Flax NNX, as pure functions over a params pytree.

The model is cut into :class:`Stage` modules: blocks ``[first, last)``, with the token and
position embeddings when ``first == 0`` and the final norm and the vocabulary head when
``last == layers``. The data-parallel job holds one stage with every block; the pipeline
holds two. Each piece (the embeddings, block ``i``, the head) is initialized from its own
key (``fold_in(seed, piece)``), so the two layouts start from the same weights and, on the
same batch, give the same first loss.

A program's state must be a plain pytree, so each stage is split once into its graph
definition (kept here, on the client and in the exported programs) and a pure dict of
arrays (the state); :func:`apply` merges them back inside the traced node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

VOCAB = 256  # bytes


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    context: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of heads {self.heads}")


def _rngs(cfg: ModelConfig, piece: int) -> nnx.Rngs:
    return nnx.Rngs(params=jax.random.fold_in(jax.random.key(cfg.seed), piece))


class Block(nnx.Module):
    """Pre-norm attention (causal) and a 4x GELU MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d = cfg.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=cfg.heads, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Stage(nnx.Module):
    """Blocks ``[first, last)``; the embeddings if ``first == 0``, the head if ``last == cfg.layers``."""

    def __init__(self, cfg: ModelConfig, first: int, last: int) -> None:
        if not 0 <= first < last <= cfg.layers:
            raise ValueError(f"stage [{first}, {last}) is not a range of the {cfg.layers} blocks")
        self.has_embed = first == 0
        self.has_head = last == cfg.layers
        if self.has_embed:
            rngs = _rngs(cfg, 0)
            self.tok = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.context, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, _rngs(cfg, 1 + i)) for i in range(first, last)])
        if self.has_head:
            rngs = _rngs(cfg, 1 + cfg.layers)
            self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
            self.head = nnx.Linear(cfg.d_model, VOCAB, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Tokens (B, T) int32 -> activations (B, T, d) for the first stage, activations onward; the
        last stage returns logits (B, T, VOCAB)."""
        if self.has_embed:
            x = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.has_head:
            x = self.head(self.ln_f(x))
        return x


@lru_cache(maxsize=None)
def graphdef(cfg: ModelConfig, first: int, last: int) -> Any:
    """The stage's graph definition (traced abstractly: no weights are made)."""
    return nnx.split(nnx.eval_shape(lambda: Stage(cfg, first, last)))[0]


def init(cfg: ModelConfig, first: int, last: int) -> dict[str, Any]:
    """The stage's weights as a pure dict of arrays (a program state)."""
    return nnx.to_pure_dict(nnx.state(Stage(cfg, first, last)))


def apply(cfg: ModelConfig, first: int, last: int, params: Any, x: jax.Array) -> jax.Array:
    return nnx.merge(graphdef(cfg, first, last), params)(x)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-byte cross entropy in nats (ln 256 = 5.55 for a uniform guess)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def optimizer(lr: float) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))

"""The state digest's pytree structure: the same text in every process, and still telling structures apart."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from rallypoint.proto.digest import structure

tree = jax.tree_util.tree_structure


def test_a_train_state_with_static_functions_prints_no_address_and_names_its_node_types() -> None:
    state = train_state.TrainState.create(apply_fn=lambda p, x: x, params={"w": jnp.zeros(2)},
                                          tx=optax.chain(optax.clip(1.0), optax.adam(1e-3)))
    text = structure(tree(state))
    assert "0x" not in text and " at " not in text, text
    assert "TrainState[" in text and "GradientTransformationExtraArgs(" in text
    assert "chain.<locals>.init_fn" in text  # a static function by its qualified name
    assert structure(tree(state)) == text


def test_structures_that_differ_give_different_text() -> None:
    P = collections.namedtuple("P", "a b")
    shapes = [{"a": 1, "b": 2}, {"a": 1, "c": 2}, (1, 2), [1, 2], (1, (2,)), (1, None, 2), P(1, 2), 1]
    texts = [structure(tree(x)) for x in shapes]
    assert len(set(texts)) == len(texts), texts

"""A state's tree as a plain Orbax checkpoint lays it out: what ``rallypoint export`` writes and ``load_state`` returns.

Orbax saves any pytree in a serialized form of nested dicts and lists (orbax ``serialize_tree``): a
dict stays a dict (its keys as strings), a NamedTuple or a dataclass node (an Optax state, a Flax
``TrainState``) becomes a dict of its fields, a tuple or a list becomes a list, and an empty node
(``None``, ``()``, Optax's ``EmptyState()``) becomes ``None``. The client records that layout of each
state at submit (:func:`skeleton`: the tree with each leaf's index in flatten order, as JSON in
``StateProgram.tree``), so the leaves of a checkpoint, flat on the cluster, are put back into it
(:func:`fill`) without the user's classes. A plain ``StandardCheckpointer().restore(path, abstract)``
with the user's own abstract tree as target then gets the user's own types back: Orbax maps its
layout onto the target's key paths.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["fill", "key_name", "paths", "skeleton", "skeleton_of"]


def key_name(key: Any) -> str | int:
    """A JAX key path entry as Orbax names it: a dict key as a string, a field by its name, an index as an int."""
    import jax

    tu = jax.tree_util
    if isinstance(key, tu.SequenceKey):
        return int(key.idx)
    if isinstance(key, tu.FlattenedIndexKey):
        return int(key.key)
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.GetAttrKey):
        return str(key.name)
    raise ValueError(f"a pytree key {key!r} of a kind Orbax cannot save ({type(key).__name__})")


def _empty_or_leaf(x: Any) -> bool:
    import jax

    if isinstance(x, int):  # the leaf indices skeleton() puts in
        return True
    try:
        got = jax.tree_util.default_registry.flatten_one_level(x)
    except ValueError:
        return True
    return got is None or not list(got[0])  # None: a leaf; else (children, aux)


def skeleton_of(tree: Any) -> Any:
    """``tree`` in Orbax's layout (see the module doc), its leaves as they are and empty nodes ``None``."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_empty_or_leaf)
    if len(flat) == 1 and not flat[0][0]:
        return flat[0][1]
    root: Any = None
    for path, value in flat:
        root = _put(root, [key_name(k) for k in path], value if jax.tree_util.all_leaves([value]) else None)
    return root


def _put(node: Any, keys: Sequence[str | int], value: Any) -> Any:
    if not keys:
        return value
    k, rest = keys[0], keys[1:]
    if node is None:
        node = [] if isinstance(k, int) else {}
    if isinstance(node, list):
        if not isinstance(k, int):
            raise ValueError(f"a tree that mixes sequence and named children ({k!r})")
        while len(node) <= k:
            node.append(None)
        node[k] = _put(node[k], rest, value)
    else:
        node[str(k)] = _put(node.get(str(k)), rest, value)
    return node


def skeleton(treedef: Any) -> str:
    """A state's tree (a JAX ``PyTreeDef``) in Orbax's layout, each leaf its index in flatten order, as JSON; ""
    when it has none (a custom node with keys Orbax cannot save, or one that will not unflatten around indices):
    the submit goes on, and export refuses that state, pointing at its flat leaves."""
    import jax

    try:
        return json.dumps(skeleton_of(jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))),
                          separators=(",", ":"))
    except Exception:  # noqa: BLE001 - whatever a user's pytree node raises, the job still runs
        return ""


def fill(tree_json: str, leaves: Sequence[Any]) -> Any:
    """The tree :func:`skeleton` recorded, with ``leaves`` (in flatten order) in it. ValueError when they do not fit."""
    shape = json.loads(tree_json)
    used: set[int] = set()

    def put(node: Any) -> Any:
        if isinstance(node, bool) or node is None:
            return None if node is None else node
        if isinstance(node, int):
            if not 0 <= node < len(leaves) or node in used:
                raise ValueError(f"the recorded tree names leaf {node}, and there are {len(leaves)}")
            used.add(node)
            return leaves[node]
        if isinstance(node, list):
            return [put(x) for x in node]
        if isinstance(node, dict):
            return {k: put(v) for k, v in node.items()}
        raise ValueError(f"the recorded tree holds {node!r}")

    out = put(shape)
    if len(used) != len(leaves):
        raise ValueError(f"the recorded tree holds {len(used)} leaves, and there are {len(leaves)}")
    return out


def paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[tuple[str | int, ...], Any]]:
    """``(path, leaf)`` of every leaf of ``tree`` (any pytree: the user's own, or the layout), each path in
    Orbax's key names, so a tree of the user's own types and its layout give the same paths."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(tuple(key_name(k) for k in p), leaf) for p, leaf in flat]


def skeleton_from_structure(text: str) -> str | None:
    """:func:`skeleton` from a state's structure text (``StateProgram.treedef``, ``proto/digest.py``), for a run
    submitted before the client recorded the layout: a tree of dicts, lists, tuples and ``None`` only (a NamedTuple
    or a dataclass node does not name its fields there: None then)."""
    import ast

    pos, leaf = 0, 0

    def node() -> Any:
        nonlocal pos, leaf
        if text.startswith("*", pos):
            pos += 1
            leaf += 1
            return leaf - 1
        open_at = text.index("[", pos)
        kind, depth, quote, i = text[pos:open_at], 0, "", open_at
        while True:  # the static data's closing bracket, past brackets inside it and inside quoted strings
            ch = text[i]
            if quote:
                quote = "" if ch == quote and text[i - 1] != "\\" else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "[":
                depth += 1
            elif ch == "]":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        aux, pos = text[open_at + 1:i], i + 2  # past "](
        children = []
        while text[pos] != ")":
            children.append(node())
            pos += 1 if text[pos] == "," else 0
        pos += 1
        if kind == "dict":
            keys = ast.literal_eval(aux)
            return {str(k): c for k, c in zip(keys, children, strict=True)} if children else None
        if kind in ("list", "tuple"):
            return children or None
        if not children:  # None, an empty NamedTuple such as Optax's EmptyState
            return None
        raise ValueError(f"a {kind} node, whose fields the structure text does not name")

    try:
        out = node()
    except (ValueError, SyntaxError, IndexError):
        return None
    return json.dumps(out, separators=(",", ":")) if pos == len(text) else None

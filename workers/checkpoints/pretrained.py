"""Pretrained weights in: a state's step-0 value read from a plain Orbax checkpoint made outside Rallypoint.

``prog.state(..., init_from=PATH)`` (docs/checkpoints.md "Pretrained weights in"): at submit the client
finds the checkpoint's item directory (:func:`find_item`: a ``StandardCheckpointer``/``PyTreeCheckpointer``
directory, a ``CheckpointManager`` step directory, or a manager's directory, taking its newest step),
matches its tree to the state's abstract value leaf by leaf (:func:`leaf_key`: the key path as strings,
so a list saved by Orbax matches a list or tuple, a dict key ``0`` matches ``"0"``, an optax
``NamedTuple``'s fields match the dict Orbax saved them as, and an ``nnx.State``'s trailing
``value`` matches the pure dict of ``nnx.to_pure_dict``), and computes the value's checksum as any
commit's (:func:`rallypoint.workers.checkpoints.checksums.state_checksum`). The worker that holds the
state reads the same leaves by key (:func:`read_pretrained`) at step 0 and at every load before the
first cut, and refuses bytes of another checksum, so a recovery before the first cut restores the
same bytes and the run stays bitwise.

The checkpoint is read whole into host memory (one process, like a commit read back by
:mod:`rallypoint.workers.checkpoints.restore`), then placed onto the state's layout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rallypoint.basics.errors import RallypointError
from rallypoint.workers.checkpoints.checksums import state_checksum

METADATA = "_METADATA"  # what Orbax writes in a PyTree item's directory
LeafKey = tuple[str, ...]


class PretrainedError(RallypointError):
    """A pretrained checkpoint that cannot be used: missing, not an Orbax checkpoint, unlike the state, changed."""


def _entry(e: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(e, attr):
            return str(getattr(e, attr))
    return str(e)


def leaf_key(path: Sequence[Any]) -> LeafKey:
    """A leaf's key path as strings, a trailing ``value`` (an NNX variable's) dropped: what is matched."""
    key = tuple(_entry(e) for e in path)
    return key[:-1] if len(key) > 1 and key[-1] == "value" else key


def show(key: Sequence[str]) -> str:
    """A leaf key as users read it: ``params/w1``."""
    return "/".join(key) or "(the whole tree)"


def _is_item(d: Path) -> bool:
    return (d / METADATA).is_file()


def _item_of_step(d: Path) -> Path | None:
    """The one PyTree item of a ``CheckpointManager`` step directory (``default``, or its only item)."""
    if _is_item(d / "default"):
        return d / "default"
    items = [c for c in sorted(d.iterdir()) if c.is_dir() and _is_item(c)]
    return items[0] if len(items) == 1 else None


def find_item(path: str | Path) -> Path:
    """The item directory (absolute) holding the tree at ``path``: ``path`` itself, its step's item, or the
    newest step's item of a ``CheckpointManager`` directory.

    Raises:
        PretrainedError: ``path`` does not exist or holds no Orbax checkpoint (naming what to give).
    """
    p = Path(path).expanduser().absolute()
    what = f"init_from {str(path)!r}"
    if not p.exists():
        raise PretrainedError(f"{what} does not exist; give the directory of an Orbax checkpoint "
                              "(ocp.StandardCheckpointer().save(path, tree), or a CheckpointManager's directory)")
    if not p.is_dir():
        raise PretrainedError(f"{what} is a file, not an Orbax checkpoint; give the directory Orbax saved to")
    if _is_item(p):
        return p
    item = _item_of_step(p)
    if item is not None:
        return item
    steps = sorted((int(c.name), c) for c in p.iterdir() if c.is_dir() and c.name.isdigit())
    for _, d in reversed(steps):
        item = _item_of_step(d)
        if item is not None:
            return item
    raise PretrainedError(f"{what} is not an Orbax checkpoint (no {METADATA} in it, nor in a step directory of a "
                          "CheckpointManager); give the directory ocp.StandardCheckpointer().save(path, tree) wrote, "
                          "a CheckpointManager step directory, or the manager's directory (its newest step is taken)")


def _metadata(item: Path) -> Any:
    import orbax.checkpoint as ocp

    try:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            meta = ckptr.metadata(item)
    except Exception as exc:  # any failure to read it: not a checkpoint Orbax can read
        raise PretrainedError(f"init_from {str(item)!r}: Orbax cannot read its metadata ({type(exc).__name__}: "
                              f"{exc}); give a checkpoint saved with Orbax's StandardCheckpointer or "
                              "PyTreeCheckpointer") from exc
    tree = getattr(meta, "item_metadata", meta)
    return getattr(tree, "tree", tree)


def leaf_metadata(item: Path) -> dict[LeafKey, tuple[tuple[int, ...], np.dtype]]:
    """Each leaf of the checkpoint in ``item``, by key: its shape and dtype."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(_metadata(item))[0]
    return {leaf_key(p): (tuple(int(n) for n in m.shape), np.dtype(m.dtype)) for p, m in flat}


def read_pretrained(item: str | Path, keys: Sequence[LeafKey]) -> list[np.ndarray]:
    """The leaves ``keys`` of the checkpoint in ``item``, in that order, as host arrays of their saved dtypes.

    Raises:
        PretrainedError: it cannot be read, or lacks one of ``keys``.
    """
    import jax
    import orbax.checkpoint as ocp

    item = Path(item)
    target = jax.tree_util.tree_map(lambda m: np.empty(tuple(m.shape), np.dtype(m.dtype)), _metadata(item))
    try:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            tree = ckptr.restore(item, args=ocp.args.StandardRestore(target))
    except Exception as exc:  # any failure to read: a checkpoint that cannot be used
        raise PretrainedError(f"init_from {str(item)!r}: Orbax cannot read it ({type(exc).__name__}: {exc})") from exc
    by_key = {leaf_key(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    missing = [show(k) for k in keys if tuple(k) not in by_key]
    if missing:
        raise PretrainedError(f"init_from {str(item)!r} lacks leaves {missing}")
    return [by_key[tuple(k)] for k in keys]


def pretrained_checksum(state: str, leaves: Sequence[Any]) -> str:
    """The checksum of a state's value read from a checkpoint: a commit's of that one state."""
    return state_checksum({state: list(leaves)})


def encode_keys(keys: Sequence[LeafKey]) -> list[str]:
    """Leaf keys as they cross the wire (``StateProgram.init_from.keys``): one JSON list per leaf."""
    return [json.dumps(list(k)) for k in keys]


def decode_keys(texts: Sequence[str]) -> list[LeafKey]:
    out = []
    for t in texts:
        key = json.loads(t)
        if not isinstance(key, list) or not all(isinstance(e, str) for e in key):
            raise PretrainedError(f"init_from: a leaf key {t!r} is not a JSON list of strings")
        out.append(tuple(key))
    return out


def load_pretrained(state: str, path: str, keys: Sequence[str], checksum: str) -> list[np.ndarray]:
    """A worker's read of a state's step-0 value (``StateProgram.init_from``): its leaves in the state's leaf
    order, refused unless they are the bytes the client checksummed at submit.

    Raises:
        PretrainedError: ``path`` is not absolute, has a ``..`` part or cannot be read here (it must be readable at
            the same path by every worker), lacks a leaf, or its bytes changed since the job was submitted.
    """
    p = Path(path)
    if not p.is_absolute() or ".." in p.parts:
        raise PretrainedError(f"state {state!r}: init_from {path!r} must be an absolute path without '..'")
    if not _is_item(p):
        raise PretrainedError(f"state {state!r}: init_from {path!r} is not readable on this worker as an Orbax "
                              "checkpoint; put it where every worker reads it at the same path (a shared file "
                              "system, like the checkpoint directory)")
    leaves = read_pretrained(p, decode_keys(keys))
    got = pretrained_checksum(state, leaves)
    if got != checksum:
        raise PretrainedError(f"state {state!r}: init_from {path!r} holds other bytes than at submit (checksum "
                              f"{got}, submitted {checksum}): it changed since; submit the job again")
    return leaves

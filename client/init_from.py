"""``init_from=PATH`` at submit: a state's pretrained checkpoint found, matched to its ``init`` and checksummed.

:func:`check_init_from` runs while the program compiles, after the state's ``init`` was traced
(``jax.eval_shape``: its tree, shapes and dtypes; ``init`` itself is never run). It refuses, in one
line naming every leaf at fault by its path, a checkpoint that lacks a leaf of the state, has a leaf
the state lacks, or has another shape or dtype; and a path that does not exist or is not an Orbax
checkpoint. Nothing is written or submitted then. A checkpoint that matches is read once to checksum
its bytes (as a commit's): the job carries the item's path, each leaf's key in it and that checksum
(:mod:`rallypoint.workers.checkpoints.pretrained`), and whoever starts the state (a worker, the
reference) reads the same bytes or refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rallypoint.client.errors import ProgramError
from rallypoint.workers.checkpoints.pretrained import (LeafKey, PretrainedError, encode_keys, find_item, leaf_key,
                                                       leaf_metadata, load_pretrained, pretrained_checksum,
                                                       read_pretrained, show)

SHOWN = 6  # mismatches named in the error, the rest counted


@dataclass(frozen=True)
class InitFrom:
    """A state's pretrained start: the checkpoint item's absolute path, the key of each of the state's leaves
    in it (in leaf order), and the checksum of those leaves (:func:`pretrained_checksum`)."""

    path: str
    keys: tuple[LeafKey, ...]
    checksum: str

    def load(self, state: str) -> list[Any]:
        """The leaves, checked against the checksum (what a worker does at step 0)."""
        try:
            return load_pretrained(state, self.path, encode_keys(self.keys), self.checksum)
        except PretrainedError as exc:
            raise ProgramError(str(exc)) from None


def init_from_path(state: str, path: Any) -> str | None:
    """``init_from`` as given to ``prog.state``, checked for its type (None: none); the path is looked at when the
    program compiles."""
    if path is None:
        return None
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ProgramError(f"state {state!r}: init_from must be the path of an Orbax checkpoint (a str or a "
                           f"pathlib.Path), got {path!r}")
    return os.fspath(path)


def _describe(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{dtype}{list(shape)}"


def check_init_from(state: str, path: str, aval: Any) -> InitFrom:
    """The checkpoint at ``path`` matched to ``aval`` (the state's ``jax.eval_shape(init)``) and checksummed.

    Raises:
        ProgramError: ``path`` does not exist or is not an Orbax checkpoint, or its tree, shapes or dtypes
            differ from ``aval``'s, naming each leaf at fault.
    """
    import jax
    import numpy as np

    where = f"state {state!r}: init_from {path!r}"
    try:
        item = find_item(path)
        saved = leaf_metadata(item)
    except PretrainedError as exc:
        raise ProgramError(f"state {state!r}: {exc}") from None
    flat = jax.tree_util.tree_flatten_with_path(aval)[0]
    wanted = [(leaf_key(p), a) for p, a in flat]
    keys = [k for k, _ in wanted]
    twice = sorted({show(k) for k in keys if keys.count(k) > 1})
    if twice:
        raise ProgramError(f"{where}: init's leaves {twice} have the same path as strings; a checkpoint cannot "
                           "tell them apart: rename the keys")
    diff = [f"{show(k)} is missing from the checkpoint" for k in keys if k not in saved]
    diff += [f"{show(k)} is in the checkpoint but not in init()" for k in saved if k not in set(keys)]
    for k, a in wanted:
        if k in saved:
            shape, dtype = saved[k]
            if shape != tuple(a.shape) or dtype != np.dtype(a.dtype):
                diff.append(f"{show(k)} is {_describe(shape, dtype)} in the checkpoint, init() gives "
                            f"{_describe(tuple(a.shape), np.dtype(a.dtype))}")
    if diff:
        more = f" (and {len(diff) - SHOWN} more)" if len(diff) > SHOWN else ""
        raise ProgramError(f"{where} does not match the state's init(): {'; '.join(diff[:SHOWN])}{more}. Save a "
                           "checkpoint of the tree init() returns (same keys, shapes and dtypes), or make init() "
                           "return the checkpoint's tree")
    try:
        leaves = read_pretrained(item, keys)
    except PretrainedError as exc:
        raise ProgramError(f"state {state!r}: {exc}") from None
    return InitFrom(str(item), tuple(keys), pretrained_checksum(state, leaves))

"""What a host source returns, as the flat NumPy leaves the runtime moves (docs/data.md).

A host source ``fn(step, microbatch)`` returns a dict with its declared outputs as keys,
or a single output bare; each output is an array or a pytree of arrays. The client
(sampling the source at step 0 for its shapes), the in-process reference and the
worker's source process all flatten a result the same way, here: outputs in declared
order, each output's leaves in JAX's pytree order, each leaf a C-contiguous NumPy array
of a numeric or boolean dtype. :func:`leaves_checksum` is the digest kept per instance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rallypoint.basics.errors import RallypointError


class HostValueError(RallypointError):
    """A host source returned something that is not its declared outputs as arrays."""


def split_outputs(outputs: Sequence[str], result: Any, what: str) -> list[Any]:
    """``result`` as one value per declared output, in declared order."""
    outs = tuple(outputs)
    if isinstance(result, dict) and set(result) == set(outs):
        return [result[o] for o in outs]
    if len(outs) == 1:
        return [result]
    if isinstance(result, dict):
        raise HostValueError(f"{what} returned outputs {sorted(map(str, result))}, but declares {list(outs)}")
    raise HostValueError(f"{what} must return a dict with keys {list(outs)}, got {type(result).__name__}")


def as_leaf(x: Any, what: str) -> np.ndarray:
    """One leaf as a C-contiguous NumPy array of a numeric or boolean dtype."""
    a = np.asarray(x)
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    if a.dtype.kind not in "biufc":
        raise HostValueError(f"{what} returned a leaf of dtype {a.dtype}: host sources return numeric or "
                             "boolean arrays (tokenize strings in the source)")
    return a


def flat_leaves(outputs: Sequence[str], result: Any, what: str) -> tuple[list[np.ndarray], list[Any]]:
    """``result`` as the flat leaves of every output in order, and each output's pytree structure."""
    import jax

    leaves: list[np.ndarray] = []
    trees: list[Any] = []
    for name, value in zip(outputs, split_outputs(outputs, result, what), strict=True):
        flat, tree = jax.tree_util.tree_flatten(value)
        if not flat:
            raise HostValueError(f"{what}: output {name!r} holds no array")
        leaves += [as_leaf(x, f"{what} (output {name!r})") for x in flat]
        trees.append(tree)
    return leaves, trees


def leaf_bytes(a: np.ndarray) -> memoryview:
    """A leaf's bytes in C order, without a copy for a contiguous leaf (a 0-d one included)."""
    return memoryview(a.reshape(-1)).cast("B")


def leaves_checksum(leaves: Sequence[np.ndarray]) -> str:
    """sha256 over every leaf's dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for a in leaves:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(leaf_bytes(a))
    return h.hexdigest()

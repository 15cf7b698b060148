"""What a host source returns, as the flat NumPy leaves the runtime moves (docs/data.md).

A host source ``fn(step, microbatch)`` returns a dict with its declared outputs as keys,
or a single output bare; each output is an array or a pytree of arrays. The client
(sampling the source at step 0 for its shapes), the in-process reference and the
worker's source process all flatten a result the same way, here: outputs in declared
order, each output's leaves in JAX's pytree order, each leaf a C-contiguous NumPy array
of a numeric or boolean dtype. :func:`leaves_checksum` is the digest kept per instance.

Dtypes are the user's, as the client recorded them at submit: a 64-bit leaf becomes 32-bit only
where the client said so (JAX without ``jax_enable_x64``: ``client/source_checks.py`` warns once),
and :func:`to_dtypes` is that one conversion, applied by the reference and the worker alike.
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


_NARROWER = {np.dtype(a): np.dtype(b) for a, b in (("float64", "float32"), ("int64", "int32"),
                                                     ("uint64", "uint32"), ("complex128", "complex64"))}


def to_dtypes(leaves: Sequence[np.ndarray], dtypes: Sequence[Any]) -> list[np.ndarray]:
    """``leaves`` with each 64-bit leaf whose recorded dtype is its 32-bit counterpart converted to it (the
    client's conversion without x64); any other leaf as it is (a real mismatch stays one, for the caller)."""
    out = list(leaves)
    for i, (a, want) in enumerate(zip(leaves, dtypes)):
        if _NARROWER.get(a.dtype) == np.dtype(want):
            out[i] = a.astype(want)
    return out


def describe_mismatch(got: Sequence[tuple[Any, tuple[int, ...]]], want: Sequence[tuple[Any, tuple[int, ...]]]) -> str:
    """What differs between a source's leaves now (``got``: (dtype, shape) each) and at submit (``want``)."""
    show = lambda d, sh: f"{np.dtype(d)}{list(sh)}"  # noqa: E731
    if len(got) != len(want):
        return f"{len(got)} arrays, where at submit it returned {len(want)}"
    diff = [f"array {i} is {show(*g)}, at submit {show(*w)}" for i, (g, w) in enumerate(zip(got, want))
            if (np.dtype(g[0]), tuple(g[1])) != (np.dtype(w[0]), tuple(w[1]))]
    return "; ".join(diff[:3]) + (f" (and {len(diff) - 3} more)" if len(diff) > 3 else "")


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

"""Loading exported programs onto a slice's devices."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def slice_mesh(devices: Sequence[Any], mesh_shape: Sequence[int], mesh_axes: Sequence[str]) -> Any:
    """A :class:`jax.sharding.Mesh` of ``devices`` with the slice's shape and axes."""
    import jax
    import numpy as np

    n = int(np.prod(mesh_shape)) if len(mesh_shape) else 1
    if len(devices) < n:
        raise ValueError(f"a mesh of shape {tuple(mesh_shape)} needs {n} devices, got {len(devices)}")
    return jax.sharding.Mesh(np.array(list(devices)[:n]).reshape(tuple(mesh_shape)), tuple(mesh_axes))


def load_exported(blob: bytes, mesh: Any) -> Callable[..., Any]:
    """Deserialize an exported program (StableHLO) and bind it to ``mesh``.

    The same bytes run on any devices of the slice's shape: in one process for the
    reference, on a worker's devices on the cluster.
    """
    import jax

    exp = jax.export.deserialize(bytearray(blob))
    return jax.jit(exp.call, in_shardings=exp.in_shardings_jax(mesh), out_shardings=exp.out_shardings_jax(mesh))

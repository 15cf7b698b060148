"""Loading exported programs onto a slice's devices, and the persistent compilation cache."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def configure_compile_cache(directory: str | os.PathLike[str]) -> Path | None:
    """Turn on JAX's persistent compilation cache in ``directory`` ("": leave it off).

    Every XLA executable this process compiles (a node's program or a state init,
    compiled on its first call) is written there, keyed by the program, its compile
    options and device assignment, the jax/jaxlib version and the backend; a later
    process (a reloaded slice, a restore onto a spare, a restarted worker) that
    compiles the same program loads it instead of compiling again. The thresholds are
    lowered so that every program is cached, however small or quick to compile.
    Call it before anything compiles: JAX decides once per process whether the cache
    is used. Returns the directory (absolute), or None when the cache stays off.
    """
    if not str(directory):
        return None
    import jax

    path = Path(directory).expanduser().absolute()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # default 1 s: most nodes compile faster
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor, and none a backend sets
    return path


def slice_mesh(devices: Sequence[Any], mesh_shape: Sequence[int], mesh_axes: Sequence[str]) -> Any:
    """A :class:`jax.sharding.Mesh` of ``devices`` with the slice's shape and axes."""
    import jax
    import numpy as np

    n = int(np.prod(mesh_shape)) if len(mesh_shape) else 1
    if len(devices) < n:
        raise ValueError(f"a mesh of shape {tuple(mesh_shape)} needs {n} devices, got {len(devices)}")
    return jax.sharding.Mesh(np.array(list(devices)[:n]).reshape(tuple(mesh_shape)), tuple(mesh_axes))


class PlatformMismatch(ValueError):
    """An exported program was not lowered for the platform of the devices it is to run on.

    A ``ValueError``: the program's fault, not the worker's
    (:func:`rallypoint.workers.runtime.load.program_fault`), so the job fails and no worker is blamed."""


def check_exported_platform(exp: Any, mesh: Any) -> None:
    """Raise :class:`PlatformMismatch` unless ``exp`` (a deserialized ``jax.export.Exported``) was
    lowered for the platform of ``mesh``'s devices; checked at load, before anything compiles."""
    from rallypoint.workers.platform import export_platform

    here = export_platform(next(iter(mesh.devices.flat)))
    lowered = tuple(getattr(exp, "platforms", ()) or ())
    if lowered and here not in lowered:
        raise PlatformMismatch(f"the program was exported for {', '.join(lowered)}, but this worker's devices are "
                               f"{here}: export the job for the pool's platforms (`rallypoint run --platform "
                               f"{here}`, or compile_program(..., platforms=[...]); docs/platforms.md)")


def load_exported(blob: bytes, mesh: Any) -> Callable[..., Any]:
    """Deserialize an exported program (StableHLO) and bind it to ``mesh``.

    The same bytes run on any devices of the slice's shape: in one process for the
    reference, on a worker's devices on the cluster.

    Raises:
        PlatformMismatch: the program was not lowered for the platform of ``mesh``'s devices.
    """
    import jax

    exp = jax.export.deserialize(bytearray(blob))
    check_exported_platform(exp, mesh)
    return jax.jit(exp.call, in_shardings=exp.in_shardings_jax(mesh), out_shardings=exp.out_shardings_jax(mesh))

"""What the client checks of a source before exporting it (:func:`rallypoint.client.compile.compile_program`).

A host source is called once, for step 0, for its outputs' shapes and dtypes (:func:`host_sample`);
its 64-bit leaves become 32-bit ones unless JAX runs with ``jax_enable_x64``, here, in the reference
and on the worker alike (:func:`rallypoint.workers.sources.values.to_dtypes`), with one warning naming
them. A JAX source is traced: it must depend on ``(step, microbatch)`` (:func:`check_depends_on_step`)
and must not bake in a value its Python computed differently each time it ran (NumPy's random
generator, :func:`check_no_traced_randomness`): both run only once, at export.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from rallypoint.client.errors import ProgramError
from rallypoint.client.refs import NodeSpec


def host_entry(node: NodeSpec) -> tuple[str, str]:
    """Where the worker finds a host source's ``fn``: (the declaring job file, a module-level name bound to it).

    Raises:
        ProgramError: ``fn`` is not bound to a module-level name of a job file.
    """
    g = node.origin or {}
    file = g.get("__file__")
    name = getattr(node.fn, "__name__", None)
    if not (isinstance(name, str) and g.get(name) is node.fn):
        name = next((k for k, v in g.items() if v is node.fn and not k.startswith("__")), None)
    if not file or name is None:
        raise ProgramError(
            f"host source {node.name!r}: its function must be reachable by a module-level name of the job file "
            f"that declares it{f' ({file})' if file else ''}: the worker imports it from the job's code bundle. "
            "Define it (or assign it) at the top level of the file, not inside a function"
        )
    return str(file), name


class DtypeWarning(UserWarning):
    """A host source returned 64-bit arrays while JAX runs without ``jax_enable_x64``: they become 32-bit."""


def sample_host(fn: Callable[[int, int], Any], outputs: Sequence[str], what: str, *, warn: bool = True) -> list[Any]:
    """A host source's outputs for step 0, microbatch 0 as shapes and dtypes (one pytree per output), with
    the dtypes the runtime gives them: JAX's (``jax.dtypes.canonicalize_dtype``: float64 is float32 unless
    ``jax_enable_x64`` is on). ``warn``: say so once, naming the leaves converted.

    Raises:
        ProgramError: the source failed, or returned something that is not its outputs as arrays.
    """
    import jax

    from rallypoint.workers.sources.values import HostValueError, flat_leaves

    try:
        result = fn(0, 0)
    except Exception as exc:  # user code: report it against the source
        raise ProgramError(f"{what} failed for step 0, microbatch 0: {type(exc).__name__}: {exc}") from exc
    try:
        leaves, trees = flat_leaves(outputs, result, what)
    except HostValueError as exc:
        raise ProgramError(str(exc)) from None
    avals = [jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(a.dtype)) for a in leaves]
    out, i, narrowed = [], 0, []
    for name, tree in zip(outputs, trees, strict=True):
        mine = avals[i: i + tree.num_leaves]
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree.unflatten(mine))[0]]
        narrowed += [f"{name}{p} ({leaves[i + j].dtype} -> {a.dtype})" for j, (p, a) in enumerate(zip(paths, mine))
                     if a.dtype != leaves[i + j].dtype]
        out.append(tree.unflatten(mine))
        i += tree.num_leaves
    if narrowed and warn:
        warnings.warn(f"{what} returns 64-bit arrays and JAX runs without jax_enable_x64: {', '.join(narrowed)} "
                      "are converted to 32 bits, in the reference and on the cluster alike (return 32-bit arrays "
                      "to silence this, or enable x64 to keep them)", DtypeWarning, stacklevel=2)
    return out


def host_sample(node: NodeSpec) -> tuple[Any, ...]:
    """A host source's output shapes and dtypes, from calling it for step 0, microbatch 0 on the client."""
    return tuple(sample_host(node.fn, node.outputs, f"host source {node.name!r}"))


def host_layout(node: NodeSpec, out_trees: Sequence[Any],
                outs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], list[Any]]:
    """A host source's layout program (the identity over its outputs), its input trees and flat avals."""
    import jax

    return ((lambda *values: values), tuple(out_trees),
            [leaf for o in node.outputs for leaf in jax.tree_util.tree_leaves(outs[o])])


def _dependent_outputs(jaxpr: Any) -> list[bool]:
    """Whether each output of ``jaxpr`` depends on any of its inputs (an equation with a dependent
    input makes all its outputs dependent: conservative for control flow and calls)."""
    dep = {v for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        if any(not hasattr(v, "val") and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return [not hasattr(v, "val") and v in dep for v in jaxpr.outvars]


_USE_HOST = ("Compute the batch from step and microbatch with JAX (e.g. jax.random.fold_in(key, step)), or read "
             "real data in a host source: prog.source(..., host=True), Program.from_step(..., host_source=True) "
             "(docs/data.md)")


def check_depends_on_step(node: NodeSpec, fn: Callable[..., Any], in_avals: Sequence[Any]) -> None:
    """Refuse a JAX source none of whose outputs depends on ``(step, microbatch)``: traced once at export,
    it would give every step the same batch (NumPy's random generator, file reads and other Python run
    only while tracing); and one whose trace bakes in an array that its Python computes anew each time
    (:func:`check_no_traced_randomness`).

    Raises:
        ProgramError: naming the source and what to do.
    """
    import jax

    def trace() -> Any:  # a new function each time: JAX caches the trace of the same one
        return jax.make_jaxpr(lambda *args: fn(*args))(*in_avals)

    closed = trace()
    if not any(_dependent_outputs(closed.jaxpr)):
        raise ProgramError(
            f"source {node.name!r}: none of its outputs depends on (step, microbatch). A JAX source is traced "
            "once, at export, so every step would get the same batch: NumPy's random generator, file reads "
            f"and any other Python in it run only then. {_USE_HOST}"
        )
    check_no_traced_randomness(node, closed, trace())


def check_no_traced_randomness(node: NodeSpec, first: Any, second: Any) -> None:
    """Refuse a JAX source whose two traces close over different array constants: an array its Python
    computes at trace time (``np.random.rand(4) + step``) is baked into the export as a constant, the same
    at every step, even though the step changes the rest of the batch. Constants that come out the same
    each time (a table, ``np.arange``) are what the user meant and pass.

    Raises:
        ProgramError: naming the source, the constant, and what to do.
    """
    import numpy as np

    a, b = list(first.consts), list(second.consts)
    differ = len(a) != len(b)
    bad = None
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y, equal_nan=True):
            bad, differ = x, True
            break
    if differ:
        what = f" (a {bad.dtype}{list(bad.shape)} array)" if bad is not None else ""
        raise ProgramError(
            f"source {node.name!r}: a value its Python computes at trace time{what} differs each time it is traced "
            "(NumPy's random generator?). A JAX source is traced once, at export: that value would be baked in "
            f"as a constant, the same at every step and on every replay. {_USE_HOST}"
        )

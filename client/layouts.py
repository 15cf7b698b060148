"""A state's layout over its slice's mesh: one ``PartitionSpec`` per leaf, resolved and checked at submit.

A state is replicated over its slice unless it says otherwise. It says so in one of two ways:

* ``prog.state(..., sharding=...)`` (``Program.from_step(..., state_sharding=...)``): one
  ``PartitionSpec`` for every leaf, a tree of them (a prefix of the state's tree, matched by
  key path, so an ``nnx.State`` of specs from ``nnx.get_partition_spec`` matches the pure-dict
  state it describes), or a callable from the abstract state to either. ``axis_rules``
  (``[(logical, mesh axis or None), ...]``, Flax's logical axis rules) turn logical names in
  the specs into the slice's mesh axes.
* ``init`` itself lays its result out: a ``jax.jit(init, out_shardings=...)``, or
  ``with_sharding_constraint`` inside it (what Flax NNX does for variables carrying sharding
  metadata). The slice's mesh is set (``jax.set_mesh``) while ``init`` is traced, so bare
  ``PartitionSpec``\\ s in it name the slice's axes. :func:`init_layout` compiles the init
  once and takes the layouts XLA gives its outputs.

:func:`check_layout` refuses, naming the state, the leaf's path, the axis and the device
count, a spec that names an axis the mesh lacks, has more entries than the leaf has
dimensions, or does not divide a dimension on one of the device counts the slice may run on.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from rallypoint.client.errors import ProgramError

AxisRules = Sequence[tuple[str, str | None]]
"""Logical axis name -> mesh axis name (or None: not split), as Flax's logical axis rules give them."""


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _key(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(_key(e) for e in path)


def leaf_paths(aval: Any) -> list[str]:
    """Each leaf's path in ``aval`` as users read it (``['params']['w']``), in leaf order."""
    import jax

    return [jax.tree_util.keystr(p) or "(the state itself)" for p, _ in jax.tree_util.tree_flatten_with_path(aval)[0]]


def declared_specs(state: str, declared: Any, aval: Any) -> list[PartitionSpec]:
    """The spec of every leaf of ``aval`` (in leaf order) from what the user declared.

    Raises:
        ProgramError: a spec tree that does not match the state's tree, naming the path at fault.
    """
    import jax

    where = f"state {state!r}"
    if callable(declared) and not _is_spec(declared):
        try:
            declared = declared(aval)
        except Exception as exc:  # user code: report it against the state
            raise ProgramError(f"{where}: its sharding function failed on the abstract state: "
                               f"{type(exc).__name__}: {exc}") from exc
    flat = jax.tree_util.tree_flatten_with_path(aval)[0]
    if _is_spec(declared):
        return [declared or PartitionSpec() for _ in flat]
    given = jax.tree_util.tree_flatten_with_path(declared, is_leaf=_is_spec)[0]
    bad = next(((p, s) for p, s in given if not _is_spec(s)), None)
    if bad is not None:
        raise ProgramError(f"{where}: sharding must hold PartitionSpecs (or None), but {jax.tree_util.keystr(bad[0])} "
                           f"is {type(bad[1]).__name__}")
    specs = {_path(p): s for p, s in given}
    used: set[tuple[str, ...]] = set()
    out: list[PartitionSpec] = []
    for p, _ in flat:
        key = _path(p)
        match = next((key[:n] for n in range(len(key), -1, -1) if key[:n] in specs), None)
        if match is None:
            raise ProgramError(f"{where}: its sharding tree has no spec for leaf {jax.tree_util.keystr(p)}; give "
                               "one per leaf (or per subtree, or one PartitionSpec for the whole state)")
        used.add(match)
        out.append(specs[match] or PartitionSpec())
    unused = [k for k in specs if k not in used]
    if unused:
        raise ProgramError(f"{where}: its sharding tree names {''.join(f'[{k!r}]' for k in unused[0]) or 'a path'}, "
                           "which is no leaf or subtree of the state; the spec tree must follow the state's tree")
    return out


def check_rules(state: str, rules: Any) -> tuple[tuple[str, str | None], ...] | None:
    """``rules`` as a tuple of (logical name, mesh axis or None) pairs (None: none given).

    Raises:
        ProgramError: anything else, naming the state.
    """
    if rules is None:
        return None
    ok = not isinstance(rules, str | bytes | Mapping) and isinstance(rules, Sequence) and all(
        isinstance(r, tuple | list) and len(r) == 2 and isinstance(r[0], str) and (r[1] is None or isinstance(r[1], str))
        for r in rules)
    if not ok:
        raise ProgramError(f"state {state!r}: axis_rules must be a sequence of (logical name, mesh axis or None) "
                           f"pairs, such as [('embed', None), ('mlp', 'model')]; got {rules!r}")
    return tuple((str(a), b) for a, b in rules)


def apply_rules(state: str, specs: Sequence[PartitionSpec], rules: Any) -> list[PartitionSpec]:
    """``specs`` with logical axis names replaced by mesh axes as ``rules`` say (None: unchanged)."""
    checked = check_rules(state, rules)
    if checked is None:
        return list(specs)
    table: dict[str, str | None] = {}
    for logical, axis in checked:
        table.setdefault(logical, axis)  # the first rule for a name wins, as in Flax

    def one(entry: Any) -> Any:
        if entry is None:
            return None
        names = entry if isinstance(entry, tuple) else (entry,)
        mapped = tuple(m for m in (table.get(n, n) for n in names) if m is not None)
        return None if not mapped else mapped[0] if len(mapped) == 1 else mapped

    return [PartitionSpec(*(one(e) for e in s)) for s in specs]


def init_layout(init_flat: Callable[..., Any], mesh: Any, rules: AxisRules | None = None) -> list[PartitionSpec] | None:
    """How ``init`` lays out its own leaves on ``mesh`` (compiled once, traced as :func:`traced_on` says); None
    when it lays out none of them (every leaf as XLA likes it: the state is replicated)."""
    import jax

    with traced_on(mesh, rules):
        compiled = jax.jit(init_flat).lower().compile()
    out, any_named = [], False
    for s in compiled.output_shardings:
        spec = getattr(s, "spec", None)
        if isinstance(s, jax.sharding.NamedSharding) and spec is not None:
            any_named = any_named or any(e is not None for e in spec)
            out.append(PartitionSpec(*spec))
        else:
            out.append(PartitionSpec())
    return out if any_named else None


@contextlib.contextmanager
def traced_on(mesh: Any, rules: AxisRules | None = None) -> Iterator[None]:
    """The context user code is traced in for a slice: its mesh set (a ``jax.sharding.Mesh``: ``jax.set_mesh``;
    an ``AbstractMesh``: ``jax.sharding.use_abstract_mesh``, no devices needed), so sharding annotations name its
    axes, and, when the job uses Flax and gives ``rules``, Flax's logical axis rules set to them (so NNX variables
    annotated with logical names are created laid out over the mesh)."""
    import jax

    with contextlib.ExitStack() as stack:
        if isinstance(mesh, jax.sharding.AbstractMesh):
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
        else:
            stack.enter_context(jax.set_mesh(mesh))
        nnx = sys.modules.get("flax.nnx")
        if rules is not None and nnx is not None and hasattr(nnx, "logical_axis_rules"):
            stack.enter_context(nnx.logical_axis_rules(list(rules)))
        yield


def abstract_mesh(mesh_shape: Sequence[int], mesh_axes: Sequence[str]) -> Any:
    """The slice's mesh with no devices (``AxisType.Auto`` axes, as :func:`slice_mesh` makes them)."""
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(tuple(mesh_shape), tuple(mesh_axes), axis_types=(AxisType.Auto,) * len(mesh_axes))


def _axis_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def check_layout(state: str, specs: Sequence[PartitionSpec], aval: Any, mesh_axes: Sequence[str],
                 shapes: Mapping[int, Sequence[int]]) -> None:
    """Refuse a layout the slice cannot keep on one of its device counts (``shapes``: count -> mesh shape).

    Raises:
        ProgramError: naming the state, the leaf's path, the axis and the count, and what to change.
    """
    import jax

    leaves = jax.tree_util.tree_leaves(aval)
    paths = leaf_paths(aval)
    for path, spec, leaf in zip(paths, specs, leaves, strict=True):
        where = f"state {state!r}, leaf {path} {leaf.dtype}{list(leaf.shape)}"
        if len(spec) > len(leaf.shape):
            raise ProgramError(f"{where}: its spec {spec} has {len(spec)} entries but the leaf has "
                               f"{len(leaf.shape)} dimensions; give at most one entry per dimension")
        seen: set[str] = set()
        for entry in spec:
            for axis in _axis_names(entry):
                if axis not in mesh_axes:
                    raise ProgramError(f"{where}: its spec {spec} names axis {axis!r}, which the slice's mesh "
                                       f"lacks (its axes: {tuple(mesh_axes)}); use one of those, or map it with "
                                       "axis_rules")
                if axis in seen:
                    raise ProgramError(f"{where}: its spec {spec} uses axis {axis!r} twice; a mesh axis splits "
                                       "at most one dimension")
                seen.add(axis)
        for count, shape in shapes.items():
            sizes = dict(zip(mesh_axes, shape, strict=True))
            for dim, entry in enumerate(spec):
                parts = 1
                for axis in _axis_names(entry):
                    parts *= sizes[axis]
                if leaf.shape[dim] % parts:
                    raise ProgramError(
                        f"{where}: dimension {dim} ({leaf.shape[dim]}) does not divide over axis "
                        f"{entry!r} ({parts} ways) on {count} devices (mesh {tuple(shape)}); make it a multiple "
                        f"of {parts}, split it over another axis, or raise the slice's minimum device count")


def resolve_layout(state: str, declared: Any, rules: AxisRules | None, aval: Any,
                   init_flat: Callable[..., Any], mesh: Any) -> list[PartitionSpec]:
    """The state's spec per leaf: as declared, else as its ``init`` lays it out, else replicated."""
    if declared is not None:
        specs = declared_specs(state, declared, aval)
    else:
        try:
            found = init_layout(init_flat, mesh, rules)
        except Exception as exc:  # user code: report it against the state
            raise ProgramError(f"init of state {state!r} failed to compile on its slice's mesh: "
                               f"{type(exc).__name__}: {exc}") from exc
        specs = found if found is not None else [PartitionSpec() for _ in leaf_paths(aval)]
    return apply_rules(state, specs, rules)


def is_sharded(specs: Sequence[PartitionSpec]) -> bool:
    """Whether any leaf is split over a mesh axis."""
    return any(e is not None for s in specs for e in s)

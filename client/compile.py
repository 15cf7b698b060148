"""From a :class:`~rallypoint.client.program.Program` to exported programs: tracing, checks, ``jax.export``.

Every node (and every state's ``init``) is traced with :func:`jax.eval_shape` in
topological order, so a shape or dtype mismatch is found before anything runs and
reported naming the node. Each is then jitted with the shardings of its slice's
mesh and exported with :mod:`jax.export`: programs cross the wire as serialized
StableHLO bytes, never as pickle. Each is lowered for the platforms of the pool the job
goes to (``platforms``: ``jax.export`` cross-platform lowering, so a CPU-only client exports
for CUDA or TPU workers), and records them (:attr:`CompiledNode.platforms`).

Calling convention of an exported node: positional arguments in the order of
``input_names`` (sources: ``step``, ``microbatch`` as int32 scalars), each a
pytree; the result is a tuple in the order of ``outputs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rallypoint.client.init_from import InitFrom, check_init_from
from rallypoint.client.layouts import check_layout, check_rules, is_sharded, resolve_layout, traced_on
from rallypoint.client.program import Gathered, NodeSpec, Program, ProgramError, Ref, StateRef
from rallypoint.client.source_checks import check_depends_on_step, host_entry, host_layout, host_sample
from rallypoint.workers.programs import slice_mesh as mesh_over
from rallypoint.workers.platform import PLATFORMS

def ensure_host_devices(count: int) -> None:
    """Make JAX see at least ``count`` CPU devices; possible until JAX runs its first operation.

    Raises:
        ProgramError: JAX already started with fewer devices.
    """
    import os
    import re

    import jax

    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if not (forced and int(forced.group(1)) >= count) and jax.config.jax_num_cpu_devices < count:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:
            pass  # JAX already started: what it has is checked below
    have = len(jax.devices())
    if have < count:
        raise ProgramError(
            f"this process needs {count} JAX devices but JAX started with {have}; run it through "
            f"`rallypoint run`, or set XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts"
        )


@dataclass(frozen=True)
class CompiledNode:
    """One node ready to ship: its exported program and its interface."""

    name: str
    slice: str
    per: str
    every: int
    input_names: tuple[str, ...]
    inputs: dict[str, Any]  # input name -> Ref | StateRef | Gathered (as declared)
    outputs: tuple[str, ...]
    updates: dict[str, str]
    is_source: bool
    exported: bytes
    out_avals: dict[str, Any]  # output name -> pytree of jax.ShapeDtypeStruct
    in_trees: tuple[Any, ...]  # treedef of each input, in input_names order
    out_trees: tuple[Any, ...]  # treedef of each output, in outputs order
    variants: dict[int, bytes] = field(default_factory=dict)  # other device counts of the slice -> exported
    platforms: tuple[str, ...] = ()  # what it was lowered for (jax.export names: cpu, cuda, rocm, tpu)
    host: tuple[str, str] | None = None  # a host source: (its job file's path, the module-level name of fn)
    prefetch: int = 0  # a host source: instances read ahead (0: the default)
    clock: bool = False  # a source given the step itself, never a skip's position (recovery/skips.py)

    def flatten_inputs(self, args: Sequence[Any]) -> list[Any]:
        """Input pytrees (in ``input_names`` order) -> the flat leaves the exported program takes."""
        import jax

        leaves: list[Any] = []
        for arg, tree in zip(args, self.in_trees, strict=True):
            flat, got = jax.tree_util.tree_flatten(arg)
            if got != tree:
                raise ProgramError(f"node {self.name!r}: an input has structure {got}, expected {tree}")
            leaves += flat
        return leaves

    def unflatten_outputs(self, leaves: Sequence[Any]) -> dict[str, Any]:
        """The exported program's flat results -> output name -> pytree."""
        return dict(zip(self.outputs, _unflatten_all(self.out_trees, leaves), strict=True))


@dataclass(frozen=True)
class CompiledState:
    """A state: its exported ``init`` (no arguments, flat leaves out) and its structure."""

    name: str
    slice: str
    exported_init: bytes
    aval: Any
    tree: Any
    producer: tuple[str, str] | None
    variants: dict[int, bytes] = field(default_factory=dict)  # other device counts of the slice -> exported init
    platforms: tuple[str, ...] = ()  # what its init was lowered for
    specs: tuple[Any, ...] = ()  # its layout: a PartitionSpec per leaf over the slice's mesh (client/layouts.py)
    init_from: InitFrom | None = None  # its step-0 value is a pretrained checkpoint's (client/init_from.py)

    @property
    def sharded(self) -> bool:
        """Whether some leaf is split over a mesh axis (else the state is replicated over its slice)."""
        return is_sharded(self.specs)


def _unflatten_all(trees: Sequence[Any], leaves: Sequence[Any]) -> list[Any]:
    out, i = [], 0
    for tree in trees:
        n = tree.num_leaves
        out.append(tree.unflatten(list(leaves[i : i + n])))
        i += n
    if i != len(leaves):
        raise ProgramError(f"expected {i} values, got {len(leaves)}")
    return out


@dataclass(frozen=True)
class CompiledProgram:
    """Everything a runtime needs, as plain data and serialized StableHLO."""

    program: Program
    order: tuple[str, ...]
    nodes: dict[str, CompiledNode]
    states: dict[str, CompiledState]
    platforms: tuple[str, ...] = ()  # every program was lowered for these

    @property
    def name(self) -> str:
        return self.program.name


EXPORT_PLATFORMS = PLATFORMS
"""The platforms :func:`compile_program` can lower for (``jax.export``'s names, as workers register them;
``gpu`` means ``cuda``)."""


def export_platforms(platforms: Sequence[str] | None) -> tuple[str, ...]:
    """``platforms`` checked and without repeats, in order (``gpu`` -> ``cuda``); None or empty:
    this process's own platform (``jax.export.default_export_platform()``).

    Raises:
        ProgramError: an unknown platform, naming the known ones.
    """
    if not platforms:
        import jax

        return (jax.export.default_export_platform(),)
    out: list[str] = []
    for p in platforms:
        name = {"gpu": "cuda"}.get(p.strip().lower(), p.strip().lower())
        if name not in EXPORT_PLATFORMS:
            raise ProgramError(f"cannot export for platform {p!r}: give some of {', '.join(EXPORT_PLATFORMS)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def slice_mesh(program: Program, slice_name: str, devices: Sequence[Any] | None = None) -> Any:
    """The :class:`jax.sharding.Mesh` of a slice over ``devices`` (default: the first N local ones)."""
    import jax

    spec = program.slices[slice_name]
    devs = list(devices) if devices is not None else jax.devices()
    if len(devs) < spec.devices:
        raise ProgramError(f"slice {slice_name!r} needs {spec.devices} devices, this process has {len(devs)}")
    return mesh_over(devs, spec.mesh_shape, spec.mesh_axes)


def _other_meshes(program: Program, slice_name: str) -> dict[int, Any]:
    """The slice's meshes for every device count but its own (``devices=(min, max)``), by count."""
    import jax

    spec = program.slices[slice_name]
    return {c: mesh_over(jax.devices(), spec.mesh_shape_for(c), spec.mesh_axes) for c in spec.device_counts()[1:]}


def _sharding(mesh: Any, spec: Any) -> Any:
    import jax

    return jax.sharding.NamedSharding(mesh, spec if spec is not None else jax.sharding.PartitionSpec())


def _normalize(node: NodeSpec, result: Any) -> tuple[Any, ...]:
    outs = node.outputs
    if len(outs) == 1 and not (isinstance(result, dict) and set(result) == set(outs)):
        return (result,)  # a single output returned bare (it may itself be a dict pytree)
    if isinstance(result, dict):
        if set(result) != set(outs):
            raise ProgramError(
                f"node {node.name!r} returned outputs {sorted(result)}, but declares {list(outs)}"
            )
        return tuple(result[o] for o in outs)
    if len(outs) == 1:
        return (result,)
    if isinstance(result, tuple) and len(result) == len(outs):
        return result
    raise ProgramError(f"node {node.name!r} must return a dict with keys {list(outs)}")


def node_callable(node: NodeSpec, input_names: Sequence[str]) -> Callable[..., tuple[Any, ...]]:
    """``node.fn`` taking its inputs positionally (pytrees) and returning a tuple of outputs."""
    if node.is_source:
        return lambda step, microbatch: _normalize(node, node.fn(step, microbatch))
    names = tuple(input_names)
    return lambda *args: _normalize(node, node.fn(**dict(zip(names, args, strict=True))))


def flat_callable(fn: Callable[..., tuple[Any, ...]], in_trees: Sequence[Any]) -> Callable[..., tuple[Any, ...]]:
    """``fn`` over flat leaves: what is exported (optimizer states and other pytrees of user
    types need no registration to cross the wire; only arrays do)."""
    import jax

    def flat(*leaves: Any) -> tuple[Any, ...]:
        outs = fn(*_unflatten_all(in_trees, leaves))
        return tuple(leaf for out in outs for leaf in jax.tree_util.tree_leaves(out))

    return flat


def _describe(tree: Any) -> str:
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and not isinstance(tree, dict | list | tuple):
        return f"{leaves[0].dtype}{list(leaves[0].shape)}"
    return str(jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


def _same_avals(a: Any, b: Any) -> bool:
    import jax

    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(la, lb, strict=True))


Layouts = tuple[tuple[Any, ...], tuple[Any, ...]]
"""A node's PartitionSpec per flat input leaf and per flat output leaf."""


def _node_layouts(program: Program, node: NodeSpec, names: Sequence[str], in_trees: Sequence[Any],
                  out_trees: Sequence[Any], state_specs: Mapping[str, tuple[Any, ...]]) -> Layouts:
    """A node's layouts: what it declares for an input or output (one spec for all its leaves), else a state's
    layout for a state it reads on its own slice or updates, else replicated.

    Raises:
        ProgramError: the node reads a sharded state of another slice and declares no layout for it.
    """
    ins: list[Any] = []
    for arg, tree in zip(names, in_trees, strict=True):
        src = node.inputs.get(arg)
        if arg in node.shardings or not isinstance(src, StateRef):
            ins += [node.shardings.get(arg)] * tree.num_leaves
        elif program.states[src.name].slice == node.slice:
            ins += state_specs[src.name]
        elif is_sharded(state_specs[src.name]):
            raise ProgramError(
                f"node {node.name!r} on slice {node.slice!r} reads state {src.name!r}, which is sharded over slice "
                f"{program.states[src.name].slice!r}: declare how it lies on {node.slice!r} "
                f"(shardings={{{arg!r}: PartitionSpec(...)}}: it is sent there whole), or read it on its own slice")
        else:
            ins += [None] * tree.num_leaves
    updated = dict(node.updates)
    outs: list[Any] = []
    for out, tree in zip(node.outputs, out_trees, strict=True):
        if out in updated and out not in node.shardings:
            outs += state_specs[updated[out]]
        else:
            outs += [node.shardings.get(out)] * tree.num_leaves
    return tuple(ins), tuple(outs)


def _shardings_on(mesh: Any, layouts: Layouts) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tuple(_sharding(mesh, s) for s in layouts[0]), tuple(_sharding(mesh, s) for s in layouts[1])


def compile_program(program: Program, *, platforms: Sequence[str] | None = None) -> CompiledProgram:
    """Validate, trace and export every node and state init of ``program``.

    ``platforms``: lower every program for these (e.g. ``("cuda", "cpu")``: the platforms of
    the pool the job goes to; :func:`export_platforms`); None: this process's own platform.

    Raises:
        ProgramError: naming the node, edge or state at fault, or an unknown platform.
    """
    program.validate()
    targets = export_platforms(platforms)
    ensure_host_devices(max(s.devices for s in program.slices.values()))
    import jax
    import jax.numpy as jnp

    state_avals: dict[str, Any] = {}
    state_specs: dict[str, tuple[Any, ...]] = {}
    rules_of: dict[str, Any] = {}
    states: dict[str, CompiledState] = {}
    for st in program.states.values():
        mesh = slice_mesh(program, st.slice)
        rules = check_rules(st.name, st.axis_rules)
        if rules is not None:  # a slice's nodes are traced with the axis rules of its first state that has some
            rules_of.setdefault(st.slice, rules)
        try:
            with traced_on(mesh, rules):
                aval = jax.eval_shape(st.init)
        except Exception as exc:  # user code: report it against the state
            raise ProgramError(f"init of state {st.name!r} failed to trace: {type(exc).__name__}: {exc}") from exc
        state_avals[st.name] = aval
        init_from = check_init_from(st.name, st.init_from, aval) if st.init_from is not None else None
        tree = jax.tree_util.tree_structure(aval)
        init_flat = flat_callable(lambda init=st.init: (init(),), [])
        specs = tuple(resolve_layout(st.name, st.sharding, rules, aval, init_flat, mesh))
        sl = program.slices[st.slice]
        check_layout(st.name, specs, aval, sl.mesh_axes, {c: sl.mesh_shape_for(c) for c in sl.device_counts()})
        state_specs[st.name] = specs

        def export_init(on: Any, init_flat: Any = init_flat, specs: tuple[Any, ...] = specs,
                        rules: Any = rules) -> Any:
            with traced_on(on, rules):  # bare PartitionSpecs in init name this mesh's axes
                return jax.export.export(jax.jit(init_flat, out_shardings=tuple(_sharding(on, s) for s in specs)),
                                         platforms=targets)()

        exported = export_init(mesh)
        variants = {c: bytes(export_init(other).serialize()) for c, other in _other_meshes(program, st.slice).items()}
        states[st.name] = CompiledState(
            st.name, st.slice, bytes(exported.serialize()), aval, tree, program.producer_of(st.name), variants,
            tuple(exported.platforms), specs, init_from,
        )

    out_avals: dict[str, dict[str, Any]] = {}
    nodes: dict[str, CompiledNode] = {}
    order = program.topo_order()
    m = program.microbatches
    for name in order:
        node = program.nodes[name]
        mesh = slice_mesh(program, node.slice)
        if node.is_source:
            names: tuple[str, ...] = ("step", "microbatch")
            in_avals = [jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)]
        else:
            names = tuple(node.inputs)
            in_avals = []
            for arg in names:
                src = node.inputs[arg]
                if isinstance(src, StateRef):
                    in_avals.append(state_avals[src.name])
                elif isinstance(src, Gathered):
                    one = out_avals[src.ref.node][src.ref.output]
                    in_avals.append(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((m, *a.shape), a.dtype), one))
                else:
                    assert isinstance(src, Ref)
                    in_avals.append(out_avals[src.node][src.output])
        fn = node_callable(node, names)
        try:
            if node.host:
                result = host_sample(node)
            else:
                with traced_on(mesh, rules_of.get(node.slice)):
                    result = jax.eval_shape(fn, *in_avals)
                if node.is_source:
                    check_depends_on_step(node, fn, in_avals)
        except ProgramError:
            raise
        except Exception as exc:  # user code: report it against the node, with what it was given
            given = ", ".join(f"{a}={_describe(v)}" for a, v in zip(names, in_avals, strict=True))
            raise ProgramError(
                f"node {name!r} failed to trace with inputs ({given}): {type(exc).__name__}: {exc}"
            ) from exc
        out_avals[name] = dict(zip(node.outputs, result, strict=True))
        for out, st in node.updates.items():
            if not _same_avals(out_avals[name][out], state_avals[st]):
                raise ProgramError(
                    f"node {name!r} produces state {st!r} as {_describe(out_avals[name][out])}, but its init is "
                    f"{_describe(state_avals[st])}: the next value must keep the shape and dtype"
                )
        in_trees = tuple(jax.tree_util.tree_structure(a) for a in in_avals)
        out_trees = tuple(jax.tree_util.tree_structure(out_avals[name][o]) for o in node.outputs)
        layouts = _node_layouts(program, node, names, in_trees, out_trees, state_specs)
        in_sh, out_sh = _shardings_on(mesh, layouts)
        flat_avals = [leaf for a in in_avals for leaf in jax.tree_util.tree_leaves(a)]
        if node.host:  # what is exported is its layout: the identity over its outputs, as they lie on the slice
            fn, in_trees, flat_avals = host_layout(node, out_trees, out_avals[name])
            in_sh = out_sh
        with traced_on(mesh, rules_of.get(node.slice)):
            exported = jax.export.export(
                jax.jit(flat_callable(fn, in_trees), in_shardings=in_sh, out_shardings=out_sh), platforms=targets
            )(*flat_avals)
        variants: dict[int, bytes] = {}
        for c, other in _other_meshes(program, node.slice).items():  # the same program on fewer devices
            sh_in, sh_out = _shardings_on(other, layouts)
            sh_in = sh_out if node.host else sh_in
            try:
                with traced_on(other, rules_of.get(node.slice)):
                    variants[c] = bytes(jax.export.export(jax.jit(flat_callable(fn, in_trees), in_shardings=sh_in,
                                                                  out_shardings=sh_out),
                                                          platforms=targets)(*flat_avals).serialize())
            except Exception as exc:  # e.g. a dimension the smaller mesh does not divide
                raise ProgramError(f"node {name!r} cannot run on {c} devices of slice {node.slice!r} (declared "
                                   f"devices=(min, max)): {type(exc).__name__}: {exc}; raise the minimum") from exc
        if node.host:  # the calling convention the runtime sees is still fn(step, microbatch)
            in_trees = tuple(jax.tree_util.tree_structure(a) for a in in_avals)
        nodes[name] = CompiledNode(
            name=name, slice=node.slice, per=node.per, every=node.every, input_names=names,
            inputs=dict(node.inputs), outputs=node.outputs, updates=dict(node.updates), is_source=node.is_source,
            exported=bytes(exported.serialize()), out_avals=out_avals[name], in_trees=in_trees, out_trees=out_trees,
            variants=variants, platforms=tuple(exported.platforms),
            host=host_entry(node) if node.host else None, prefetch=node.prefetch, clock=node.clock,
        )
    for mname, ref in program.metrics.items():
        aval = out_avals[ref.node][ref.output]
        if getattr(aval, "shape", None) != ():
            raise ProgramError(f"metric {mname!r} reads {ref}, which is {_describe(aval)}; a metric must be a scalar")
    return CompiledProgram(program=program, order=tuple(order), nodes=nodes, states=states, platforms=targets)

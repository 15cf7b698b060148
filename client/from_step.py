"""A whole program from the user's own SPMD train step: :meth:`Program.from_step`.

A team with one ``train_step(state, batch) -> (state, metrics)`` gets remapping, replay,
checkpoints, drains and shrink/grow without rewriting the step into nodes. The program
it builds is one slice holding everything::

    slice  "main"   devices (or (min, max)) over mesh_axes
    state  "state"  the whole train state pytree, init()
    source "batch"  source(step, 0): a dict of arrays, one output per key (per step)
    node   "step"   train_step(state, batch), unchanged; output "state" updates the state,
                    one more output per metric, each registered as a metric of its own name

The batch and the metrics' names are found at build time: a host source is called once for
step 0 (a JAX source and the step are traced with :func:`jax.eval_shape`), so a step that
returns something else than ``(state, metrics)`` fails here, naming what is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from rallypoint.basics.errors import RallypointError
from rallypoint.client.errors import ProgramError
from rallypoint.client.layouts import abstract_mesh, check_rules, traced_on
from rallypoint.etcd.keys import check_name

SLICE, STATE, SOURCE, NODE = "main", "state", "batch", "step"
"""The names of the program's one slice, state, source and node (``--fail kill:main@12``)."""


def from_step(
    cls: Any, name: str, *, init: Callable[[], Any], train_step: Callable[[Any, Any], Any],
    source: Callable[[int, int], Any], steps: int, devices: int | tuple[int, int] = 1,
    mesh_axes: Sequence[str] = ("data",), mesh_shape: Sequence[int] | None = None,
    batch_sharding: PartitionSpec | Mapping[str, PartitionSpec] | None = None, host_source: bool = True,
    prefetch: int = 0, checkpoint_every: int = 10, state_sharding: Any = None,
    axis_rules: Sequence[tuple[str, str | None]] | None = None, init_from: Any = None,
) -> Any:
    """The one-slice program running ``train_step`` unchanged (``cls``: :class:`Program`).

    Args:
        name: the job's name.
        init: ``init()`` -> the whole train state (a pytree of arrays: parameters, optimizer
            state, step counters); traced and exported like any state's init.
        train_step: ``train_step(state, batch) -> (new_state, metrics)``: a pure JAX function
            (jitted or not); ``new_state`` keeps ``init``'s structure, shapes and dtypes and
            ``metrics`` is a dict of scalars (may be empty), each reported under its key.
        source: ``source(step, microbatch)`` -> the step's batch, a dict of arrays (or one array
            or another pytree); ``microbatch`` is always 0. ``host_source=True``: plain Python
            returning NumPy arrays, run on the worker, defined at the top level of the job file
            (the worker imports it by name); ``False``: a JAX function of the step.
        steps: training steps.
        devices: the slice's device count, or ``(min, max)``: placed on ``max``, it may shrink
            to as few as ``min`` after a loss (``on_no_spare='shrink'``) and grows back.
        mesh_axes, mesh_shape: the slice's mesh (default: one axis ``"data"`` over every device).
        batch_sharding: how the batch lies over the mesh: one PartitionSpec for every key, or a
            dict key -> PartitionSpec (keys left out take the default). Default: each key's
            arrays split along their first axis over the first mesh axis (data parallelism),
            scalars replicated.
        state_sharding: how the train state lies over the mesh (FSDP, tensor parallelism): one
            PartitionSpec for every leaf, a tree of them following the state's tree (an
            ``nnx.get_partition_spec`` of the model's state), or a callable from the abstract state
            to either. Default: as ``init`` lays its result out (Flax NNX variables carrying sharding
            metadata, ``with_sharding_constraint``, ``jax.jit(out_shardings=...)``: the slice's mesh is
            set while ``init`` is traced), else replicated. See :mod:`rallypoint.client.layouts`.
        axis_rules: logical axis name -> mesh axis pairs applied to the state's specs (Flax's
            logical axis rules).
        host_source: whether ``source`` is a host source (see ``source``).
        prefetch: a host source's instances read ahead on the worker (0: the default).
        checkpoint_every: save the state every this many steps.
        init_from: the path of a plain Orbax checkpoint of the tree ``init`` returns (pretrained weights):
            the state starts from its values; ``init`` is traced for the tree and the layout, not run
            (docs/program-api.md "Starting from pretrained weights").

    Raises:
        ProgramError: naming the argument, the batch key or the metric at fault.
    """
    for arg, fn in (("init", init), ("train_step", train_step), ("source", source)):
        if not callable(fn):
            raise ProgramError(f"Program.from_step {name!r}: {arg} must be callable, got {fn!r}")
    if not isinstance(host_source, bool):
        raise ProgramError(f"Program.from_step {name!r}: host_source must be True or False, got {host_source!r}")
    if not host_source and prefetch:
        raise ProgramError(f"Program.from_step {name!r}: prefetch reads a host source ahead; a JAX source "
                           "(host_source=False) takes none")
    if isinstance(mesh_axes, str) or not all(isinstance(a, str) for a in mesh_axes):
        raise ProgramError(f"Program.from_step {name!r}: mesh_axes must be a sequence of axis names such as "
                           f"('data',), got {mesh_axes!r}")
    prog = cls(name, steps=steps, checkpoint_every=checkpoint_every)
    where = f"Program.from_step {name!r}"
    sl = prog.slice(SLICE, devices, mesh_axes=tuple(mesh_axes), mesh_shape=mesh_shape)
    rules = check_rules(STATE, axis_rules)
    with traced_on(abstract_mesh(prog.slices[sl].mesh_shape, prog.slices[sl].mesh_axes), rules):  # as compile
        state_aval = _trace(where, "init()", init)
        batch_aval = _sample_host(where, source) if host_source else _trace_source(where, source)
        keys = _batch_keys(where, batch_aval)
        outputs = keys if keys is not None else (SOURCE,)
        shardings = _batch_shardings(where, batch_sharding, batch_aval, keys, prog.slices[sl].mesh_axes[0])
        metrics = _metric_outputs(where, train_step, state_aval, batch_aval)

    state = prog.state(STATE, slice=sl, init=init, sharding=state_sharding, axis_rules=axis_rules,
                       init_from=init_from)
    batch = prog.source(SOURCE, source, slice=sl, outputs=outputs, per="step", shardings=shardings,
                        host=host_source, prefetch=prefetch)
    inputs = {_input(o, keys): batch[o] for o in outputs}
    node = prog.node(NODE, _step_node(train_step, keys, metrics), slice=sl, inputs={STATE: state, **inputs},
                     outputs=(STATE, *metrics.values()), updates={STATE: state},
                     shardings={_input(o, keys): spec for o, spec in shardings.items()})
    for key, out in metrics.items():
        prog.metric(key, node[out])
    return prog


def _input(output: str, keys: tuple[str, ...] | None) -> str:
    """The step node's input reading the source's ``output``: ``batch.<key>``, or ``batch``."""
    return f"{SOURCE}.{output}" if keys is not None else SOURCE


def _step_node(train_step: Callable[[Any, Any], Any], keys: tuple[str, ...] | None,
               metrics: Mapping[str, str]) -> Callable[..., dict[str, Any]]:
    """The node's function: the batch put back together, ``train_step`` called, its result by output name."""

    def step(**inputs: Any) -> dict[str, Any]:
        batch = {k: inputs[_input(k, keys)] for k in keys} if keys is not None else inputs[SOURCE]
        new_state, values = train_step(inputs[STATE], batch)
        return {STATE: new_state, **{out: values[key] for key, out in metrics.items()}}

    step.__name__ = step.__qualname__ = getattr(train_step, "__name__", "train_step")
    return step


# -- what the build traces ---------------------------------------------------------------


def _trace(where: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    import jax

    try:
        return jax.eval_shape(fn, *args)
    except Exception as exc:  # user code: report it against what failed
        given = ", ".join(d if len(d := _describe(a)) <= 200 else f"{d[:200]}..." for a in args)
        given = f" with {given}" if args else ""
        raise ProgramError(f"{where}: {what} failed to trace{given}: {type(exc).__name__}: {exc}") from exc


def _trace_source(where: str, source: Callable[[Any, Any], Any]) -> Any:
    import jax
    import jax.numpy as jnp

    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return _trace(where, "source(step, microbatch)", source, i32, i32)


def _sample_host(where: str, source: Callable[[int, int], Any]) -> Any:
    """A host source's batch for step 0 as shapes and dtypes, flattened as workers flatten it."""
    import jax

    from rallypoint.workers.sources.values import HostValueError, flat_leaves

    try:
        result = source(0, 0)
    except Exception as exc:  # user code: report it against the source
        raise ProgramError(f"{where}: source(0, 0) failed: {type(exc).__name__}: {exc}") from exc
    keys = _batch_keys(where, result)
    outputs = keys if keys is not None else (SOURCE,)
    try:
        leaves, trees = flat_leaves(outputs, result, f"{where}: source")
    except HostValueError as exc:
        raise ProgramError(str(exc)) from None
    avals, i = [], 0
    for tree in trees:
        avals.append(tree.unflatten([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves[i: i + tree.num_leaves]]))
        i += tree.num_leaves
    return dict(zip(outputs, avals, strict=True)) if keys is not None else avals[0]


def _batch_keys(where: str, batch: Any) -> tuple[str, ...] | None:
    """The batch's keys, each one output of the source; None: the batch is not a dict (one output)."""
    if not isinstance(batch, Mapping):
        return None
    if not batch:
        raise ProgramError(f"{where}: the source returned an empty dict; a batch needs at least one array")
    for key in batch:
        if not isinstance(key, str):
            raise ProgramError(f"{where}: the source's batch has key {key!r}; batch keys must be strings")
        try:
            check_name("batch key", key)
            check_name("batch key", f"{SOURCE}.{key}")
        except RallypointError as exc:
            raise ProgramError(f"{where}: {exc} (each key of the batch is an output of source {SOURCE!r}; "
                               "keys of at most 57 characters)") from None
    return tuple(batch)


def _batch_shardings(where: str, given: Any, batch: Any, keys: tuple[str, ...] | None, axis: str) -> dict[str, Any]:
    """PartitionSpec per source output: ``given`` (one for all, or per key) over the default."""
    import jax

    outputs = keys if keys is not None else (SOURCE,)
    values = dict(batch) if keys is not None else {SOURCE: batch}
    out = {o: PartitionSpec(axis) if all(len(a.shape) >= 1 for a in jax.tree_util.tree_leaves(values[o]))
           else PartitionSpec() for o in outputs}
    if given is None:
        return out
    if isinstance(given, PartitionSpec):
        return dict.fromkeys(outputs, given)
    if not isinstance(given, Mapping):
        raise ProgramError(f"{where}: batch_sharding must be a PartitionSpec or a dict batch key -> PartitionSpec, "
                           f"got {given!r}")
    if keys is None:
        raise ProgramError(f"{where}: batch_sharding is a dict, but the source's batch is not a dict; give one "
                           "PartitionSpec")
    for key, spec in given.items():
        if key not in out:
            raise ProgramError(f"{where}: batch_sharding names {key!r}, which is not a key of the batch {list(keys)}")
        if not isinstance(spec, PartitionSpec):
            raise ProgramError(f"{where}: batch_sharding[{key!r}] must be a PartitionSpec, got {spec!r}")
        out[key] = spec
    return out


def _metric_outputs(where: str, train_step: Callable[[Any, Any], Any], state: Any, batch: Any) -> dict[str, str]:
    """Trace ``train_step`` on the state's and the batch's shapes; metric name -> node output name."""
    result = _trace(where, "train_step(state, batch)", train_step, state, batch)
    if not (isinstance(result, tuple | list) and len(result) == 2):
        got = f"a {type(result).__name__} of {len(result)}" if isinstance(result, tuple | list) \
            else type(result).__name__
        raise ProgramError(f"{where}: train_step must return a pair (new_state, metrics), got {got}")
    new_state, metrics = result
    _check_same_state(where, state, new_state)
    if not isinstance(metrics, Mapping):
        raise ProgramError(f"{where}: train_step's metrics must be a dict of scalars (name -> value), got "
                           f"{_describe(metrics)}")
    outputs: dict[str, str] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ProgramError(f"{where}: train_step's metrics have key {key!r}; metric names are non-empty strings")
        if getattr(value, "shape", None) != ():
            raise ProgramError(f"{where}: metric {key!r} of train_step is {_describe(value)}; a metric must be a "
                               "scalar (reduce it in the step, e.g. jnp.mean)")
        outputs[key] = _output_name(key, {STATE, *outputs.values()})
    return outputs


def _output_name(key: str, taken: set[str]) -> str:
    """A valid, unused node output name for metric ``key``: the key itself where it can be."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
    base = (base if base[0].isalnum() else f"m{base}")[:56]
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def _check_same_state(where: str, state: Any, new_state: Any) -> None:
    import jax

    old = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(state)[0]}
    new = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(new_state)[0]}
    diff = [f"{p or 'the state'} is missing" for p in old if p not in new]
    diff += [f"{p or 'the state'} is new" for p in new if p not in old]
    diff += [f"{p or 'the state'} is {_describe(new[p])}, init gives {_describe(a)}" for p, a in old.items()
             if p in new and (a.shape, a.dtype) != (new[p].shape, new[p].dtype)]
    if not diff and jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(new_state):
        diff = ["its pytree types differ"]
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise ProgramError(f"{where}: train_step returns a new state unlike init()'s: {'; '.join(diff[:3])}{more}. "
                           "The next state must keep the structure, shapes and dtypes of init()")


def _describe(tree: Any) -> str:
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and leaves[0] is tree and hasattr(tree, "shape"):
        return f"{tree.dtype}{list(tree.shape)}"
    if not leaves or not all(hasattr(x, "shape") for x in leaves):
        return type(tree).__name__
    return str(jax.tree_util.tree_map(lambda a: f"{a.dtype}{list(a.shape)}", tree))

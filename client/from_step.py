"""A whole program from the user's own SPMD train step: :meth:`Program.from_step`.

A team with one ``train_step(state, batch) -> (state, metrics)`` gets remapping, replay,
checkpoints, drains and shrink/grow without rewriting the step into nodes. The program
it builds is one slice holding everything::

    slice  "main"   devices (or (min, max)) over mesh_axes
    state  "state"  the whole train state pytree, init()
    source "batch"  source(step, microbatch): a dict of arrays, one output per key
    node   "step"   train_step(state, batch), unchanged; output "state" updates the state,
                    one more output per metric, each registered as a metric of its own name

With gradient accumulation (``grad_step``, ``apply_step``, ``microbatches=k``) node ``"grad"`` runs
``grad_step(state, batch)`` on each microbatch's batch and node ``"step"`` runs ``apply_step(state,
grads)`` once a step on the mean of the k gradients: the one place the average is taken. With
evaluation (``eval_step``, ``eval_source``, ``eval_every``) source ``"eval_batch"`` and node ``"eval"``
run every ``eval_every`` steps, read the state as it stands at the start of the step and update
nothing; their metrics are reported as ``eval_<key>``. A step that asks for ``step`` or ``rng``
(keyword parameters) gets the step number from source ``"clock"`` (a JAX source of the step) and a
key of the job's ``seed`` and the step: a replay gets the same key, so a run stays bitwise.

The batch and the metrics' names are found at build time: a host source is called once for
step 0 (a JAX source and the steps are traced with :func:`jax.eval_shape`), so a step that
returns something else than it should fails here, naming what is wrong (client/step_trace.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from rallypoint.client.errors import ProgramError
from rallypoint.client.layouts import abstract_mesh, check_rules, traced_on
from rallypoint.client.refs import Gathered
from rallypoint.client.step_trace import (SOURCE, asks, batch_keys, batch_shardings, call, check_same_state, describe,
                                          metric_outputs, sample_host, state_and_metrics, trace, trace_source)

SLICE, STATE, NODE = "main", "state", "step"
"""The names of the program's one slice, its state and the node that updates it (``--fail kill:main@12``)."""
GRAD, EVAL, EVAL_SOURCE, CLOCK, CLOCK_MB = "grad", "eval", "eval_batch", "clock", "clock_mb"
"""The names of the gradient node, the evaluation node and source, and the step-number sources."""


def from_step(
    cls: Any, name: str, *, init: Callable[[], Any], source: Callable[[int, int], Any], steps: int,
    train_step: Callable[..., Any] | None = None, grad_step: Callable[..., Any] | None = None,
    apply_step: Callable[..., Any] | None = None, microbatches: int = 1, seed: int = 0,
    eval_step: Callable[..., Any] | None = None, eval_source: Callable[[int, int], Any] | None = None,
    eval_every: int | None = None, eval_prefix: str = "eval_", eval_host_source: bool | None = None,
    devices: int | tuple[int, int] = 1, mesh_axes: Sequence[str] = ("data",), mesh_shape: Sequence[int] | None = None,
    batch_sharding: PartitionSpec | Mapping[str, PartitionSpec] | None = None, host_source: bool = True,
    prefetch: int = 0, checkpoint_every: int = 10, state_sharding: Any = None,
    axis_rules: Sequence[tuple[str, str | None]] | None = None, init_from: Any = None,
) -> Any:
    """The one-slice program running ``train_step`` unchanged (``cls``: :class:`Program`).

    Args:
        name: the job's name.
        init: ``init()`` -> the whole train state (a pytree of arrays: parameters, optimizer
            state, step counters; a Flax ``TrainState`` too); traced and exported like any state's init.
        train_step: ``train_step(state, batch) -> (new_state, metrics)``: a pure JAX function
            (jitted or not); ``new_state`` keeps ``init``'s structure, shapes and dtypes and
            ``metrics`` is a dict of scalars (may be empty), each reported under its key. It may ask
            for ``step`` (the step number, an int32 scalar) and ``rng`` (a key of ``seed`` and the step)
            by naming them as parameters: ``train_step(state, batch, *, step, rng)``.
        grad_step, apply_step: instead of ``train_step``, gradient accumulation:
            ``grad_step(state, batch) -> (grads, metrics)`` on each of the step's ``microbatches``
            batches (``source(step, microbatch)``) and ``apply_step(state, grads) -> new_state`` once
            a step on their mean; the metrics are the mean over the microbatches. Both may ask for
            ``step`` and ``rng`` (``grad_step``'s key is folded with the microbatch too).
        microbatches: batches a step (with ``grad_step``/``apply_step``).
        seed: the job's seed, of every ``rng`` key: ``jax.random.fold_in(jax.random.key(seed), step)``.
        eval_step, eval_source, eval_every: evaluation: ``eval_step(state, batch) -> metrics`` on
            ``eval_source(step, 0)`` every ``eval_every`` steps, reading the state as it stands at the
            start of the step (before that step's update) and changing nothing; each metric is reported
            as ``eval_prefix + key`` (default ``eval_<key>``), at those steps only.
        eval_host_source: whether ``eval_source`` is a host source (default: as ``host_source``).
        source: ``source(step, microbatch)`` -> the step's batch, a dict of arrays (or one array
            or another pytree); ``microbatch`` is 0 but with ``microbatches``. ``host_source=True``:
            plain Python returning NumPy arrays, run on the worker, defined at the top level of the job
            file (the worker imports it by name); ``False``: a JAX function of the step.
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
    where = f"Program.from_step {name!r}"
    accumulate = grad_step is not None or apply_step is not None
    _check_options(where, train_step, grad_step, apply_step, microbatches, seed, eval_step, eval_source, eval_every,
                   eval_prefix)
    eval_host = host_source if eval_host_source is None else eval_host_source
    for arg, fn in (("init", init), ("source", source)):
        if not callable(fn):
            raise ProgramError(f"{where}: {arg} must be callable, got {fn!r}")
    for arg, flag in (("host_source", host_source), ("eval_host_source", eval_host)):
        if not isinstance(flag, bool):
            raise ProgramError(f"{where}: {arg} must be True or False, got {flag!r}")
    if not host_source and prefetch:
        raise ProgramError(f"{where}: prefetch reads a host source ahead; a JAX source (host_source=False) takes none")
    if isinstance(mesh_axes, str) or not all(isinstance(a, str) for a in mesh_axes):
        raise ProgramError(f"{where}: mesh_axes must be a sequence of axis names such as ('data',), got {mesh_axes!r}")
    prog = cls(name, steps=steps, microbatches=microbatches, checkpoint_every=checkpoint_every)
    sl = prog.slice(SLICE, devices, mesh_axes=tuple(mesh_axes), mesh_shape=mesh_shape)
    axis = prog.slices[sl].mesh_axes[0]
    import jax
    import jax.numpy as jnp

    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    with traced_on(abstract_mesh(prog.slices[sl].mesh_shape, prog.slices[sl].mesh_axes), check_rules(STATE, axis_rules)):
        state_aval = trace(where, "init()", init)
        batch_aval = sample_host(where, source) if host_source else trace_source(where, source)
        keys = batch_keys(where, batch_aval)
        shardings = batch_shardings(where, batch_sharding, batch_aval, keys, axis)
        if not accumulate:
            assert train_step is not None
            ex = {NODE: asks(where, "train_step", train_step)}
            result = trace(where, "train_step(state, batch)",
                           lambda s, b, t: call(train_step, ex[NODE], seed, (s, b), t), state_aval, batch_aval, i32)
            metrics = metric_outputs(where, "train_step", state_and_metrics(where, "train_step", result, state_aval),
                                     {STATE})
        else:
            assert grad_step is not None and apply_step is not None
            ex = {GRAD: asks(where, "grad_step", grad_step), NODE: asks(where, "apply_step", apply_step)}
            got = trace(where, "grad_step(state, batch)", lambda s, b, t, m: call(grad_step, ex[GRAD], seed, (s, b), t, m),
                        state_aval, batch_aval, i32, i32)
            if not (isinstance(got, tuple | list) and len(got) == 2):
                raise ProgramError(f"{where}: grad_step must return a pair (grads, metrics), got {describe(got)}")
            metrics = metric_outputs(where, "grad_step", got[1], {"grads"})
            new = trace(where, "apply_step(state, grads)", lambda s, g, t: call(apply_step, ex[NODE], seed, (s, g), t),
                        state_aval, got[0], i32)
            check_same_state(where, state_aval, new, "apply_step")
        if eval_step is not None:
            assert eval_source is not None
            what = "eval_source"
            eval_aval = sample_host(where, eval_source, what) if eval_host else trace_source(where, eval_source, what)
            eval_keys = batch_keys(where, eval_aval, what)
            ex[EVAL] = asks(where, "eval_step", eval_step)
            got = trace(where, "eval_step(state, batch)", lambda s, b, t: call(eval_step, ex[EVAL], seed, (s, b), t),
                        state_aval, eval_aval, i32)
            evals = metric_outputs(where, "eval_step", got, {STATE}, prefix=eval_prefix)
            clash = sorted(set(evals) & set(metrics))
            if clash:
                raise ProgramError(f"{where}: eval metric {clash[0]!r} has the name of a training metric; give "
                                   "another eval_prefix")

    state = prog.state(STATE, slice=sl, init=init, sharding=state_sharding, axis_rules=axis_rules,
                       init_from=init_from)
    batch = prog.source(SOURCE, source, slice=sl, outputs=keys or (SOURCE,), per="microbatch" if accumulate else "step",
                        shardings=shardings, host=host_source, prefetch=prefetch)
    clocks: dict[str, Any] = {}
    batch_in = _inputs(SOURCE, batch, keys)
    batch_sh = {_input(SOURCE, o, keys): spec for o, spec in shardings.items()}
    if not accumulate:
        node = prog.node(NODE, _node(train_step, ex[NODE], seed, STATE, SOURCE, keys, metrics, STATE),
                         slice=sl, inputs={STATE: state, **batch_in, **_clock(prog, sl, ex[NODE], clocks)},
                         outputs=(STATE, *metrics.values()), updates={STATE: state}, shardings=batch_sh)
    else:
        node = prog.node(GRAD, _node(grad_step, ex[GRAD], seed, STATE, SOURCE, keys, metrics, "grads"), slice=sl,
                         per="microbatch", inputs={STATE: state, **batch_in,
                                                   **_clock(prog, sl, ex[GRAD], clocks, per_microbatch=True)},
                         outputs=("grads", *metrics.values()), shardings=batch_sh)
        prog.node(NODE, _apply_node(apply_step, ex[NODE], seed), slice=sl,
                  inputs={STATE: state, "grads": Gathered(node["grads"]), **_clock(prog, sl, ex[NODE], clocks)},
                  outputs=(STATE,), updates={STATE: state})
    for key, out in metrics.items():
        prog.metric(key, node[out])
    if eval_step is not None:
        eval_sh = batch_shardings(where, None, eval_aval, eval_keys, axis)
        held = prog.source(EVAL_SOURCE, eval_source, slice=sl, outputs=eval_keys or (EVAL_SOURCE,), per="step",
                           shardings=eval_sh, host=eval_host, every=eval_every)
        ev = prog.node(EVAL, _node(eval_step, ex[EVAL], seed, STATE, EVAL_SOURCE, eval_keys, evals, None,
                                   prefix=eval_prefix),
                       slice=sl, every=eval_every,
                       inputs={STATE: state, **_inputs(EVAL_SOURCE, held, eval_keys), **_clock(prog, sl, ex[EVAL], clocks)},
                       outputs=tuple(evals.values()),
                       shardings={_input(EVAL_SOURCE, o, eval_keys): spec for o, spec in eval_sh.items()})
        for key, out in evals.items():
            prog.metric(key, ev[out])
    return prog


def _check_options(where: str, train_step: Any, grad_step: Any, apply_step: Any, microbatches: Any, seed: Any,
                   eval_step: Any, eval_source: Any, eval_every: Any, eval_prefix: Any) -> None:
    accumulate = grad_step is not None or apply_step is not None
    if accumulate and train_step is not None:
        raise ProgramError(f"{where}: give train_step, or grad_step and apply_step (gradient accumulation), not both")
    if accumulate and not (callable(grad_step) and callable(apply_step)):
        raise ProgramError(f"{where}: gradient accumulation needs both grad_step(state, batch) -> (grads, metrics) and "
                           f"apply_step(state, grads) -> state as functions, got {grad_step!r} and {apply_step!r}")
    if not accumulate and not callable(train_step):
        raise ProgramError(f"{where}: train_step must be callable, got {train_step!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ProgramError(f"{where}: microbatches must be a positive integer, got {microbatches!r}")
    if microbatches > 1 and not accumulate:
        raise ProgramError(f"{where}: microbatches={microbatches} accumulates gradients: give grad_step and "
                           "apply_step instead of train_step (docs/program-api.md)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ProgramError(f"{where}: seed must be an integer, got {seed!r}")
    given = {"eval_step": eval_step, "eval_source": eval_source, "eval_every": eval_every}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ProgramError(f"{where}: evaluation needs eval_step, eval_source and eval_every; {missing[0]} is "
                               "missing")
        for k in ("eval_step", "eval_source"):
            if not callable(given[k]):
                raise ProgramError(f"{where}: {k} must be callable, got {given[k]!r}")
        if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
            raise ProgramError(f"{where}: eval_every must be a positive integer, got {eval_every!r}")
    if not isinstance(eval_prefix, str):
        raise ProgramError(f"{where}: eval_prefix must be a string, got {eval_prefix!r}")


def _input(source: str, output: str, keys: tuple[str, ...] | None) -> str:
    """A node's input reading a source's ``output``: ``<source>.<key>``, or ``<source>``."""
    return f"{source}.{output}" if keys is not None else source


def _inputs(source: str, handle: Any, keys: tuple[str, ...] | None) -> dict[str, Any]:
    return {_input(source, o, keys): handle[o] for o in (keys or (source,))}


def _clock(prog: Any, sl: str, extras: tuple[str, ...], made: dict[str, Any], *,
           per_microbatch: bool = False) -> dict[str, Any]:
    """The inputs giving a node the step (and microbatch) numbers it asks for, from a JAX source of them
    (added once): nodes learn their step from sources only."""
    if not extras:
        return {}
    if not per_microbatch:
        if CLOCK not in made:
            made[CLOCK] = prog.source(CLOCK, _step_number, slice=sl, per="step", outputs=("step",), clock=True)
        return {"clock.step": made[CLOCK]["step"]}
    if CLOCK_MB not in made:
        made[CLOCK_MB] = prog.source(CLOCK_MB, _step_and_microbatch, slice=sl, per="microbatch",
                                     outputs=("step", "microbatch"), clock=True)
    return {"clock.step": made[CLOCK_MB]["step"], "clock.microbatch": made[CLOCK_MB]["microbatch"]}


def _step_number(step: Any, microbatch: Any) -> Any:
    return step


def _step_and_microbatch(step: Any, microbatch: Any) -> dict[str, Any]:
    return {"step": step, "microbatch": microbatch}


def _node(fn: Callable[..., Any], extras: tuple[str, ...], seed: int, state: str, source: str,
          keys: tuple[str, ...] | None, metrics: Mapping[str, str], first: str | None,
          prefix: str = "") -> Callable[..., dict[str, Any]]:
    """A node's function: the batch put back together, ``fn`` called, its result by output name (``first``:
    the output of ``fn``'s first result, its metrics the second; None: ``fn`` returns the metrics alone)."""

    def node(**inputs: Any) -> dict[str, Any]:
        batch = {k: inputs[_input(source, k, keys)] for k in keys} if keys is not None else inputs[source]
        got = call(fn, extras, seed, (inputs[state], batch), inputs.get("clock.step"), inputs.get("clock.microbatch"))
        values = got if first is None else got[1]
        out = {} if first is None else {first: got[0]}
        return {**out, **{o: values[name[len(prefix):]] for name, o in metrics.items()}}

    node.__name__ = node.__qualname__ = getattr(fn, "__name__", "step")
    return node


def _apply_node(apply_step: Callable[..., Any], extras: tuple[str, ...], seed: int) -> Callable[..., dict[str, Any]]:
    """The per-step node's function: the mean of the microbatches' gradients, ``apply_step`` called on it."""

    def apply(**inputs: Any) -> dict[str, Any]:
        import jax
        import jax.numpy as jnp

        grads = jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), inputs["grads"])  # the one average
        return {STATE: call(apply_step, extras, seed, (inputs[STATE], grads), inputs.get("clock.step"))}

    apply.__name__ = apply.__qualname__ = getattr(apply_step, "__name__", "apply_step")
    return apply

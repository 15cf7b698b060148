"""The Program API: one client describes the whole training computation as a graph.

A :class:`Program` holds **virtual slices** (named groups of devices with a mesh),
**state** (loop-carried values with an ``init``: a stage's parameters and
optimizer state), deterministic **sources** (``batch = source(step, microbatch)``)
and **nodes** (pure JAX functions on one slice, run once per step or once per
microbatch). Edges are the references a node takes as inputs; :func:`gather`
collects a per-microbatch value of the whole step into a per-step node.

State is read at the start of a step by any number of nodes and produced anew by
exactly one node (``updates=``); the value it produces is what the next step reads.
That is the only mutable state, so "the state after step s" of all slices together
is a consistent cut.

Example (one pipeline stage)::

    prog = Program("mlp", steps=100, microbatches=4)
    s0 = prog.slice("stage0", devices=1)
    params = prog.state("params0", slice=s0, init=lambda: init_stage(0))
    batch = prog.source("batch", make_batch, slice=s0, outputs=("x", "y"))
    fwd = prog.node("fwd0", stage_forward, slice=s0, per="microbatch",
                    inputs={"params": params, "x": batch["x"]}, outputs=("act",))
    ...
    prog.node("update0", sgd_update, slice=s0,
              inputs={"params": params, "grads": gather(bwd["grads"])},
              outputs=("params",), updates={"params": params})

Structural checks happen as the graph is built and in :meth:`Program.validate`;
shape and dtype checks by tracing are in :mod:`rallypoint.client.compile`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec

from rallypoint.basics.errors import RallypointError
from rallypoint.client import graph_checks
from rallypoint.client.errors import ProgramError  # raised here, and imported from here by callers
from rallypoint.client.refs import Gathered, Input, NodeSpec, Per, Ref, StateRef  # noqa: F401 - imported from here by callers
from rallypoint.etcd.keys import check_name



# ---------------------------------------------------------------------------
# References




def gather(ref: Ref | NodeHandle) -> Gathered:
    """Collect a per-microbatch output over all microbatches of the step (stacked on axis 0)."""
    return Gathered(_as_ref(ref))


def _as_ref(x: Any) -> Ref:
    if isinstance(x, NodeHandle):
        return x.ref
    if isinstance(x, Ref):
        return x
    raise ProgramError(f"expected a node output, got {x!r}")


def _job_module_globals() -> Mapping[str, Any]:
    """The globals of the nearest caller outside Rallypoint: the job's module declaring a source."""
    frame = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("rallypoint."):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_globals if frame is not None else {}


# ---------------------------------------------------------------------------
# Declarations


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """A virtual slice: ``devices`` virtual devices arranged as ``mesh_shape`` over ``mesh_axes``.

    ``min_devices`` < ``devices``: the slice may also run on fewer devices (a recovery
    with ``on_no_spare='shrink'``) and grows back when room returns; the first mesh axis
    takes the change. :meth:`device_counts` are the counts its programs are exported for.
    """

    name: str
    devices: int
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    min_devices: int = 0  # 0: exactly ``devices``

    def device_counts(self) -> tuple[int, ...]:
        """Every device count the slice runs on, largest first: divisors of ``devices`` down to
        ``min_devices`` that keep the mesh's other axes whole."""
        rest = 1
        for d in self.mesh_shape[1:]:
            rest *= d
        low = self.min_devices or self.devices
        return tuple(c for c in range(self.devices, low - 1, -1) if self.devices % c == 0 and c % rest == 0)

    def mesh_shape_for(self, count: int) -> tuple[int, ...]:
        """The mesh of ``count`` devices: the first axis scaled."""
        rest = self.devices // self.mesh_shape[0]
        return (count // rest, *self.mesh_shape[1:])


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A loop-carried value: its slice, its step-0 ``init()``, its layout (:mod:`rallypoint.client.layouts`)."""

    name: str
    slice: str
    init: Callable[[], Any]
    sharding: Any = None
    axis_rules: Any = None
    init_from: str | None = None  # a plain Orbax checkpoint its step-0 value is read from (client/init_from.py)


class NodeHandle:
    """What :meth:`Program.node` returns: index it by output name to get an edge source."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec

    def __getitem__(self, output: str) -> Ref:
        if output not in self.spec.outputs:
            raise ProgramError(
                f"node {self.spec.name!r} has no output {output!r}; its outputs are {list(self.spec.outputs)}"
            )
        return Ref(self.spec.name, output)

    @property
    def ref(self) -> Ref:
        """The node's only output (for single-output nodes)."""
        if len(self.spec.outputs) != 1:
            raise ProgramError(
                f"node {self.spec.name!r} has outputs {list(self.spec.outputs)}: pick one with node[\"name\"]"
            )
        return Ref(self.spec.name, self.spec.outputs[0])


@dataclass
class Program:
    """A whole training computation as a graph of nodes on virtual slices.

    Args:
        name: job name.
        steps: number of training steps.
        microbatches: microbatches per step (per-microbatch nodes run this often).
        checkpoint_every: save state every K steps (used by recovery).
        settings: the job's settings, shipped with its code bundle (``rallypoint.client.setting``; filled by
            :func:`~rallypoint.client.jobfile.load_program` with what the job file read; docs/data.md).
    """

    name: str
    steps: int
    microbatches: int = 1
    checkpoint_every: int = 10
    slices: dict[str, SliceSpec] = field(default_factory=dict)
    states: dict[str, StateSpec] = field(default_factory=dict)
    nodes: dict[str, NodeSpec] = field(default_factory=dict)
    metrics: dict[str, Ref] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            check_name("job", self.name)
        except RallypointError as exc:
            raise ProgramError(str(exc)) from None
        for attr in ("steps", "microbatches", "checkpoint_every"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProgramError(f"Program {self.name!r}: {attr} must be a positive integer, got {getattr(self, attr)!r}")

    @classmethod
    def from_step(cls, name: str, **options: Any) -> Program:
        """The one-slice program of the user's own ``train_step(state, batch) -> (state, metrics)``,
        called unchanged. Options (keyword-only): ``init``, ``train_step`` (which may ask for ``step`` and
        ``rng``), ``source``, ``steps``, ``seed``, ``grad_step``/``apply_step``/``microbatches`` (gradient
        accumulation), ``eval_step``/``eval_source``/``eval_every``/``eval_prefix``/``eval_host_source``
        (evaluation), ``devices``, ``mesh_axes``, ``mesh_shape``, ``batch_sharding``, ``host_source``,
        ``prefetch``, ``checkpoint_every``, ``state_sharding``, ``axis_rules``, ``init_from``: see
        :func:`rallypoint.client.from_step.from_step` and docs/program-api.md.
        """
        from rallypoint.client.from_step import from_step

        return from_step(cls, name, **options)

    @classmethod
    def from_nnx(cls, name: str, **options: Any) -> Program:
        """:meth:`from_step` for a stateful Flax NNX step, unchanged: ``create()`` -> the model (and its
        ``nnx.Optimizer``), ``train_step(model, optimizer, x, y)`` mutating them. Options: ``create``,
        ``train_step``, ``eval_step`` and :meth:`from_step`'s: see :func:`rallypoint.client.from_nnx.from_nnx`
        and docs/program-api.md.
        """
        from rallypoint.client.from_nnx import from_nnx

        return from_nnx(cls, name, **options)

    # -- declarations ---------------------------------------------------------------

    def _fresh(self, kind: str, name: str) -> None:
        try:
            check_name(kind, name)
        except RallypointError as exc:
            raise ProgramError(str(exc)) from None
        if name in self.slices or name in self.states or name in self.nodes:
            raise ProgramError(f"{kind} name {name!r} is already used in program {self.name!r}")

    def slice(
        self, name: str, devices: int | tuple[int, int] = 1, *, mesh_axes: Sequence[str] = ("d",),
        mesh_shape: Sequence[int] | None = None,
    ) -> str:
        """Declare a virtual slice of ``devices`` devices; returns its name.

        ``devices=(min, max)``: the slice is placed on ``max`` devices and may run on
        fewer, down to ``min`` (its programs are exported for each count that divides
        ``max``), after a loss with ``on_no_spare='shrink'``; it grows back to ``max``
        when a worker with room appears. A run that changed device counts matches the
        fault-free reference to a tolerance, not bitwise (docs/recovery.md).
        """
        self._fresh("slice", name)
        low = 0
        if isinstance(devices, tuple):
            if len(devices) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) for d in devices) \
                    or not 1 <= devices[0] <= devices[1]:
                raise ProgramError(f"slice {name!r}: devices=(min, max) needs integers 1 <= min <= max, got {devices!r}")
            low, devices = devices
        shape = tuple(mesh_shape) if mesh_shape is not None else (devices,) + (1,) * (len(mesh_axes) - 1)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ProgramError(f"slice {name!r}: devices must be a positive integer, got {devices!r}")
        if len(shape) != len(tuple(mesh_axes)):
            raise ProgramError(f"slice {name!r}: mesh_shape {shape} does not match mesh_axes {tuple(mesh_axes)}")
        n = 1
        for d in shape:
            n *= d
        if n != devices:
            raise ProgramError(f"slice {name!r}: mesh_shape {shape} holds {n} devices, not {devices}")
        spec = SliceSpec(name, devices, tuple(mesh_axes), shape, low if low < devices else 0)
        if spec.min_devices and spec.device_counts() == (devices,):
            raise ProgramError(f"slice {name!r}: no device count from {low} to {devices} divides {devices} and keeps "
                               f"the mesh {shape} whole; lower the minimum")
        self.slices[name] = spec
        return name

    def state(self, name: str, *, slice: str, init: Callable[[], Any], sharding: Any = None,
              axis_rules: Sequence[tuple[str, str | None]] | None = None, init_from: Any = None) -> StateRef:
        """Declare a loop-carried value on ``slice`` with its step-0 value ``init()``, laid out over the
        slice's mesh as ``sharding`` says (with ``axis_rules``), else as ``init`` lays it out, else
        replicated: :mod:`rallypoint.client.layouts`, docs/program-api.md "Sharded state".

        ``init_from``: the path of a plain Orbax checkpoint (pretrained weights) whose tree, shapes and
        dtypes are ``init``'s: the step-0 value is read from it instead (``init`` is traced, not run),
        checked at submit and checksummed like a commit (:mod:`rallypoint.client.init_from`)."""
        from rallypoint.client.init_from import init_from_path

        path = init_from_path(name, init_from)
        self._fresh("state", name)
        self._known_slice(f"state {name!r}", slice)
        self.states[name] = StateSpec(name, slice, init, sharding, axis_rules, path)
        return StateRef(name, slice)

    def source(
        self, name: str, fn: Callable[[Any, Any], Any], *, slice: str, outputs: Sequence[str] = ("out",),
        per: Per = "microbatch", shardings: Mapping[str, PartitionSpec] | None = None, host: bool = False,
        prefetch: int = 0, every: int = 1, clock: bool = False,
    ) -> NodeHandle:
        """Declare a deterministic data node: ``fn(step, microbatch)`` -> outputs.

        ``host=False``: ``fn`` is JAX, traced with the step and microbatch as int32 scalars and
        exported like any node; its outputs must depend on them (a NumPy random call runs once,
        at export).

        ``host=True``: ``fn`` is plain Python run on the worker that holds the slice, in a child
        process, ``prefetch`` instances ahead (0: 4), with the step and microbatch as ints; it
        returns NumPy arrays (a dict with ``outputs`` as keys, or one array) and may read files,
        shuffle with a seed, tokenize. It must be reachable by a module-level name of a file in
        the job's code bundle (the job file's directory), and deterministic in its arguments:
        its outputs' checksums are kept and a replay that reads different bytes fails the job.
        ``shardings`` lay its outputs out on the slice (default: replicated). ``every``: it runs only at
        steps divisible by it, for the nodes of the same ``every`` that read it (an evaluation's held-out
        batches). See docs/data.md.

        ``step`` is the position in the source's stream the step reads: the step itself, unless the run
        skips batches (a rolled-back loss spike, docs/integrity.md). ``clock=True``: the source is the
        job's clock (a learning-rate schedule's step), always given the step itself.
        """
        if not isinstance(host, bool) or not isinstance(clock, bool):
            raise ProgramError(f"source {name!r}: host and clock must be True or False, got {host!r}, {clock!r}")
        if host and clock:
            raise ProgramError(f"source {name!r}: a clock is a JAX source of the step (host=False)")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ProgramError(f"source {name!r}: prefetch must be an integer >= 0 (0: the default), got {prefetch!r}")
        if not callable(fn):
            raise ProgramError(f"source {name!r}: fn must be callable as fn(step, microbatch), got {fn!r}")
        return self._add(NodeSpec(name, fn, slice, {}, tuple(outputs), per, {}, every, dict(shardings or {}), True,
                                  host, prefetch, _job_module_globals() if host else None, clock))

    @property
    def host_sources(self) -> list[str]:
        """The names of the program's host sources (it needs a code bundle if any)."""
        return [n.name for n in self.nodes.values() if n.host]

    def node(
        self, name: str, fn: Callable[..., Any], *, slice: str, inputs: Mapping[str, Input | NodeHandle],
        outputs: Sequence[str] = ("out",), per: Per = "step", updates: Mapping[str, StateRef] | None = None,
        every: int = 1, shardings: Mapping[str, PartitionSpec] | None = None,
    ) -> NodeHandle:
        """Declare a node: ``fn(**inputs)`` on ``slice``, once per step or once per microbatch.

        Args:
            updates: output name -> state it produces for the next step.
            every: run only at steps divisible by ``every``; the states it updates keep
                their value in between (e.g. parameters sent to a sampler every k steps).
            shardings: PartitionSpec over the slice's mesh per input or output name (default: a state
                read on its own slice, or an output updating one, as the state lies; else replicated).
        """
        resolved: dict[str, Input] = {}
        for arg, src in inputs.items():
            resolved[arg] = src.ref if isinstance(src, NodeHandle) else src
        upd = {}
        for out, st in (updates or {}).items():
            if not isinstance(st, StateRef):
                raise ProgramError(f"node {name!r}: updates[{out!r}] must be a state, got {st!r}")
            upd[out] = st.name
        return self._add(NodeSpec(name, fn, slice, resolved, tuple(outputs), per, upd, every, dict(shardings or {})))

    def metric(self, name: str, ref: Ref | NodeHandle) -> None:
        """Report ``ref`` (a scalar) as metric ``name`` each step (mean over microbatches)."""
        if name in self.metrics:
            raise ProgramError(f"metric {name!r} is already declared in program {self.name!r}")
        self.metrics[name] = _as_ref(ref)

    def _known_slice(self, what: str, slice_name: str) -> None:
        if slice_name not in self.slices:
            raise ProgramError(f"{what} is placed on unknown slice {slice_name!r}; declared slices: {sorted(self.slices)}")

    def _add(self, spec: NodeSpec) -> NodeHandle:
        self._fresh("node", spec.name)
        self._known_slice(f"node {spec.name!r}", spec.slice)
        if spec.per not in ("step", "microbatch"):
            raise ProgramError(f"node {spec.name!r}: per must be 'step' or 'microbatch', got {spec.per!r}")
        if not spec.outputs or len(set(spec.outputs)) != len(spec.outputs):
            raise ProgramError(f"node {spec.name!r}: outputs must be distinct names, got {list(spec.outputs)}")
        if isinstance(spec.every, bool) or not isinstance(spec.every, int) or spec.every < 1:
            raise ProgramError(f"node {spec.name!r}: every must be a positive integer, got {spec.every!r}")
        for key in spec.shardings:
            if key not in spec.inputs and key not in spec.outputs:
                raise ProgramError(f"node {spec.name!r}: shardings names {key!r}, which is neither an input nor an output")
        for out in spec.updates:
            if out not in spec.outputs:
                raise ProgramError(f"node {spec.name!r}: updates names output {out!r}, which it does not have")
        self.nodes[spec.name] = spec
        return NodeHandle(spec)

    # -- structure --------------------------------------------------------------------

    def producer_of(self, state: str) -> tuple[str, str] | None:
        """``(node, output)`` producing the next value of ``state``, if any."""
        for n in self.nodes.values():
            for out, st in n.updates.items():
                if st == state:
                    return n.name, out
        return None

    def topo_order(self) -> list[str]:
        """Nodes in an order where every within-step edge points forward (:func:`graph_checks.topo_order`)."""
        return graph_checks.topo_order(self)

    def validate(self) -> None:
        """Structural checks that need the whole graph. Raises :class:`ProgramError`."""
        graph_checks.validate(self)

    def validate_for_cluster(self, *, workers: int, devices_per_worker: int) -> None:
        """Checks against a cluster shape (:func:`graph_checks.validate_for_cluster`). Raises :class:`ProgramError`."""
        graph_checks.validate_for_cluster(self, workers=workers, devices_per_worker=devices_per_worker)

"""The in-process reference executor and the state digest.

The reference runs a compiled program in one process, with no workers: the same
exported programs (deserialized from the same bytes), on meshes of the same device
shapes, fed the same inputs. Because JAX programs are deterministic on the same
device shape and sources are functions of the step, a run on the cluster must end
in **bitwise the same state**; :func:`state_digest` is how that is checked.

Values stay on the devices, as on a worker (:mod:`rallypoint.workers.residency`): a node's
outputs and the states are ``jax.Array``s, each argument laid out as the consuming
program takes it (moved device to device when it is not); a gather stacks the
microbatches of a step on axis 0 where they are. Only metric scalars leave the
devices, all of a step's together, read after the next step is dispatched, so the
host's work (a host source's read, the next dispatch) overlaps the devices' compute
as in a plain ``jax.jit`` loop. The final states come back to the host for the
digest and the :class:`RunResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rallypoint.basics.errors import RallypointError
from rallypoint.client.compile import CompiledProgram, compile_program, slice_mesh
from rallypoint.client.program import Gathered, Program, Ref, StateRef
from rallypoint.recovery.nonfinite import NonFiniteGuard, nonfinite_mode, nonfinite_values, stopped_at
from rallypoint.recovery.skips import Skips
from rallypoint.workers.programs import load_exported
from rallypoint.workers.residency import is_device_array, place
from rallypoint.workers.sources.values import flat_leaves, to_dtypes
from rallypoint.workers.warm import arg_shardings


def state_digest(states: Mapping[str, Any]) -> str:
    """sha256 over every state value, in a fixed order: state name, tree structure (the same text in
    every process: :func:`rallypoint.proto.digest.structure`), then each leaf's dtype, shape and bytes
    (:func:`rallypoint.proto.digest.leaves_digest`)."""
    import jax

    from rallypoint.proto.digest import leaves_digest, structure

    flat = ((name, *jax.tree_util.tree_flatten(value)) for name, value in states.items())
    return leaves_digest((name, structure(treedef), leaves) for name, leaves, treedef in flat)


def to_host(tree: Any) -> Any:
    """A pytree of device arrays as numpy arrays."""
    import jax
    import numpy as np

    return jax.tree_util.tree_map(np.asarray, tree)


def stack_microbatches(values: list[Any]) -> Any:
    """Stack the per-microbatch values of one step on a new leading axis (exact): on their devices, or with
    numpy for host values."""
    import jax
    import numpy as np

    def stack(*xs: Any) -> Any:
        if any(is_device_array(x) for x in xs):
            import jax.numpy as jnp

            return jnp.stack(xs)
        return np.stack(xs)

    return jax.tree_util.tree_map(stack, *values)


class NonFiniteStopped(RallypointError):
    """A metric was not finite under ``--on-nonfinite stop``: the reference stops as the cluster fails the job."""


@dataclass
class RunResult:
    """The end of a run: final state, its digest, per-step metrics, time."""

    job: str
    steps: int
    states: dict[str, Any]
    state_digest: str
    wall_s: float
    metrics: list[dict[str, float]] = field(default_factory=list)
    instances: dict[str, int] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)  # on a cluster: failures, recoveries, replayed_instances

    def finished_event(self) -> dict[str, Any]:
        """The ``job.finished`` JSON event of ``rallypoint run --json``."""
        return {"event": "job.finished", "job": self.job, "steps": self.steps, "state_digest": self.state_digest,
                "wall_s": round(self.wall_s, 3), **self.recovery}


class ReferenceExecutor:
    """Runs a compiled program step by step in this process.

    Args:
        compiled: the program, compiled.
        on_step: called after each step with ``(step, metrics)``.
        devices: the devices every slice's mesh is laid over (default: the first N).
        on_nonfinite: a metric value that is not finite: ``"stop"`` (the default) raises
            :class:`NonFiniteStopped` naming it, as a cluster run fails the job; ``"warn"`` calls
            ``on_event`` with a ``job.nonfinite`` event once per metric and goes on
            (:mod:`rallypoint.recovery.nonfinite`, the cluster's policy).
        on_event: called with each such event (a dict, as ``rallypoint run --json`` prints it).
        skips: the stream positions the run skips (a cluster run's rolled-back spikes, recovery/skips.py): every
            source but a clock reads the position its step moves to, as on a worker.
    """

    def __init__(
        self, compiled: CompiledProgram, *, on_step: Callable[[int, dict[str, float]], None] | None = None,
        devices: Sequence[Any] | None = None, on_nonfinite: str | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None, skips: Skips = Skips(),
    ) -> None:
        self.compiled = compiled
        self.skips = skips
        self.on_step = on_step
        self.guard = NonFiniteGuard(nonfinite_mode(on_nonfinite))
        self.on_event = on_event
        program = compiled.program
        meshes = {name: slice_mesh(program, name, devices) for name in program.slices}
        self._calls = {n: load_exported(c.exported, meshes[c.slice]) for n, c in compiled.nodes.items()}
        # where each flat argument of a node must be when it is called (a value elsewhere is moved there)
        self._layouts = {n: _shardings(c.exported, meshes[c.slice], "in") for n, c in compiled.nodes.items()
                         if c.host is None}
        self._inits = {s: load_exported(c.exported_init, meshes[c.slice]) for s, c in compiled.states.items()}
        # where each state's leaves live: as its init lays them out (a state from the host is put there once)
        self._state_layouts = {s: _shardings(c.exported_init, meshes[c.slice], "out")
                               for s, c in compiled.states.items()}
        self._metric_refs = [(ref.node, ref.output) for ref in program.metrics.values()]

    def initial_state(self) -> dict[str, Any]:
        """Every state's step-0 value (host arrays): from its pretrained checkpoint (``init_from``: the same
        bytes a worker reads, checked against the same checksum), else from its exported init."""
        out = {}
        for name, init in self._inits.items():
            cs = self.compiled.states[name]
            out[name] = cs.tree.unflatten(cs.init_from.load(name) if cs.init_from is not None
                                          else to_host(list(init())))
        return out

    def run(self, steps: int | None = None, *, state: dict[str, Any] | None = None, start_step: int = 0) -> RunResult:
        """Run ``steps`` steps (default: the program's) from ``state`` (default: init).

        Values stay on the devices between instances and steps; a step's metrics are read
        (``on_step``, the ``--on-nonfinite`` policy) once the next step is dispatched.
        The result's states are host arrays."""
        program: Program = self.compiled.program
        total = program.steps if steps is None else steps
        states = self._on_devices(dict(state) if state is not None else self.initial_state())
        instances = dict.fromkeys(self.compiled.nodes, 0)
        metrics_log: list[dict[str, float]] = []
        t0 = time.perf_counter()
        pending: tuple[int, dict[tuple[str, str], Any], list[str]] | None = None
        for step in range(start_step, total):
            values, ran = self._step(step, states, instances)
            if pending is not None:  # the previous step's metrics: its compute overlapped this step's dispatch
                metrics_log.append(self._step_metrics(*pending))
            pending = (step, {k: values[k] for k in self._metric_refs if k in values}, ran)
            del values  # what no metric reads is let go: the states hold their new values
        if pending is not None:
            metrics_log.append(self._step_metrics(*pending))
        states = {name: to_host(value) for name, value in states.items()}
        wall = time.perf_counter() - t0
        return RunResult(program.name, total, states, state_digest(states), wall, metrics_log, instances)

    def _on_devices(self, states: dict[str, Any]) -> dict[str, Any]:
        """``states`` on their slices' devices, each laid out as its init lays it out (copied from the host once,
        not at every read)."""
        import jax

        out = {}
        for name, value in states.items():
            leaves, tree = jax.tree_util.tree_flatten(value)
            layout = self._state_layouts.get(name)
            fits = layout is not None and len(layout) == len(leaves)
            out[name] = tree.unflatten(place(leaves, layout, None, "checkpoint")) if fits else value
        return out

    def _step(self, step: int, states: dict[str, Any],
              instances: dict[str, int]) -> tuple[dict[tuple[str, str], Any], list[str]]:
        """Dispatch every instance of ``step`` (host sources run here); ``states`` gets the step's updates.
        Returns the step's values (per step: value; per microbatch: list of M values) and the nodes that ran."""
        import jax
        import numpy as np

        program = self.compiled.program
        m = program.microbatches
        values: dict[tuple[str, str], Any] = {}
        ran: list[str] = []
        for name in self.compiled.order:
            node = self.compiled.nodes[name]
            if step % node.every:
                continue
            ran.append(name)
            mbs = range(m) if node.per == "microbatch" else [None]
            results = []
            at = step if node.clock else self.skips.position(step)  # the stream position a source reads
            for mb in mbs:
                if node.host:  # plain Python, here as on a worker: the same leaves, the same dtypes
                    outs, _ = flat_leaves(node.outputs, program.nodes[name].fn(at, mb or 0),
                                          f"host source {name!r}")
                    outs = to_dtypes(outs, [a.dtype for o in node.outputs
                                            for a in jax.tree_util.tree_leaves(node.out_avals[o])])
                    results.append(list(node.unflatten_outputs(outs).values()))
                    instances[name] += 1
                    continue
                if node.is_source:
                    args = [np.int32(at), np.int32(mb or 0)]
                else:
                    args = [self._resolve(node.inputs[a], mb, values, states) for a in node.input_names]
                flat = place(node.flatten_inputs(args), self._layouts[name], None, "transfer", small="call")
                results.append(list(node.unflatten_outputs(list(self._calls[name](*flat))).values()))
                instances[name] += 1
            for i, out in enumerate(node.outputs):
                per_mb = [r[i] for r in results]
                values[(name, out)] = per_mb if node.per == "microbatch" else per_mb[0]
        for sname, cs in self.compiled.states.items():
            if cs.producer is not None and cs.producer[0] in ran:
                states[sname] = values[cs.producer]
        return values, ran

    def _step_metrics(self, step: int, values: dict[tuple[str, str], Any], ran: list[str]) -> dict[str, float]:
        """The step's metrics, copied off the devices together, through the ``--on-nonfinite`` policy node by
        node (as the coordinator checks each ``InstanceDone``); then ``on_step``."""
        import numpy as np

        host = dict(zip(values, to_host(list(values.values())), strict=True))
        for name in ran:
            node = self.compiled.nodes[name]
            n = self.compiled.program.microbatches if node.per == "microbatch" else 1
            results = [[(host[(name, o)][i] if node.per == "microbatch" else host[(name, o)])
                        if (name, o) in host else None for o in node.outputs] for i in range(n)]
            self._check_finite(step, name, results, node.outputs)
        metrics = {}
        for mname, ref in self.compiled.program.metrics.items():
            v = host.get((ref.node, ref.output))
            if v is not None:
                metrics[mname] = (float(np.mean([np.asarray(x, dtype=np.float64) for x in v]))
                                  if isinstance(v, list) else float(v))
        if self.on_step is not None:
            self.on_step(step, metrics)
        return metrics

    def _check_finite(self, step: int, node: str, results: list[list[Any]], outputs: Sequence[str]) -> None:
        """Each instance's metrics through the cluster's ``--on-nonfinite`` policy (as the coordinator checks
        each ``InstanceDone``)."""
        names = {(ref.node, ref.output): m for m, ref in self.compiled.program.metrics.items() if ref.node == node}
        if not names:
            return
        for mb, outs in enumerate(results):
            got = {names[(node, o)]: float(v) for o, v in zip(outputs, outs, strict=True) if (node, o) in names}
            report, stop = self.guard.check(nonfinite_values(got, step, node, mb))
            for bad in report:
                if self.on_event is not None:
                    self.on_event({"event": "job.nonfinite", "job": self.compiled.name, "step": bad.step,
                                   "metric": bad.metric, "value": repr(bad.value), "node": bad.node,
                                   "microbatch": bad.microbatch, "action": self.guard.mode})
            if stop is not None:
                raise NonFiniteStopped(f"job {self.compiled.name!r} failed: {stopped_at(stop)}the reference run "
                                       "keeps no checkpoints: fix the cause and run it again")

    @staticmethod
    def _resolve(src: Any, mb: int | None, values: dict[tuple[str, str], Any], states: dict[str, Any]) -> Any:
        if isinstance(src, StateRef):
            return states[src.name]
        if isinstance(src, Gathered):
            return stack_microbatches(values[(src.ref.node, src.ref.output)])
        assert isinstance(src, Ref)
        v = values[(src.node, src.output)]
        return v[mb] if isinstance(v, list) else v


def _shardings(blob: bytes, mesh: Any, which: str) -> list[Any]:
    """How an exported program takes its flat arguments (``which`` "in") or lays out its results ("out") on
    ``mesh`` (unspecified: replicated)."""
    import jax

    exp = jax.export.deserialize(bytearray(blob))
    return arg_shardings(exp.in_shardings_jax(mesh) if which == "in" else exp.out_shardings_jax(mesh), mesh)


def run_reference(program: Program, *, steps: int | None = None,
                  on_step: Callable[[int, dict[str, float]], None] | None = None,
                  on_nonfinite: str | None = None, skips: Skips = Skips()) -> RunResult:
    """Compile and run ``program`` in this process (``skips``: the stream positions it skips)."""
    return ReferenceExecutor(compile_program(program), on_step=on_step, on_nonfinite=on_nonfinite,
                             skips=skips).run(steps)

"""The in-process reference executor and the state digest.

The reference runs a compiled program in one process, with no workers: the same
exported programs (deserialized from the same bytes), on meshes of the same device
shapes, fed the same inputs. Because JAX programs are deterministic on the same
device shape and sources are functions of the step, a run on the cluster must end
in **bitwise the same state**; :func:`state_digest` is how that is checked.

Values move between nodes as host arrays (numpy), exactly as they cross the wire
between workers; a gather stacks the microbatches of a step on axis 0 with numpy.
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
from rallypoint.workers.sources.values import flat_leaves, to_dtypes
from rallypoint.workers.programs import load_exported


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
    """Stack the per-microbatch values of one step on a new leading axis (numpy: exact)."""
    import jax
    import numpy as np

    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *values)


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
    """

    def __init__(
        self, compiled: CompiledProgram, *, on_step: Callable[[int, dict[str, float]], None] | None = None,
        devices: Sequence[Any] | None = None, on_nonfinite: str | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.compiled = compiled
        self.on_step = on_step
        self.guard = NonFiniteGuard(nonfinite_mode(on_nonfinite))
        self.on_event = on_event
        program = compiled.program
        meshes = {name: slice_mesh(program, name, devices) for name in program.slices}
        self._calls = {n: load_exported(c.exported, meshes[c.slice]) for n, c in compiled.nodes.items()}
        self._inits = {s: load_exported(c.exported_init, meshes[c.slice]) for s, c in compiled.states.items()}

    def initial_state(self) -> dict[str, Any]:
        """Every state's step-0 value: from its pretrained checkpoint (``init_from``: the same bytes a worker
        reads, checked against the same checksum), else from its exported init."""
        out = {}
        for name, init in self._inits.items():
            cs = self.compiled.states[name]
            out[name] = cs.tree.unflatten(cs.init_from.load(name) if cs.init_from is not None
                                          else to_host(list(init())))
        return out

    def run(self, steps: int | None = None, *, state: dict[str, Any] | None = None, start_step: int = 0) -> RunResult:
        """Run ``steps`` steps (default: the program's) from ``state`` (default: init)."""
        import jax
        import numpy as np

        program: Program = self.compiled.program
        total = program.steps if steps is None else steps
        m = program.microbatches
        states = dict(state) if state is not None else self.initial_state()
        instances = dict.fromkeys(self.compiled.nodes, 0)
        metrics_log: list[dict[str, float]] = []
        t0 = time.perf_counter()
        for step in range(start_step, total):
            values: dict[tuple[str, str], Any] = {}  # per step: value; per microbatch: list of M values
            ran: set[str] = set()
            for name in self.compiled.order:
                node = self.compiled.nodes[name]
                if step % node.every:
                    continue
                ran.add(name)
                mbs = range(m) if node.per == "microbatch" else [None]
                results = []
                for mb in mbs:
                    if node.host:  # plain Python, here as on a worker: the same leaves, the same dtypes
                        outs, _ = flat_leaves(node.outputs, program.nodes[name].fn(step, mb or 0),
                                              f"host source {name!r}")
                        outs = to_dtypes(outs, [a.dtype for o in node.outputs
                                                for a in jax.tree_util.tree_leaves(node.out_avals[o])])
                        results.append(list(node.unflatten_outputs(outs).values()))
                        instances[name] += 1
                        continue
                    if node.is_source:
                        args = [np.int32(step), np.int32(mb or 0)]
                    else:
                        args = [self._resolve(node.inputs[a], mb, values, states) for a in node.input_names]
                    outs = self._calls[name](*node.flatten_inputs(args))
                    results.append(list(node.unflatten_outputs(to_host(list(outs))).values()))
                    instances[name] += 1
                for i, out in enumerate(node.outputs):
                    per_mb = [r[i] for r in results]
                    values[(name, out)] = per_mb if node.per == "microbatch" else per_mb[0]
                self._check_finite(step, name, results, node.outputs)
            for sname, cs in self.compiled.states.items():
                if cs.producer is not None and cs.producer[0] in ran:
                    states[sname] = values[cs.producer]
            metrics = {}
            for mname, ref in program.metrics.items():
                v = values.get((ref.node, ref.output))
                if v is not None:
                    metrics[mname] = float(np.mean([np.asarray(x, dtype=np.float64) for x in v])) if isinstance(v, list) else float(v)
            metrics_log.append(metrics)
            if self.on_step is not None:
                self.on_step(step, metrics)
        wall = time.perf_counter() - t0
        return RunResult(program.name, total, states, state_digest(states), wall, metrics_log, instances)

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


def run_reference(program: Program, *, steps: int | None = None,
                  on_step: Callable[[int, dict[str, float]], None] | None = None,
                  on_nonfinite: str | None = None) -> RunResult:
    """Compile and run ``program`` in this process."""
    return ReferenceExecutor(compile_program(program), on_step=on_step, on_nonfinite=on_nonfinite).run(steps)

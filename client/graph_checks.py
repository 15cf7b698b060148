"""The checks of a :class:`~rallypoint.client.program.Program` that need its whole graph: the order of
its nodes within a step (:func:`topo_order`), its edges and state producers (:func:`validate`) and
whether it fits a cluster's shape (:func:`validate_for_cluster`). Each takes the program
(typed ``Any``: this module sits below ``program.py``) and raises
:class:`~rallypoint.client.errors.ProgramError` naming the node, edge or slice at fault.
"""

from __future__ import annotations

from typing import Any

from rallypoint.client.errors import ProgramError
from rallypoint.client.refs import Gathered, Ref, StateRef


def topo_order(prog: Any) -> list[str]:
    """Nodes in an order where every within-step edge points forward."""
    deps = {n: sorted(_within_step_deps(prog, n)) for n in prog.nodes}
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cycle = path[path.index(n):] + [n]
            raise ProgramError(f"cycle within a step: {' -> '.join(cycle)}; carry a value to the next step "
                               "with a state (updates=) instead")
        state[n] = 1
        for d in deps[n]:
            visit(d, path + [n])
        state[n] = 2
        order.append(n)

    for n in prog.nodes:  # declaration order breaks ties: deterministic
        visit(n, [])
    return order


def _within_step_deps(prog: Any, node: str) -> set[str]:
    out = set()
    for src in prog.nodes[node].inputs.values():
        if isinstance(src, Ref):
            out.add(src.node)
        elif isinstance(src, Gathered):
            out.add(src.ref.node)
    return out


def validate(prog: Any) -> None:
    """Structural checks that need the whole graph. Raises :class:`ProgramError`."""
    if not prog.nodes:
        raise ProgramError(f"program {prog.name!r} has no nodes")
    for n in prog.nodes.values():
        if n.is_source:
            continue
        for arg, src in n.inputs.items():
            edge = f"input {arg!r} of node {n.name!r}"
            if isinstance(src, StateRef):
                if src.name not in prog.states:
                    raise ProgramError(f"{edge} reads unknown state {src.name!r}")
                continue
            ref = src.ref if isinstance(src, Gathered) else src
            if not isinstance(ref, Ref):
                raise ProgramError(f"{edge} must be a node output, a state or gather(...), got {src!r}")
            producer = prog.nodes.get(ref.node)
            if producer is None or ref.output not in producer.outputs:
                raise ProgramError(f"{edge} reads {ref}, which no node produces")
            if isinstance(src, Gathered):
                if producer.per != "microbatch":
                    raise ProgramError(f"{edge}: gather({ref}) needs a per-microbatch output, {ref.node!r} runs per step")
                if n.per != "step":
                    raise ProgramError(f"{edge}: gather(...) feeds per-step nodes only; {n.name!r} runs per microbatch")
            elif producer.per == "microbatch" and n.per == "step":
                raise ProgramError(f"{edge} reads per-microbatch {ref} in a per-step node: use gather({ref})")
            if producer.every != 1 and not (producer.every == n.every):
                raise ProgramError(
                    f"{edge} reads {ref} from a node that runs every {producer.every} steps; only nodes with the "
                    "same `every` may read it (or make it a state with updates=)"
                )
    for name, st in prog.states.items():
        producers = [(n.name, o) for n in prog.nodes.values() for o, s in n.updates.items() if s == name]
        if len(producers) > 1:
            raise ProgramError(f"state {name!r} is produced by {len(producers)} nodes {producers}; exactly one may")
        if producers:
            node = prog.nodes[producers[0][0]]
            if node.per != "step":
                raise ProgramError(f"node {node.name!r} updates state {name!r} but runs per microbatch; "
                                   "updates must come from per-step nodes")
            if node.slice != st.slice:
                raise ProgramError(f"node {node.name!r} on slice {node.slice!r} updates state {name!r}, which "
                                   f"lives on slice {st.slice!r}: state stays on the slice that produces it")
    for mname, ref in prog.metrics.items():
        if ref.node not in prog.nodes or ref.output not in prog.nodes[ref.node].outputs:
            raise ProgramError(f"metric {mname!r} reads {ref}, which no node produces")
    topo_order(prog)


def validate_for_cluster(prog: Any, *, workers: int, devices_per_worker: int) -> None:
    """Checks against a cluster shape: each slice must fit one worker, or (a fixed device count larger than
    any worker) a gang of workers with equal shares (docs/multihost.md); the job must fit the cluster."""
    k = devices_per_worker
    gangs: dict[str, tuple[int, int]] = {}  # slice -> (members, devices each)
    for s in prog.slices.values():
        if s.devices <= k:
            continue
        if min(s.device_counts()) <= k:  # it may shrink onto one worker: it is placed on one, never a gang
            raise ProgramError(
                f"slice {s.name!r} needs {s.devices} devices but a worker has {k}; use --devices-per-worker or "
                "a smaller slice (a fixed device count larger than a worker runs on several: docs/multihost.md)")
        # the fewest members giving equal shares, as the placement chooses them (s.devices members of 1 always do)
        members = next(m for m in range(2, s.devices + 1) if s.devices % m == 0 and s.devices // m <= k)
        gangs[s.name] = (members, s.devices // members)
    free = [k] * workers
    for s in sorted(prog.slices.values(), key=lambda s: -s.devices):  # first fit, largest first
        members, each = gangs.get(s.name, (1, s.devices))
        fits = [i for i, f in enumerate(free) if f >= each][:members]
        if len(fits) < members:
            need = sum(x.devices for x in prog.slices.values())
            raise ProgramError(
                f"program {prog.name!r} does not fit the cluster: slice {s.name!r} ({s.devices} devices) finds no "
                f"worker with room ({need} devices in all, {workers} workers x {k}); add workers with --workers"
            )
        for i in fits:
            free[i] -= each

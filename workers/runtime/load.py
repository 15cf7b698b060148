"""Loading a job on this worker: a mesh per slice, the node programs, the resident states.

What :class:`rallypoint.workers.runtime.runtime.JobRuntime` builds from a ``LoadJobRequest``
before any instance runs: :func:`slice_meshes` checks the slices' local devices,
:func:`load_nodes` deserializes each node's exported program (or takes the
executable a warm spare compiled ahead, :mod:`rallypoint.workers.warm`), and
:func:`load_states` makes each resident state's first version: its init run on the
slice's mesh, or, for a runtime starting at a checkpoint, the restored value (at step 0, a state's
pretrained checkpoint's value when it has one: :mod:`rallypoint.workers.checkpoints.pretrained`).

A part of the job's own program that fails here for a reason no other worker would
escape (:func:`program_fault`: an exception in an init, an XLA compile error, out of
device memory, a shape error) raises :class:`ProgramFailed`: the service reports it
as such and the coordinator fails the job, blaming no worker. A failure of the worker
itself (a device that stops answering, XLA's ``INTERNAL`` or ``UNAVAILABLE``) stays an
ordinary exception: the coordinator suspects the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rallypoint.basics.errors import RallypointError
from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.workers.gang.lead import GangExecutable, GangSlice
from rallypoint.workers.gang.checkpoint import restore_for_gang
from rallypoint.workers.checkpoints.pretrained import load_pretrained
from rallypoint.workers.programs import load_exported, slice_mesh
from rallypoint.recovery.skips import Skips
from rallypoint.workers.errors import LoadError, RestoreError
from rallypoint.workers.runtime.state import Leaves, NodeProgress, StateVersions
from rallypoint.workers.residency import Copies, place
from rallypoint.workers.warm import NodeExecutable, WarmCache, arg_shardings, program_key

B = pb.InputBinding
MeshOf = Callable[[str, str], Any]
"""``mesh_of(what, slice)``: the slice's mesh (``what`` names the asker in the error)."""

# XLA status codes of a runtime error that the program itself causes, wherever it runs: out of
# memory, a program XLA rejects or cannot compile, a shape or index out of range. Any other
# (INTERNAL, UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED, DATA_LOSS, UNKNOWN, ...) may be the device's.
PROGRAM_XLA_CODES = ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNIMPLEMENTED", "OUT_OF_RANGE", "FAILED_PRECONDITION")


class ProgramFailed(RallypointError):
    """``part`` of the job's own program (``node 'train'``, ``state 'params' init``) failed here, deterministically."""

    def __init__(self, part: str, worker_id: str, exc: BaseException) -> None:
        self.part, self.worker_id = part, worker_id
        self.error = f"{type(exc).__name__}: {exc}"
        super().__init__(f"{part} failed on worker {worker_id}: {self.error}")


def program_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by deserializing, compiling or running part of the job's program,
    is the program's own (it fails the same on any worker) rather than this worker's.

    XLA's runtime errors say their status code first: the program's are :data:`PROGRAM_XLA_CODES`.
    Any other exception (a Python error while tracing or deserializing, a shape mismatch) is the program's.
    """
    if type(exc).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):
        return str(exc).lstrip().startswith(PROGRAM_XLA_CODES)
    return isinstance(exc, Exception) and not isinstance(exc, (OSError, MemoryError))


def _program_part(part: str, worker_id: str, run: Callable[[], Any]) -> Any:
    """``run()``, raising :class:`ProgramFailed` for ``part`` when it fails for a reason of the program's own."""
    try:
        return run()
    except Exception as exc:
        if program_fault(exc):
            raise ProgramFailed(part, worker_id, exc) from exc
        raise


@dataclass
class LoadedNode:
    """One node of the job loaded here: what it is, how to call it, which instances started.

    ``progress`` is the scheduler's (written under the job's lock); the rest is fixed at load.
    """

    prog: pb.NodeProgram  # without its exported bytes
    call: NodeExecutable
    mbs: tuple[int, ...]  # its instances per running step: the microbatches, or (-1,) for a per-step node
    progress: NodeProgress


def slice_meshes(req: pb.LoadJobRequest, devices: Sequence[Any], worker_id: str,
                 gang: Callable[[pb.SliceAssignment], Any] | None = None) -> MeshOf:
    """A mesh per assigned slice over this worker's local ``devices``; returns ``mesh_of(what, slice)``.

    A multi-host slice (``members`` listed) gets ``gang(sa)`` instead: its group, formed now
    (a :class:`~rallypoint.workers.gang.lead.GangSlice`, docs/multihost.md).

    Raises:
        LoadError: a slice's device indices do not fit this worker, or its mesh shape does not fit them
            (now), or ``mesh_of`` is asked for a slice not assigned here (later).
    """
    meshes: dict[str, Any] = {}
    for sa in req.slices:
        if sa.members:
            if gang is None:
                raise LoadError(f"slice {sa.slice!r} spans {len(sa.members)} workers; worker {worker_id} cannot "
                                "form its group")
            meshes[sa.slice] = gang(sa)
            continue
        bad = [i for i in sa.devices if not 0 <= i < len(devices)]
        if bad or not sa.devices:
            raise LoadError(f"slice {sa.slice!r}: local device indices {list(sa.devices)} do not fit worker "
                            f"{worker_id}, which has {len(devices)} devices")
        try:
            meshes[sa.slice] = slice_mesh([devices[i] for i in sa.devices], sa.mesh_shape, sa.mesh_axes)
        except ValueError as exc:
            raise LoadError(f"slice {sa.slice!r}: {exc}") from exc

    def mesh_of(what: str, slice_name: str) -> Any:
        if slice_name not in meshes:
            raise LoadError(f"{what} is on slice {slice_name!r}, which is not assigned to worker {worker_id}")
        return meshes[slice_name]

    return mesh_of


def load_nodes(req: pb.LoadJobRequest, mesh_of: MeshOf, *, microbatches: int, warm: WarmCache | None,
               program_sources: dict[str, str], worker_id: str = "") -> dict[str, LoadedNode]:
    """Every node of the request, in its (topological) order; ``program_sources`` gets
    ``{node: "warm" | "cold"}`` (compiled ahead, or at its first call).

    Raises:
        ProgramFailed: a node's exported program does not deserialize."""
    steps, start = int(req.steps), int(req.start_step)
    nodes: dict[str, LoadedNode] = {}
    assigned = {sa.slice: sa for sa in req.slices}
    for n in req.nodes:  # topological order: the order instances of a step run in
        mesh = mesh_of(f"node {n.name!r}", n.slice)
        entry = warm.take(program_key(req.job, n, assigned[n.slice])) if warm is not None else None
        call = _program_part(f"node {n.name!r}", worker_id, lambda: GangExecutable(n.exported, mesh)
                             if isinstance(mesh, GangSlice) else NodeExecutable(n.exported, mesh, entry))
        program_sources[n.name] = call.expected
        prog = pb.NodeProgram()
        prog.CopyFrom(n)
        prog.ClearField("exported")
        mbs = tuple(range(microbatches)) if n.per_microbatch else (-1,)
        nodes[n.name] = LoadedNode(prog, call, mbs, NodeProgress(n.every, mbs, steps, start))
    return nodes


def init_shardings(blob: bytes, mesh: Any) -> list[Any]:
    """How a state's exported init lays its leaves out on ``mesh`` (a restored value is put the same way)."""
    import jax

    if isinstance(mesh, GangSlice):
        return list(GangExecutable(blob, mesh).out_shardings)

    return arg_shardings(jax.export.deserialize(bytearray(blob)).out_shardings_jax(mesh), mesh)


def nodes_by_slice(req: pb.LoadJobRequest, nodes: Mapping[str, LoadedNode]) -> dict[str, list[LoadedNode]]:
    """Each assigned slice's nodes, in topological order (a slice may have none)."""
    return {sa.slice: [n for n in nodes.values() if n.prog.slice == sa.slice] for sa in req.slices}


def load_states(req: pb.LoadJobRequest, mesh_of: MeshOf, nodes: Mapping[str, LoadedNode],
                push_everies: Callable[[str], list[int]],
                restored: Mapping[str, Mapping[str, Leaves]], worker_id: str = "",
                copies: Copies | None = None, tiers: dict[str, str] | None = None) -> dict[str, StateVersions]:
    """Each resident state with its first version, on its slice's devices laid out as its init lays
    it out: the init's value (made there), or at a start step > 0 the checkpoint's (``restored``:
    slice -> state -> host leaves, copied on and counted in ``copies`` as ``checkpoint``; a multi-host
    slice's members read theirs here, each its own shards, and its tier goes to ``tiers``).
    ``push_everies(state)``: the ``every`` of each remote consumer the state is pushed to (the
    router's state routes).

    Raises:
        RestoreError: a checkpoint lacks one of its slice's states.
        LoadError: a state's value has the wrong number of leaves, or its slice is not assigned here.
        ProgramFailed: a state's init failed for a reason of its own (:func:`program_fault`).
    """
    steps, start = int(req.steps), int(req.start_step)
    states: dict[str, StateVersions] = {}
    shardings: dict[str, list[Any]] = {}  # state -> its init's output layouts (a restore's)

    def layouts(st: pb.StateProgram) -> list[Any]:
        if st.name not in shardings:
            mesh = mesh_of(f"state {st.name!r}", st.slice)
            shardings[st.name] = _program_part(f"state {st.name!r} init", worker_id,
                                               lambda: init_shardings(st.exported_init, mesh))
        return shardings[st.name]

    restored = dict(restored)
    for sa in req.slices if start > 0 else ():
        mesh, held = mesh_of(f"slice {sa.slice!r}", sa.slice), [st for st in req.states if st.slice == sa.slice]
        if isinstance(mesh, GangSlice) and held:  # docs/multihost.md: nothing gathered
            restored[sa.slice] = restore_for_gang(req, sa.slice, mesh, {st.name: layouts(st) for st in held}, tiers)
    for st in req.states:
        readers = [(n.prog.every, len(n.mbs)) for n in nodes.values() for b in n.prog.inputs
                   if b.kind == B.STATE and b.state == st.name]
        sv = StateVersions(st.name, st.producer_every if st.producer_node else 0, steps, readers,
                           push_everies(st.name), start=start)
        if start > 0:
            leaves = restored[st.slice].get(st.name)
            if leaves is None:
                raise RestoreError(f"the checkpoint of slice {st.slice!r} at step {start} lacks "
                                   f"state {st.name!r}", slice_name=st.slice, step=start)
        elif st.HasField("init_from"):  # pretrained weights: the same bytes at every load before the first cut
            f = st.init_from
            leaves = _program_part(f"state {st.name!r} init_from", worker_id,
                                   lambda: load_pretrained(st.name, f.path, f.keys, f.checksum))
        else:
            mesh = mesh_of(f"state {st.name!r}", st.slice)
            leaves = _program_part(f"state {st.name!r} init", worker_id,
                                   lambda: list(GangExecutable(st.exported_init, mesh)() if isinstance(mesh, GangSlice)
                                                else load_exported(st.exported_init, mesh)()))
        if len(leaves) != st.leaves:
            raise LoadError(f"state {st.name!r} has {len(leaves)} leaves, expected {st.leaves}")
        if start > 0 or st.HasField("init_from"):
            leaves = place(leaves, layouts(st), copies, "checkpoint")
        sv.add(sv.key(start), leaves)
        states[st.name] = sv
    return states


def load_skips(req: pb.LoadJobRequest) -> Skips:
    """The stream positions the run skips (``req.skips``).

    Raises:
        LoadError: ranges that are not sorted and apart, or too many (the request is refused, nothing loaded).
    """
    try:
        return Skips.from_proto(req.skips)
    except ValueError as exc:
        raise LoadError(f"job {req.job!r}: its skipped stream positions are refused: {exc}") from None

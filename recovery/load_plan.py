"""From a job spec and a placement to what each worker loads: pure, tested without processes.

Every value that crosses from one slice to another gets a **route** on its producer's
worker: a node output read by a node on another slice (or on the same worker's
other slice: delivered locally), and a state read by a node on another slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.slices import devices_needed


@dataclass(frozen=True, slots=True)
class SlicePlace:
    """Where one virtual slice runs: ``devices`` of ``worker``, or, for a multi-host slice, its gang
    ``members`` (each a place of its own, process-id order), the first of which is ``worker`` and drives it."""

    worker: str
    address: str
    incarnation: int
    devices: tuple[int, ...]
    data_address: str = ""
    members: tuple[SlicePlace, ...] = ()

    @property
    def count(self) -> int:
        """How many devices the slice runs on, on every member together."""
        return sum(len(m.devices) for m in self.members) if self.members else len(self.devices)


def instances_per_step(spec: pb.JobSpec, step: int) -> int:
    """How many node instances step ``step`` has in all."""
    return sum(
        (spec.microbatches if n.per_microbatch else 1) for n in spec.nodes if step % max(n.every, 1) == 0
    )


def load_requests(spec: pb.JobSpec, placement: dict[str, SlicePlace], *, cluster: str, term: int) -> dict[str, pb.LoadJobRequest]:
    """One ``LoadJobRequest`` per worker that holds a slice of the job."""
    missing = [s.slice for s in spec.slices if s.slice not in placement]
    if missing:
        raise ValueError(f"slices without a placement: {missing}")
    node_slice = {n.name: n.slice for n in spec.nodes}
    state_slice = {s.name: s.slice for s in spec.states}
    requests: dict[str, pb.LoadJobRequest] = {}

    def request(worker: str) -> pb.LoadJobRequest:
        if worker not in requests:
            place = next(p for p in placement.values() if p.worker == worker)
            requests[worker] = pb.LoadJobRequest(
                to=pb.Identity(cluster=cluster, worker_id=worker, incarnation=place.incarnation, term=term),
                job=spec.job, steps=spec.steps, microbatches=spec.microbatches,
            )
        return requests[worker]

    shapes = {s.slice: list(s.mesh_shape) for s in spec.slices}
    counts: dict[str, int] = {}  # a slice placed on another device count than its mesh's (shrunk)
    for s in spec.slices:
        place = placement[s.slice]
        if place.count != devices_needed(s):
            counts[s.slice] = place.count
            shapes[s.slice] = _variant(spec, s.slice, place.count).mesh_shape
        req = request(place.worker)
        req.slices.append(pb.SliceAssignment(
            slice=s.slice, devices=place.devices, mesh_shape=shapes[s.slice], mesh_axes=s.mesh_axes,
            members=[pb.GangMember(worker_id=m.worker, address=m.address, incarnation=m.incarnation,
                                   devices=len(m.devices), device_ids=m.devices) for m in place.members]))
    for st in spec.states:
        msg = pb.StateProgram()
        msg.CopyFrom(st)
        msg.ClearField("init_variants")  # a worker gets the one program of its device count
        if st.slice in counts:
            msg.exported_init = next(v.exported for v in st.init_variants if v.devices == counts[st.slice])
        request(placement[st.slice].worker).states.append(msg)
    for node in spec.nodes:
        consumer = placement[node.slice]
        msg = pb.NodeProgram()
        msg.CopyFrom(node)
        msg.ClearField("variants")
        if node.slice in counts:
            msg.exported = next(v.exported for v in node.variants if v.devices == counts[node.slice])
        request(consumer.worker).nodes.append(msg)
        for b in node.inputs:
            if b.kind in (pb.InputBinding.REF, pb.InputBinding.GATHER):
                producer = placement[node_slice[b.node]]
                route = pb.Route(node=b.node, output=b.output)
            elif b.kind == pb.InputBinding.STATE and state_slice[b.state] != node.slice:
                producer = placement[state_slice[b.state]]
                route = pb.Route(state=b.state)
            else:
                continue
            route.consumer_node, route.arg, route.consumer_every = node.name, b.arg, node.every
            route.worker_id, route.address, route.incarnation = consumer.worker, consumer.address, consumer.incarnation
            route.data_address = consumer.data_address
            request(producer.worker).routes.append(route)
    return requests


def _variant(spec: pb.JobSpec, slice_name: str, count: int) -> pb.ExportedVariant:
    """The exported variant of a slice's programs for ``count`` devices (its first node's, for the mesh shape).

    Raises:
        ValueError: the job did not export the slice for that many devices.
    """
    for n in spec.nodes:
        if n.slice == slice_name:
            for v in n.variants:
                if v.devices == count:
                    return v
    raise ValueError(f"slice {slice_name!r} has no programs for {count} devices (declare devices=(min, max))")


def device_counts(spec: pb.JobSpec) -> dict[str, tuple[int, ...]]:
    """Every device count each slice's programs were exported for, largest first."""
    out = {}
    for s in spec.slices:
        full = devices_needed(s)
        others = {v.devices for n in spec.nodes if n.slice == s.slice for v in n.variants}
        out[s.slice] = tuple(sorted({full, *others}, reverse=True))
    return out

"""From a job spec and a placement to what each worker loads: pure, tested without processes.

Every value that crosses from one slice to another gets a **route** on its producer's
worker: a node output read by a node on another slice (or on the same worker's
other slice: delivered locally), and a state read by a node on another slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from rallypoint.proto import rallypoint_pb2 as pb


@dataclass(frozen=True, slots=True)
class SlicePlace:
    """Where one virtual slice runs."""

    worker: str
    address: str
    incarnation: int
    devices: tuple[int, ...]
    data_address: str = ""


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

    for s in spec.slices:
        place = placement[s.slice]
        req = request(place.worker)
        req.slices.append(pb.SliceAssignment(slice=s.slice, devices=place.devices, mesh_shape=s.mesh_shape,
                                             mesh_axes=s.mesh_axes))
    for st in spec.states:
        request(placement[st.slice].worker).states.append(st)
    for node in spec.nodes:
        consumer = placement[node.slice]
        request(consumer.worker).nodes.append(node)
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

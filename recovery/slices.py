"""What a job spec says of its virtual slices, computed once for every layer above: the
devices each slice needs and the slices that hold states (those that save checkpoints)."""

from __future__ import annotations

import math

from rallypoint.proto import rallypoint_pb2 as pb


def devices_needed(s: pb.SliceAssignment) -> int:
    """The devices one slice declares: the product of its mesh's shape (1 for no mesh)."""
    return math.prod(int(d) for d in s.mesh_shape)


def slice_devices(spec: pb.JobSpec) -> dict[str, int]:
    """Every slice of ``spec`` -> the devices it declares."""
    return {s.slice: devices_needed(s) for s in spec.slices}


def stateful_slices(spec: pb.JobSpec) -> list[str]:
    """The slices that hold a state of ``spec`` (they save checkpoints), sorted."""
    return sorted({st.slice for st in spec.states})

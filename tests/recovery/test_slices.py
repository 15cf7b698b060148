"""What a job spec says of its slices: the devices each needs and those that hold states."""

from __future__ import annotations

from rallypoint.proto import rallypoint_pb2 as pb
from rallypoint.recovery.slices import devices_needed, slice_devices, stateful_slices


def test_a_slice_needs_the_product_of_its_mesh_and_one_device_without_a_mesh() -> None:
    assert devices_needed(pb.SliceAssignment(slice="s", mesh_shape=[2, 4])) == 8
    assert devices_needed(pb.SliceAssignment(slice="s", mesh_shape=[3])) == 3
    assert devices_needed(pb.SliceAssignment(slice="s")) == 1
    spec = pb.JobSpec(slices=[pb.SliceAssignment(slice="a", mesh_shape=[2, 2]), pb.SliceAssignment(slice="b")])
    assert slice_devices(spec) == {"a": 4, "b": 1}


def test_the_slices_that_hold_states_are_listed_once_each_sorted() -> None:
    spec = pb.JobSpec(slices=[pb.SliceAssignment(slice=s) for s in ("c", "b", "a")],
                      states=[pb.StateProgram(name="w2", slice="c"), pb.StateProgram(name="w1", slice="a"),
                              pb.StateProgram(name="opt", slice="c")])
    assert stateful_slices(spec) == ["a", "c"]  # b holds no state: it saves no checkpoint
    assert stateful_slices(pb.JobSpec(slices=[pb.SliceAssignment(slice="a")])) == []
